"""The memory one `distpool run` takes, counted before Ray starts: every worker, the driver, Ray.

A worker's pool is `--memory-gib`; around it each process holds more, and the check before Ray
counts all of it (upper bounds, from the sizes alone):

    worker  = pool (the budget)
            + transfer staging: PIPELINE_DEPTH chunk buffers per channel end (one end per peer;
              none colocated: no channel)
            + the raw link measurement: one envelope-sized message at each end of a channel, one
              channel at a time (at most a request at --context-len; none colocated)
            + what its model holds: the transformers runner's weights (one copy per process), the
              reference model's float64 weights, or the synthetic cache's base patterns (a slot's
              worth of state words and one token of KV per layer)
            + the arena's compaction staging (SLIDE_STAGING_BYTES)
            (activations are not counted, as the budget is the pool's alone: a prefill worker's
              are its batch of whole prompts', a colocated decode worker's one chunk's, at most
              --local-prefill-chunk tokens; README, "Colocated serving")
            + the process itself (Python, torch, Ray's core worker)
    driver  = the parity pool (one request at --context-len: parity.parity_pool_sizes)
            + what its model holds + the process itself
    Ray     = the embedded cluster's own processes (GCS, raylet, agents)

PROCESS_BYTES and RAY_BYTES were measured (scripts/memory_probe.py, README "Memory a run takes").
"""

from __future__ import annotations

from dataclasses import dataclass

from distpool.memory.arena import SLIDE_STAGING_BYTES
from distpool.memory.sizing import GIB, size_pools
from distpool.model.spec import ModelSpec
from distpool.model_impl.hf.source import HFSource
from distpool.model_impl.reference.support import approx_params
from distpool.serving.summary import parity_pool_sizes
from distpool.worker.config import WorkerConfig
from transfer.ends import PIPELINE_DEPTH

PROCESS_BYTES = 400 << 20  # a worker's or the driver's own RSS beside its buffers: ~330 MB measured
RAY_BYTES = 768 << 20  # the embedded cluster's own processes: 580-710 MB measured
REFERENCE_WEIGHT_BYTES = 8  # the reference model keeps its weights in float64
# transformers and a model's modeling code, imported by each process of a transformers run: ~135 MB
# measured (RSS after building a tiny runner, against a worker's imports alone)
TRANSFORMERS_BYTES = 192 << 20


def model_bytes(spec: ModelSpec, model_impl: str, hf: HFSource | None = None) -> int:
    """What the model implementation holds in a process beside the pool (the driver's parity
    oracle of the transformers runner holds one more copy of its weights)."""
    if hf is not None:
        return hf.weight_bytes + TRANSFORMERS_BYTES
    if model_impl == "reference":
        return approx_params(spec) * REFERENCE_WEIGHT_BYTES
    return spec.slot_bytes + spec.full_kv_bytes_per_token + spec.swa_kv_bytes_per_token


@dataclass(frozen=True)
class RunMemory:
    """Peak bytes of one run's processes (upper bounds), per part."""

    prefill_bytes: int  # one prefill worker
    decode_bytes: int  # one decode worker
    num_prefill: int
    num_decode: int
    driver_bytes: int
    ray_bytes: int  # the embedded cluster's own processes

    @classmethod
    def of(
        cls, worker: WorkerConfig, num_prefill: int, num_decode: int, *, embedded: bool = True
    ) -> RunMemory:
        spec = worker.spec
        envelope = size_pools(spec, worker.for_role("decode"), 1 << 50).request_bytes_at_full_context
        if num_prefill == 0:  # colocated: no channel, no link measured
            envelope = 0
        model = model_bytes(spec, worker.model_impl, worker.hf)
        common = worker.budget_bytes + envelope + model + SLIDE_STAGING_BYTES + PROCESS_BYTES
        staging = PIPELINE_DEPTH * worker.transfer.chunk_bytes  # per channel end
        parity = parity_pool_sizes(worker, worker.pool_args.context_len).budget_bytes
        return cls(
            prefill_bytes=common + num_decode * staging,
            decode_bytes=common + num_prefill * staging,
            num_prefill=num_prefill,
            num_decode=num_decode,
            driver_bytes=parity + model + PROCESS_BYTES,
            ray_bytes=RAY_BYTES,
        )

    @property
    def workers_bytes(self) -> int:
        return self.num_prefill * self.prefill_bytes + self.num_decode * self.decode_bytes

    @property
    def total_bytes(self) -> int:
        return self.workers_bytes + self.driver_bytes + self.ray_bytes

    def describe(self) -> str:
        return (
            f"{self.total_bytes / GIB:.1f} GiB in all: {self.num_prefill} prefill x "
            f"{self.prefill_bytes / GIB:.2f} + {self.num_decode} decode x {self.decode_bytes / GIB:.2f} "
            f"(pool, staging, link measurement, model, process), driver {self.driver_bytes / GIB:.2f} "
            f"(parity pool, model, process), Ray {self.ray_bytes / GIB:.2f}"
        )
