"""A stand-in for a real model of any size: writes every byte of an envelope with a pattern that a
decode worker can verify byte for byte. No weights, no arithmetic beyond hashing.

The pattern (functions in `pattern.py`; H_k is the prefix hash of the first k tokens):
- KV row of token position p in layer l (K and V, full and sliding-window): base[l, what] XOR
  hash(seed, l, what, H_{p+1}); a row depends on its prefix only, so shared prefixes share bytes.
- A Mamba state tensor after prefill of n tokens: base[l, name] XOR hash(seed, l, name, H_n) in
  every word. Each tensor's W words are cut into min(16, W) stripes of ceil(W / stripes) words, and
  the decode step that brings a request to n tokens rewrites only stripe n mod stripes, with H_n.
  So every stripe holds the hash of the last token count that wrote it (prefill wrote all of them),
  and a step costs about what a real step's state traffic would, not a whole slot.
- The token generated after n tokens: splitmix64(H_n ^ TOKEN_KEY ^ seed) mod vocab.
A colocated run and a disaggregated run therefore give the same tokens and the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from distpool.facts import Facts
from distpool.memory.pool import Pool
from distpool.model.sampling import TokenPick
from distpool.model.shard import RankShard
from distpool.model.spec import ModelSpec
from distpool.model_impl.decode_job import check_token_ids
from distpool.model_impl.errors import (
    ALREADY_REGISTERED,
    DUPLICATE_REQUEST,
    EMPTY_PROMPT,
    NOT_EXTENDED,
    NOT_REGISTERED,
    TOKENS_NOT_RESERVED,
    WRONG_TOKEN,
    BatchRefused,
)
from distpool.model_impl.pool_model import Mismatch, PoolModel
from distpool.model_impl.prefill_job import Prefilled, PrefillJob, check_jobs, prefilled
from distpool.model_impl.synthetic.envelope import EnvelopePattern
from distpool.model_impl.synthetic.pattern import next_hash, prefix_hashes, token_after

DEFAULT_VOCAB_SIZE = 32000  # for specs that do not state one


class CorruptCheckpoint(Facts, Exception):
    """A checkpoint that does not hold the state after the cached prefix it stands for: prefill
    refused to start from it (nothing was written). The caller evicts that checkpoint and prefills
    without the cached prefix."""

    def __init__(self, request_id: str, slot: int, num_tokens: int, mismatch: Mismatch) -> None:
        super().__init__(
            f"request {request_id!r}: checkpoint slot {slot} does not hold the state after its {num_tokens} "
            f"cached tokens ({mismatch})"
        )
        self.request_id, self.slot, self.num_tokens, self.mismatch = request_id, slot, num_tokens, mismatch


@dataclass
class _Record:
    """What the cache knows of a request it filled or admitted."""

    tokens: list[int]  # every token whose KV the envelope holds, prompt first
    prompt_len: int
    last_hash: int  # H_n, n = len(tokens)
    next_token: int  # the token the next decode step must feed


class SyntheticCache(PoolModel):
    """Fills and verifies envelopes with the synthetic pattern; the calling surface of ReferenceModel.

    Runs any spec (hybrid Mamba, hybrid SWA, dense, parallel hybrids, MLA, any dtype). The pattern
    is generated on `device`, which must be the pool's. With `shard` (`distpool.model.shard`), the
    pool is one tensor-parallel rank's, built from `shard.spec`: its bytes are the ones the unsharded
    tensors hold at the rank's coordinates, and the tokens are those of every other TP size.
    """

    name = "synthetic"
    verifies = True

    def __init__(
        self,
        spec: ModelSpec,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        shard: RankShard | None = None,
    ) -> None:
        self.spec = spec
        self.seed = seed
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.vocab_size = spec.vocab_size or DEFAULT_VOCAB_SIZE
        self.pattern = EnvelopePattern(spec, seed=seed, device=self.device, shard=shard)
        self._records: dict[str, _Record] = {}

    # ---- the calling surface -------------------------------------------------------------------
    def prefill(self, pool: Pool, jobs: Sequence[PrefillJob]) -> list[Prefilled]:
        """Write the KV rows after each request's cached prefix, its whole state and any snapshot's
        state (see `PoolModel.prefill`); register it for decode steps; the first tokens.

        A checkpoint is verified byte for byte before anything is written (`CorruptCheckpoint`
        otherwise): it must hold the state a prefill of the cached prefix writes. A job in place
        (its own slot, after decode steps: decode's local prefill) is not: its state is rewritten
        whole from the tokens, and the rows it continues from are verified when it is admitted.
        Sliding-window rows are rewritten whole: the window's pages are the request's own, never shared.
        """
        mamba_layers = self.spec.mamba_layers
        num_slots = pool.state_view(mamba_layers[0])[0].shape[0] if mamba_layers else None
        jobs = check_jobs(pool, jobs, num_slots=num_slots)
        for job in jobs:
            self._check_prompt(pool, job.request_id, job.prompt)
        hashes = [prefix_hashes(job.prompt) for job in jobs]  # H_0..H_n per request
        for job, prefix in zip(jobs, hashes, strict=True):
            slot = job.checkpoint_slot
            # A job in place continues its own state, which may hold decode steps' stripes: the state
            # written below is a function of the tokens alone, and admission verifies the rows it read.
            in_place = slot == pool.slot_id(job.request_id)
            if slot is not None and not in_place:  # the state after `cached`, as a prefill writes it
                mismatch = self.pattern.verify_state(pool, slot, prefix, job.cached, job.cached)
                if mismatch is not None:
                    raise CorruptCheckpoint(job.request_id, slot, job.cached, mismatch)
        records = [
            self._new_record(job.prompt, int(prefix[-1])) for job, prefix in zip(jobs, hashes, strict=True)
        ]
        for kind in self.pattern.kv_kinds():
            pages, rows, row_hashes = [], [], []
            for job, prefix in zip(jobs, hashes, strict=True):
                positions = self.pattern.held_positions(pool, job.request_id, kind, len(job.prompt))
                if kind == "kv":
                    positions = positions[positions >= job.cached]  # cached rows: shared pages, read only
                page, row = self.pattern.places(pool, job.request_id, kind, positions)
                pages.append(page)
                rows.append(row)
                row_hashes.append(prefix[positions + 1])
            if pages:
                self.pattern.write_kv(
                    pool, kind, torch.cat(pages), torch.cat(rows), np.concatenate(row_hashes)
                )
        for job, record, prefix in zip(jobs, records, hashes, strict=True):
            self.pattern.write_state(pool, pool.slot_id(job.request_id), record.last_hash, stripe=None)
            if job.snapshot is not None:  # a state is a pure function of its prefix: no replay needed
                num_tokens, slot = job.snapshot
                self.pattern.write_state(pool, slot, int(prefix[num_tokens]), stripe=None)
            self._records[job.request_id] = record
        return prefilled(jobs, [record.next_token for record in records])

    def decode_step(
        self,
        pool: Pool,
        request_ids: Sequence[str],
        last_tokens: Sequence[int],
        picks: Sequence[TokenPick | None] | None = None,
    ) -> list[int]:
        """Feed `last_tokens` as each request's newest position (the caller extended it by one):
        write its KV rows and one state stripe per tensor; return the next tokens (a function of the
        prefix: `picks` play no part).

        Each fed token must be the one the cache last returned for that request (or, after `admit`,
        its first token): a different one means the caller mixed requests up.
        """
        if len(request_ids) != len(last_tokens):
            raise ValueError(f"{len(request_ids)} request ids for {len(last_tokens)} last tokens")
        self._check_batch(request_ids)
        if not request_ids:
            return []
        self._check_tokens(last_tokens, "last_tokens")
        records = []
        for request_id, token in zip(request_ids, last_tokens, strict=True):
            record = self._record(request_id)
            if pool.num_tokens(request_id) != len(record.tokens) + 1:
                raise BatchRefused(
                    NOT_EXTENDED,
                    request_id,
                    f"request {request_id!r} holds {pool.num_tokens(request_id)} tokens in the pool after "
                    f"{len(record.tokens)} written",
                    pool.num_tokens(request_id),
                    len(record.tokens) + 1,
                )
            if token != record.next_token:
                raise BatchRefused(
                    WRONG_TOKEN,
                    request_id,
                    f"request {request_id!r} was fed token {token}; the cache generated {record.next_token}",
                    token,
                    record.next_token,
                )
            records.append(record)
        new_hashes = [next_hash(r.last_hash, t) for r, t in zip(records, last_tokens, strict=True)]
        for kind in self.pattern.kv_kinds():
            places = [
                self.pattern.places(pool, request_id, kind, np.array([len(record.tokens)]))
                for request_id, record in zip(request_ids, records, strict=True)
            ]
            pages, rows = (torch.cat(part) for part in zip(*places, strict=True))
            self.pattern.write_kv(pool, kind, pages, rows, np.array(new_hashes, dtype=np.uint64))
        for request_id, record, token, new_hash in zip(
            request_ids, records, last_tokens, new_hashes, strict=True
        ):
            record.tokens.append(int(token))
            record.last_hash = new_hash
            record.next_token = token_after(self.seed, new_hash, self.vocab_size)
            self.pattern.write_state(pool, pool.slot_id(request_id), new_hash, stripe=len(record.tokens))
        return [record.next_token for record in records]

    def admit(self, pool: Pool, request_id: str, prompt: Sequence[int], first_token: int) -> Mismatch | None:
        """Verify a received envelope byte for byte against what prefill writes for `prompt`; register
        the request (the next step feeds `first_token`) when it matches, else register nothing."""
        if request_id in self._records:
            raise BatchRefused(
                ALREADY_REGISTERED, request_id, f"request {request_id!r} is already registered"
            )
        self._check_prompt(pool, request_id, prompt)
        self._check_tokens([first_token], "first_token")
        mismatch = self.pattern.verify(pool, request_id, prompt, len(prompt))
        if mismatch is None:
            last_hash = int(prefix_hashes(prompt)[-1])
            self._records[request_id] = self._new_record(prompt, last_hash, next_token=first_token)
        return mismatch

    def check(self, pool: Pool, request_id: str) -> Mismatch | None:
        """Verify every KV row the request holds and every state stripe, as its record says they are."""
        record = self._record(request_id)
        if pool.num_tokens(request_id) < len(record.tokens):
            raise ValueError(
                f"request {request_id!r} holds {pool.num_tokens(request_id)} tokens in the pool but "
                f"{len(record.tokens)} were written"
            )
        return self.pattern.verify(pool, request_id, record.tokens, record.prompt_len)

    def forget(self, request_id: str) -> None:
        self._records.pop(request_id, None)

    # ---- validation -----------------------------------------------------------------------------
    def _check_batch(self, request_ids: Sequence[str]) -> None:
        if len(set(request_ids)) != len(request_ids):
            ids = list(request_ids)
            raise BatchRefused(DUPLICATE_REQUEST, None, f"a batch names a request twice: {ids}", ids)

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        check_token_ids(tokens, self.vocab_size, what)

    def _check_prompt(self, pool: Pool, request_id: str, prompt: Sequence[int]) -> None:
        if len(prompt) == 0:
            raise BatchRefused(
                EMPTY_PROMPT, request_id, f"request {request_id!r}: a prompt needs at least one token", 0
            )
        self._check_tokens(prompt, "prompt")
        if (held := pool.num_tokens(request_id)) != len(prompt):
            raise BatchRefused(
                TOKENS_NOT_RESERVED,
                request_id,
                f"request {request_id!r} holds {held} tokens in the pool but its prompt has {len(prompt)}",
                held,
                len(prompt),
            )

    def _record(self, request_id: str) -> _Record:
        if request_id not in self._records:
            raise BatchRefused(NOT_REGISTERED, request_id, f"request {request_id!r} is not registered")
        return self._records[request_id]

    def _new_record(self, prompt: Sequence[int], last_hash: int, next_token: int | None = None) -> _Record:
        """The record of a request just filled with `prompt` (H_n = `last_hash`); the next token fed
        is `next_token`, by default the one generated after the prompt."""
        if next_token is None:
            next_token = token_after(self.seed, last_hash, self.vocab_size)
        return _Record(
            tokens=[int(t) for t in prompt],
            prompt_len=len(prompt),
            last_hash=last_hash,
            next_token=next_token,
        )
