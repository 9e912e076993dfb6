"""What a worker runs on its pool (the transformers runner, the reference model or the synthetic
cache), and the generate loop they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from distpool.memory.pool import Pool
from distpool.model.sampling import SamplingParams, TokenPick, finish_after, pick_for
from distpool.model_impl.prefill_job import Prefilled, PrefillJob

_KIND_WORDS = {"kv": "", "swa_kv": "sliding-window ", "state": ""}


@dataclass(frozen=True)
class Mismatch:
    """The first byte of an envelope that differs from what it should hold."""

    kind: str  # "kv" | "swa_kv" | "state"
    layer: int  # the model's own layer number
    tensor: str  # "k" or "v" for KV, the state tensor's name for state
    position: int | None  # token position of a KV row; None for state
    byte_offset: int  # within that KV row, or within the state tensor of one slot

    def __str__(self) -> str:
        where = f"at token {self.position}" if self.position is not None else "state"
        return f"layer {self.layer} {_KIND_WORDS[self.kind]}{self.tensor} {where}, byte {self.byte_offset}"


class PoolModel(ABC):
    """Prefill and decode through a `Pool`; `admit` / `check` verify envelopes where the model can."""

    name: str  # "transformers" | "reference" | "synthetic"
    verifies: bool  # whether admit / check look at the bytes at all

    @abstractmethod
    def prefill(self, pool: Pool, jobs: Sequence[PrefillJob]) -> list[Prefilled]:
        """Fill each job's request (reserved or extended to exactly len(job.prompt) tokens): the K/V
        rows after its cached prefix, its final state into its own slot, and its snapshot's state
        where it asks for one; per job, in order, the first token and the tokens computed.

        prefill_job.py pictures who owns which token range and how a job starts from a cached
        prefix or continues in place. Models without Mamba layers ignore checkpoints and snapshots.
        Misuse raises ValueError before anything is written.
        """

    @abstractmethod
    def decode_step(
        self,
        pool: Pool,
        request_ids: Sequence[str],
        last_tokens: Sequence[int],
        picks: Sequence[TokenPick | None] | None = None,
    ) -> list[int]:
        """Feed `last_tokens` to requests extended by one token; the next token per request, picked as
        `picks[i]` says (`model_impl.sampling`; None: greedy). The synthetic cache's tokens are a
        function of the prefix alone: it ignores `picks`."""

    @abstractmethod
    def admit(self, pool: Pool, request_id: str, prompt: Sequence[int], first_token: int) -> Mismatch | None:
        """Take over a request whose envelope arrived (decode side); the first wrong byte, or None."""

    @abstractmethod
    def check(self, pool: Pool, request_id: str) -> Mismatch | None:
        """Verify a request's whole envelope as it stands; the first wrong byte, or None."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """Drop what the model keeps about a request (nothing happens for one it does not know)."""

    def generate(
        self,
        pool: Pool,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        *,
        params: Sequence[SamplingParams] | None = None,
        eos_token_ids: Sequence[int] = (),
        request_ids: Sequence[str] | None = None,
        between_steps: Callable[[], object] | None = None,
    ) -> list[list[int]]:
        """Reserve, prefill, decode and release `prompts` as one batch: `max_new_tokens` greedy tokens
        per prompt, or as each prompt's `params` say (sampled, stopped at `eos_token_ids` and stop ids:
        `distpool.model.sampling`), a request leaving the batch (and the pool) once it ends.

        `between_steps` runs before every decode step (e.g. `pool.compact`). Everything reserved
        is released and forgotten, also when a step fails.
        """
        if params is None:
            if max_new_tokens is None or max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
            params = [SamplingParams(max_tokens=max_new_tokens)] * len(prompts)
        ids = (
            list(request_ids)
            if request_ids is not None
            else [f"{self.name}-{i}" for i in range(len(prompts))]
        )
        if not len(ids) == len(prompts) == len(params):
            raise ValueError(
                f"{len(ids)} request ids and {len(params)} parameters for {len(prompts)} prompts"
            )
        reserved: list[str] = []
        try:
            for request_id, prompt in zip(ids, prompts, strict=True):
                pool.reserve(request_id, len(prompt))
                reserved.append(request_id)
            jobs = [
                PrefillJob(request_id, prompt, pick=pick_for(p, eos_token_ids, 0))
                for request_id, prompt, p in zip(ids, prompts, params, strict=True)
            ]
            generated = [[done.first_token] for done in self.prefill(pool, jobs)]
            running = list(range(len(ids)))
            while running := [
                i for i in running if finish_after(params[i], eos_token_ids, generated[i]) is None
            ]:
                for i in set(range(len(ids))) - set(running):  # ended: its memory goes back at once
                    if ids[i] in reserved:
                        reserved.remove(ids[i])
                        pool.release(ids[i])
                        self.forget(ids[i])
                if between_steps is not None:
                    between_steps()
                batch = [ids[i] for i in running]
                pool.extend_batch([(request_id, 1) for request_id in batch])  # one placement per step
                picks = [pick_for(params[i], eos_token_ids, len(generated[i])) for i in running]
                tokens = self.decode_step(pool, batch, [generated[i][-1] for i in running], picks)
                for i, token in zip(running, tokens, strict=True):
                    generated[i].append(token)
            return generated
        finally:
            for request_id in reserved:
                pool.release(request_id)
                self.forget(request_id)
