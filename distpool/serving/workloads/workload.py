"""Workloads for the main job: generated (seeded, by prompt-length distribution) or read from a JSONL file."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from distpool.memory.envelope import MAX_REQUEST_ID_CHARS as MAX_ID_CHARS  # an id must fit an envelope
from distpool.memory.prefix import chained_block_keys
from distpool.memory.sizing import PoolArgs
from distpool.model.sampling import SamplingError, SamplingParams
from distpool.model_impl.hf.tokenizer import PromptTokenizer

# What `run --workload` offers (the README lists these lines).
WORKLOADS = {
    "short": "prompts of 128-1024 tokens, uniform",
    "long-tailed": "95% lognormal around 1.5k tokens (256-2048), 5% from 2048 up to the context length",
    "long": "prompts of 8k-32k tokens, uniform (needs --context-len of 8192 + max new tokens or more)",
    "mixed": "prompts uniform in [--min-prompt-len, --max-prompt-len] (default 4-96)",
    "shared-prefix": "one system prompt of 1024-4096 tokens shared by every request, then 64-1024 of its own",
    "multi-turn": "conversations of --turns (8) turns: each prompt is the last one + its reply + 64-1024 new",
}
DEFAULT_VOCAB_SIZE = 32000  # token ids for a model config that states no vocab_size
SHORT_PROMPT = (128, 1024)
LONG_PROMPT = (8192, 32768)
# long-tailed: a lognormal body with median 1.5k, clipped to BODY_PROMPT (sigma 0.2 puts ~98% of it
# in 1k-2k); TAIL_SHARE of the requests are drawn uniform from the body's top up to the context length.
BODY_MEDIAN, BODY_SIGMA, BODY_PROMPT = 1536, 0.2, (256, 2048)
TAIL_SHARE = 0.05
# shared-prefix: one system prompt for all, clipped to leave USER_PART[0] tokens for the user part
# (half the room when the context is shorter); each request's own part is uniform in USER_PART.
SYSTEM_PROMPT, USER_PART = (1024, 4096), (64, 1024)
# The prompt tokens a generated workload may hold, counted before any is drawn: Python keeps a
# token in about 36 bytes (a list slot and an int), so 2**26 tokens is about 2.4 GB of driver memory.
MAX_WORKLOAD_TOKENS = 1 << 26


# What a --prompts line may set per request (distpool.model.sampling), besides its prompt and id;
# "max_new_tokens" is also read as max_tokens.
SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
)


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)  # its seed set by the server
    # block size -> the prompt's chained block keys, once a routing decision needed them
    _keys: dict[int, list[bytes]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_tokens

    def block_keys(self, block: int) -> list[bytes]:
        """The prompt's chained block keys (`chained_block_keys`), computed once per request however
        many routing decisions and attempts read them."""
        keys = self._keys.get(block)
        if keys is None:
            keys = self._keys[block] = chained_block_keys(self.prompt, block)
        return keys


def generate(
    num_requests: int,
    *,
    vocab_size: int,
    max_new_tokens: int,
    seed: int,
    workload: str = "mixed",
    context_len: int = PoolArgs.context_len,
    min_prompt: int = 4,
    max_prompt: int = 96,
    sampling: SamplingParams | None = None,
) -> list[Request]:
    """`num_requests` prompts of random token ids in [0, vocab_size), lengths drawn per `workload`.

    Every prompt is clipped to `context_len - max_new_tokens` tokens, so each request fits the context;
    `long` refuses a context too short for its shortest prompt instead. `min_prompt` and `max_prompt`
    bound `mixed` only. The same arguments give the same requests. `vocab_size` 0: DEFAULT_VOCAB_SIZE.
    `sampling`: every request's parameters but max_tokens (None: greedy).
    `multi-turn` is not a list of requests (each turn needs the last one's reply): see
    `serving.workloads.conversation.generate_conversations`.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if workload == "multi-turn":
        raise ValueError("multi-turn is served turn by turn: use conversation.generate_conversations")
    if num_requests < 1 or not 1 <= min_prompt <= max_prompt or max_new_tokens < 1 or vocab_size < 0:
        raise ValueError(
            f"bad workload: requests={num_requests}, prompt lengths [{min_prompt}, {max_prompt}], "
            f"max_new_tokens={max_new_tokens}, vocab_size={vocab_size}; requests, lengths and "
            "max_new_tokens must be >= 1, min <= max, and vocab_size >= 0"
        )
    limit = prompt_room(context_len, max_new_tokens)
    check_workload_size(num_requests, _mean_prompt_len(workload, limit, (min_prompt, max_prompt)))
    if workload == "long" and limit < LONG_PROMPT[0]:
        raise ValueError(
            f"the long workload needs prompts of {LONG_PROMPT[0]} tokens or more: raise --context-len to "
            f"at least {LONG_PROMPT[0] + max_new_tokens} (it is {context_len})"
        )
    params = replace(sampling or SamplingParams(), max_tokens=max_new_tokens)
    rng = random.Random(seed)
    tokens = range(vocab_size or DEFAULT_VOCAB_SIZE)
    shared = _system_prompt(rng, tokens, limit) if workload == "shared-prefix" else []
    requests = []
    for i in range(num_requests):
        length = min(_prompt_len(rng, workload, limit, (min_prompt, max_prompt)), limit - len(shared))
        requests.append(
            Request(
                request_id=f"req-{i:05d}",
                prompt=shared + rng.choices(tokens, k=length),  # not randrange per token: 32k tokens in ms
                params=params,
            )
        )
    return requests


def prompt_room(context_len: int, max_new_tokens: int) -> int:
    """The longest prompt that leaves room for `max_new_tokens` in the context; refuses none."""
    if context_len - max_new_tokens < 1:
        raise ValueError(
            f"--context-len {context_len} leaves no room for a prompt before {max_new_tokens} new tokens; "
            "raise --context-len or lower --max-new-tokens"
        )
    return context_len - max_new_tokens


def check_workload_size(num_requests: int, mean_prompt_tokens: float) -> None:
    """Refuse a workload whose prompts would hold more than MAX_WORKLOAD_TOKENS tokens in all (by
    their mean length), before a single one is drawn."""
    expected = num_requests * mean_prompt_tokens
    if expected > MAX_WORKLOAD_TOKENS:
        most = int(MAX_WORKLOAD_TOKENS // mean_prompt_tokens)
        raise ValueError(
            f"--requests {num_requests} of about {mean_prompt_tokens:,.0f} prompt tokens each would hold "
            f"{expected:,.0f} tokens in memory before the run starts; a run generates at most "
            f"{MAX_WORKLOAD_TOKENS:,}. Fix: --requests {most} or fewer (run several runs for more)"
        )


def _mean_prompt_len(workload: str, limit: int, mixed: tuple[int, int]) -> float:
    """The mean prompt length a workload draws, clipped to `limit` (a bound's estimate, not a plan)."""
    if workload == "long-tailed":
        tail = (BODY_PROMPT[1] + max(BODY_PROMPT[1], limit)) / 2
        mean = (1 - TAIL_SHARE) * BODY_MEDIAN + TAIL_SHARE * tail
    else:
        low, high = {
            "short": SHORT_PROMPT,
            "long": (LONG_PROMPT[0], min(LONG_PROMPT[1], limit)),
            "shared-prefix": (SYSTEM_PROMPT[0] + USER_PART[0], SYSTEM_PROMPT[1] + USER_PART[1]),
        }.get(workload, mixed)
        mean = (low + high) / 2
    return min(mean, limit)


def _system_prompt(rng: random.Random, tokens: range, limit: int) -> list[int]:
    """shared-prefix's system prompt: SYSTEM_PROMPT tokens, leaving room for a user part in `limit`."""
    room = max(limit - USER_PART[0], (limit + 1) // 2)
    return rng.choices(tokens, k=min(rng.randint(*SYSTEM_PROMPT), room))


def _prompt_len(rng: random.Random, workload: str, limit: int, mixed: tuple[int, int]) -> int:
    """One prompt length (shared-prefix: its user part) before clipping to `limit`."""
    if workload == "short":
        return rng.randint(*SHORT_PROMPT)
    if workload == "shared-prefix":
        return rng.randint(*USER_PART)  # after the system prompt
    if workload == "long":
        return rng.randint(LONG_PROMPT[0], min(LONG_PROMPT[1], limit))
    if workload == "long-tailed":
        if rng.random() < TAIL_SHARE:
            return rng.randint(BODY_PROMPT[1], max(BODY_PROMPT[1], limit))
        body = round(rng.lognormvariate(math.log(BODY_MEDIAN), BODY_SIGMA))
        return max(BODY_PROMPT[0], min(body, BODY_PROMPT[1]))
    return rng.randint(*mixed)


def load_jsonl(
    path: str | Path,
    *,
    vocab_size: int,
    max_new_tokens: int,
    tokenizer: PromptTokenizer | None = None,
    sampling: SamplingParams | None = None,
    context_len: int | None = None,
) -> list[Request]:
    """One request per line: {"prompt_ids": [int, ...]} or {"prompt": "text"} (not both), with
    optional "max_new_tokens" and "id", and any of SAMPLING_FIELDS (else `sampling`'s, the run's
    defaults). Text is tokenized with the model's `tokenizer`, or without one taken as its UTF-8
    bytes modulo the vocabulary. `vocab_size` 0: DEFAULT_VOCAB_SIZE. A request longer than
    `context_len` (prompt and new tokens) is refused, naming its line."""
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
    requests = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read prompts file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompts file {path} is not UTF-8 text (byte {exc.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise ValueError(f"{where}: the JSON nests too deeply to be a prompt") from None
        except ValueError as exc:  # e.g. an integer of more than 4,300 digits
            raise ValueError(f"{where}: invalid JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        if "prompt_ids" in row and "prompt" in row:
            raise ValueError(
                f'{where}: give "prompt_ids" or "prompt", not both (which one to serve is unclear)'
            )
        if "prompt_ids" in row:
            ids = row["prompt_ids"]
            if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
                raise ValueError(f"{where}: prompt_ids must be a list of ints in [0, {vocab_size})")
        elif isinstance(row.get("prompt"), str) and tokenizer is not None:
            ids = _tokenized(tokenizer, row["prompt"], where, vocab_size)
        elif isinstance(row.get("prompt"), str):
            ids = [b % vocab_size for b in _utf8(row["prompt"], where, "prompt")]
        else:
            raise ValueError(f'{where}: needs "prompt_ids" (list of ints) or "prompt" (string)')
        new = row.get("max_new_tokens", max_new_tokens)
        if not ids or type(new) is not int or new < 1:
            raise ValueError(f"{where}: the prompt must be non-empty and max_new_tokens an int >= 1")
        rid = row.get("id", f"req-{number:05d}")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool) or not 0 < len(str(rid)) <= MAX_ID_CHARS:
            raise ValueError(f"{where}: id must be a string (or number) of 1 to {MAX_ID_CHARS} characters")
        _utf8(str(rid), where, "id")  # an envelope carries it as UTF-8
        params = _line_params(row, replace(sampling or SamplingParams(), max_tokens=new), where, vocab_size)
        if context_len is not None and len(ids) + params.max_tokens > context_len:
            raise ValueError(
                f"{where}: {len(ids)} prompt tokens and {params.max_tokens} new tokens are longer than "
                f"--context-len {context_len}. Fix: raise --context-len, or shorten the request"
            )
        requests.append(Request(request_id=str(rid), prompt=ids, params=params))
    if not requests:
        raise ValueError(f"{path}: no requests")
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError(f"{path}: request ids must be unique")
    return requests


def _line_params(row: dict, defaults: SamplingParams, where: str, vocab_size: int) -> SamplingParams:
    """The generation parameters a line sets over `defaults` (max_new_tokens already in them)."""
    given = {name: row[name] for name in SAMPLING_FIELDS if name in row}
    if "max_tokens" in given and "max_new_tokens" in row:
        raise ValueError(f"{where}: max_tokens and max_new_tokens both given. Fix: keep one")
    if isinstance(given.get("stop_token_ids"), list):
        given["stop_token_ids"] = tuple(given["stop_token_ids"])
    try:
        params = replace(defaults, **given)
    except SamplingError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if outside := [t for t in params.stop_token_ids if t >= vocab_size]:
        raise ValueError(f"{where}: stop_token_ids must be token ids in [0, {vocab_size}); got {outside[0]}")
    return params


def _tokenized(tokenizer: PromptTokenizer, text: str, where: str, vocab_size: int) -> list[int]:
    _utf8(text, where, "prompt")  # a lone surrogate is refused as without a tokenizer
    ids = tokenizer.encode(text)
    if outside := [t for t in ids if not 0 <= t < vocab_size]:
        raise ValueError(
            f"{where}: the tokenizer in {tokenizer.folder} gives token id {outside[0]}, outside the "
            f"model's vocabulary [0, {vocab_size}). Fix: put the model's own tokenizer in its folder, "
            "or give prompt_ids"
        )
    return ids


def _utf8(text: str, where: str, field: str) -> bytes:
    """`text` as UTF-8; a lone surrogate (JSON allows "\\ud800") is refused naming file:line."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}: {field} is not valid text (a lone surrogate at character {exc.start})"
        ) from None
