"""The one frozen configuration a worker is built from; the launcher makes it once and passes it down."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

from distpool.facts import Facts
from distpool.memory.sizing import PoolArgs
from distpool.model.spec import ModelSpec
from distpool.model_impl.hf.source import HFSource
from distpool.model_impl.select import MODEL_IMPLS, compute_dtype
from distpool.worker.tp_pairing import TpPairing
from transfer import TransferOptions


class WorkerConfigInvalid(Facts, ValueError):
    """A worker configuration's field out of range: the field, its value, what it must be (the
    command line names the flag that set it)."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        super().__init__(field, value, expected)
        self.field, self.value, self.expected = field, value, expected

    def __str__(self) -> str:
        return f"{self.field} must be {self.expected}; got {self.value!r}"


DEFAULT_LOCAL_PREFILL_CHUNK = 512  # tokens; see the README's conditional disaggregation
DEFAULT_BUDGET_BYTES = 256 << 20  # per worker: the reference model's pool, and a safe default here
DEVICES = ("auto", "cpu", "cuda")
RESOLVED_MODEL_IMPLS = MODEL_IMPLS[1:]  # what a worker runs: auto is chosen earlier


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a prefill or decode worker needs, derived once by the driver.

    `spec` is the classified model (workers never re-read config.json); `pool_args` carries the
    resolved unified flag, and each worker plans its pool for its own role (`for_role`).
    """

    spec: ModelSpec
    pool_args: PoolArgs = PoolArgs()
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    transfer: TransferOptions = field(default_factory=TransferOptions)
    device: str = "auto"  # auto: a GPU when the worker has one
    seed: int = 0
    model_impl: str = "reference"  # what computes in the pools (RESOLVED_MODEL_IMPLS)
    hf: HFSource | None = None  # the transformers runner's weights (each worker loads its own copy)
    # The checkpoint's end-of-sequence ids (distpool.model.eos; none for the bundled reference model):
    # the worker that makes a token ends its request there (distpool.model.sampling).
    eos_token_ids: tuple[int, ...] = ()
    # Conditional disaggregation (`--conditional-disagg`): decode keeps finished requests' final states
    # and the driver may prefill a later turn there. Off, decode keeps none (no slot copy per request).
    local_prefill: bool = True  # on by default: the README's benchmark says why
    # Decode's local prefill: prompt tokens computed between two decode steps of the running batch,
    # which bounds what a local prefill adds to a running request's step.
    local_prefill_chunk: int = DEFAULT_LOCAL_PREFILL_CHUNK
    # Tensor parallelism: ranks per prefill and per decode worker (each rank a process with its own
    # pool shard of `budget_bytes`); tp_pairing.py says which ranks hold a channel.
    prefill_tp: int = 1
    decode_tp: int = 1
    # Names and seals every control message of the deployment's channels (transfer.connect.auth). Made
    # here, once per configuration, and handed to the workers by Ray: never on a command line or
    # in a file. Not printed, not compared.
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"the memory budget must be positive; got {self.budget_bytes} bytes")
        if self.local_prefill_chunk < 1:
            raise WorkerConfigInvalid("local_prefill_chunk", self.local_prefill_chunk, "at least 1 token")
        if self.model_impl not in RESOLVED_MODEL_IMPLS:
            raise ValueError(
                f"the model implementation must be one of {', '.join(RESOLVED_MODEL_IMPLS)}; "
                f"got {self.model_impl!r}"
            )
        if (self.model_impl == "transformers") != (self.hf is not None):
            raise ValueError("the transformers runner, and it alone, needs the source of its weights (hf)")
        kind, colon, index = self.device.partition(":")
        if kind not in DEVICES or (colon and (kind != "cuda" or not index.isdigit())):
            # torch accepts cpu:1, but a CPU pool has no index to place by: every request would fail
            # when its channel, built for "cpu:1", met a buffer on "cpu"
            raise WorkerConfigInvalid(
                "device", self.device, f"one of {', '.join(DEVICES)} (cuda:N too; a CPU has no index)"
            )

    @property
    def pairing(self) -> TpPairing:
        """Which ranks of a prefill and a decode worker hold a channel (ValueError: a TP size the
        model cannot shard)."""
        return TpPairing(self.spec, prefill_tp=self.prefill_tp, decode_tp=self.decode_tp)

    def tp_of(self, role: str) -> int:
        """Ranks per worker of `role` ("prefill" or "decode")."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    @property
    def dtype(self) -> str:
        """The dtype the model implementation computes in (what the summary reports)."""
        return compute_dtype(self.spec, self.model_impl, self.hf, self.pool_args.kv_dtype)

    def for_role(self, role: str | None) -> PoolArgs:
        """The pool arguments of a worker in `role` ("prefill", "decode", or None: colocated)."""
        return dataclasses.replace(self.pool_args, disaggregation_mode=role)
