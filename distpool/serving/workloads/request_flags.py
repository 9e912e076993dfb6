"""The request flags of `distpool run`, checked against each other, and the requests they stand for.

Requests come from a prompts file (`--prompts`) or are generated (`--requests`, `--workload`,
`--turns`, `--min-prompt-len`, `--max-prompt-len`). A flag left out is None here, so that a flag
which cannot apply is refused when given, never silently ignored: the generation flags with a
prompts file, `--turns` without the multi-turn workload, the prompt-length bounds without `mixed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distpool.model.sampling import SamplingError, SamplingParams
from distpool.model_impl.hf.tokenizer import PromptTokenizer
from distpool.serving.workloads import conversation, workload
from distpool.serving.workloads.conversation import DEFAULT_TURNS, MultiTurn
from distpool.serving.workloads.workload import Request

DEFAULT_REQUESTS = 32
DEFAULT_WORKLOAD = "mixed"
DEFAULT_PROMPT_LEN = (4, 96)  # --min-prompt-len, --max-prompt-len of the mixed workload


@dataclass(frozen=True)
class RequestFlags:
    """The flags as given (None: left out)."""

    prompts: str | None = None
    requests: int | None = None
    workload: str | None = None
    turns: int | None = None
    min_prompt_len: int | None = None
    max_prompt_len: int | None = None
    max_new_tokens: int = 16
    seed: int = 0
    # Every request's generation parameters unless its --prompts line sets its own (greedy by default).
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.sampling  # noqa: B018  (a bad value is refused here, naming its flag)
        generation = {
            "--requests": self.requests,
            "--workload": self.workload,
            "--turns": self.turns,
            "--min-prompt-len": self.min_prompt_len,
            "--max-prompt-len": self.max_prompt_len,
        }
        given = [flag for flag, value in generation.items() if value is not None]
        if self.prompts is not None and given:
            raise ValueError(
                f"{given[0]} shapes generated requests, but --prompts reads them from {self.prompts}. "
                f"Fix: drop {given[0]}, or drop --prompts"
            )
        if self.turns is not None and self.workload != "multi-turn":
            raise ValueError(
                "--turns applies to --workload multi-turn only. Fix: drop it, or add that workload"
            )
        bounds = [f for f in ("--min-prompt-len", "--max-prompt-len") if generation[f] is not None]
        if bounds and (self.workload or DEFAULT_WORKLOAD) != "mixed":
            raise ValueError(
                f"{bounds[0]} bounds the mixed workload's prompts; --workload {self.workload} draws its "
                f"own lengths. Fix: drop {bounds[0]}"
            )

    @property
    def sampling(self) -> SamplingParams:
        """The run-wide generation parameters (`--max-new-tokens`, `--temperature`, `--top-p`,
        `--top-k`, `--ignore-eos`); ValueError naming the flag for a value out of range."""
        try:
            return SamplingParams(
                max_tokens=self.max_new_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                ignore_eos=self.ignore_eos,
            )
        except SamplingError as exc:
            flag = "--max-new-tokens" if exc.field == "max_tokens" else f"--{exc.field.replace('_', '-')}"
            raise ValueError(f"{flag} must be {exc.allowed}; got {exc.value!r}") from None

    def requests_for(
        self, *, vocab_size: int, context_len: int, tokenizer: PromptTokenizer | None = None
    ) -> list[Request] | MultiTurn:
        """The prompts file (its text prompts tokenized with `tokenizer`, when the model has one),
        else the generated workload (its prompts clipped to fit `context_len`)."""
        common = dict(
            vocab_size=vocab_size, max_new_tokens=self.max_new_tokens, seed=self.seed, context_len=context_len
        )
        common["sampling"] = self.sampling
        count = DEFAULT_REQUESTS if self.requests is None else self.requests
        name = self.workload or DEFAULT_WORKLOAD
        if self.prompts is None and name == "multi-turn":
            turns = DEFAULT_TURNS if self.turns is None else self.turns
            return conversation.generate_conversations(count, turns=turns, **common)
        if self.prompts is None:
            low, high = DEFAULT_PROMPT_LEN
            return workload.generate(
                count,
                workload=name,
                min_prompt=low if self.min_prompt_len is None else self.min_prompt_len,
                max_prompt=high if self.max_prompt_len is None else self.max_prompt_len,
                **common,
            )
        return workload.load_jsonl(
            self.prompts,
            vocab_size=vocab_size,
            max_new_tokens=self.max_new_tokens,
            tokenizer=tokenizer,
            sampling=self.sampling,
            context_len=context_len,
        )
