"""What the model implementations refuse, as facts: which implementation, what it was given, why.
The command line turns them into sentences with its flags and the fix (`distpool.cli.errors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class ImplCannotRun(ValueError):
    """Implementation `impl` ("reference", "transformers") cannot run the model at `source`:
    `reason` says why, in the model's terms (its architectures, layers, sizes)."""

    def __init__(self, impl: str, source: str, reason: str) -> None:
        super().__init__(reason)
        self.impl, self.source, self.reason = impl, source, reason

    def __reduce__(self):
        return type(self), (self.impl, self.source, self.reason)


class WeightOptionsUnused(ValueError):
    """A weights dtype or load format (`dtype`, `load_format`; "auto" when not given) for an
    implementation (`impl`: reference or synthetic) that loads no weights."""

    def __init__(self, impl: str, dtype: str, load_format: str) -> None:
        super().__init__(
            f"the {impl} implementation loads no weights; got dtype {dtype!r}, load format {load_format!r}"
        )
        self.impl, self.dtype, self.load_format = impl, dtype, load_format

    def __reduce__(self):
        return type(self), (self.impl, self.dtype, self.load_format)


class NoWeights(ValueError):
    """`folder` holds no safetensors weights beside its config.json for `load_format` to load."""

    def __init__(self, folder: str, load_format: str) -> None:
        super().__init__(f"{folder} holds no *.safetensors weights beside a config.json ({load_format})")
        self.folder, self.load_format = folder, load_format

    def __reduce__(self):
        return type(self), (self.folder, self.load_format)


class CheckpointDtypeUnsupported(ValueError):
    """The checkpoint is stored in `dtype`, which the transformers runner does not compute in;
    `supported`: the dtypes it does."""

    def __init__(self, dtype: str, supported: tuple[str, ...]) -> None:
        computes = ", ".join(supported)
        super().__init__(f"the checkpoint is stored in {dtype}; the runner computes in {computes}")
        self.dtype, self.supported = dtype, supported

    def __reduce__(self):
        return type(self), (self.dtype, self.supported)


# What is wrong with a batch a model implementation refuses before writing anything (`BatchRefused`).
DUPLICATE_REQUEST = "duplicate_request"  # a batch names a request twice
EMPTY_PROMPT = "empty_prompt"
TOKENS_NOT_RESERVED = "tokens_not_reserved"  # the pool holds another number of tokens than the prompt
CACHED_OUT_OF_RANGE = "cached_out_of_range"  # cached tokens not whole pages below the prompt's length
CACHED_NOT_AS_RESERVED = "cached_not_as_reserved"  # cached tokens other than the shared pages reserved
NO_CHECKPOINT = "no_checkpoint"  # cached tokens of a model with recurrent state, and no state to start from
SNAPSHOT_OUT_OF_RANGE = "snapshot_out_of_range"  # not a page boundary after the cached tokens
SLOT_OUT_OF_RANGE = "slot_out_of_range"  # a checkpoint or snapshot slot outside the pool's
SLOTS_OVERLAP = "slots_overlap"  # a snapshot would overwrite a slot the batch writes or reads
NOT_EXTENDED = "not_extended"  # a decode step of a request not extended by the token it is fed
# the synthetic cache's own records of what it wrote
NOT_REGISTERED = "not_registered"  # a request the cache neither prefilled nor admitted
ALREADY_REGISTERED = "already_registered"  # an admit of a request the cache holds
WRONG_TOKEN = "wrong_token"  # a decode step fed another token than the cache generated


class BatchRefused(ValueError):
    """A prefill or decode batch refused before anything was written: `problem` (one of the names
    above) for `request_id` (None: the batch as a whole); the message says the numbers and the fix
    in the pool's terms."""

    def __init__(self, problem: str, request_id: str | None, message: str) -> None:
        super().__init__(message)
        self.problem, self.request_id = problem, request_id

    def __reduce__(self):
        return type(self), (self.problem, self.request_id, str(self))


class ShardMismatch(ValueError):
    """A TP rank's shard disagrees with what it was given: `field` is "model" (the shard is of another
    spec: `expected` and `got` are their sources) or a tensor's name (the pool's bytes per row of it:
    `expected` the rank's, `got` the pool's)."""

    def __init__(self, field: str, expected: object, got: object, message: str) -> None:
        super().__init__(message)
        self.field, self.expected, self.got = field, expected, got

    def __reduce__(self):
        return type(self), (self.field, self.expected, self.got, str(self))


class GroupMismatch(ValueError):
    """Rank `rank` of a `tp`-rank TP group given a process group of `group_size` ranks (0: none) in
    which it is rank `group_rank`: not exactly its TP group, ranks in order (None at TP 1)."""

    def __init__(self, tp: int, rank: int, group_size: int, group_rank: int) -> None:
        if tp == 1:
            message = f"TP 1 computes alone; got a group of {group_size} ranks. Fix: pass group=None"
        elif group_size == 0:
            message = f"TP {tp} needs its process group (all-reduce). Fix: pass the TP group's group"
        else:
            message = (
                f"rank {rank} of TP {tp} was given a group of {group_size} ranks in which it is rank "
                f"{group_rank}. Fix: pass the process group of exactly this TP group, ranks in order"
            )
        super().__init__(message)
        self.tp, self.rank, self.group_size, self.group_rank = tp, rank, group_size, group_rank

    def __reduce__(self):
        return type(self), (self.tp, self.rank, self.group_size, self.group_rank)


class UnitsUnsplittable(ValueError):
    """`count` `unit`s (query heads, MLP channels) that `tp` ranks cannot split in equal blocks."""

    def __init__(self, tp: int, count: int, unit: str) -> None:
        super().__init__(
            f"tensor parallelism of {tp} ranks cannot split the reference model's {count} {unit}. "
            f"Fix: use a TP size that divides {count}"
        )
        self.tp, self.count, self.unit = tp, count, unit

    def __reduce__(self):
        return type(self), (self.tp, self.count, self.unit)


class TokensOutOfVocab(ValueError):
    """`tokens` (a call's `what`: a prompt, a decode step's last tokens) hold ids outside
    [0, `vocab_size`)."""

    def __init__(self, what: str, tokens: Sequence[int], vocab_size: int) -> None:
        self.what, self.tokens, self.vocab_size = what, tuple(tokens), vocab_size
        super().__init__(f"{what} has token ids outside [0, {vocab_size}): {list(self.tokens)}")

    def __reduce__(self):
        return type(self), (self.what, self.tokens, self.vocab_size)


@dataclass(frozen=True)
class LayoutDifference:
    """One tensor where the pool and transformers disagree: layer `layer`'s `tensor` ("conv",
    "ssm", "K per token"), as the pool holds it (`pool`) and as transformers allocates it
    (`transformers`, "nothing" where it allocates none), each as "(shape) dtype"."""

    layer: int
    tensor: str
    pool: str
    transformers: str

    def __str__(self) -> str:
        holds = f"the pool holds {self.pool}, transformers allocates {self.transformers}"
        return f"layer {self.layer} {self.tensor}: {holds}"


class LayoutMismatch(ValueError):
    """The pools of the model at `source` hold tensors other than transformers allocates for it:
    `differences`, per layer and tensor."""

    def __init__(self, source: str, differences: Sequence[LayoutDifference]) -> None:
        self.source, self.differences = source, tuple(differences)
        super().__init__(
            f"{source}: the pool's layout does not match the model: " + "; ".join(map(str, self.differences))
        )

    def __reduce__(self):
        return type(self), (self.source, self.differences)


class PoolsSizedOtherwise(ValueError):
    """The model loaded from `source` keeps KV `loaded_kv` and state `loaded_state` (specs; None:
    none), and the pools were sized for `sized_kv` and `sized_state`."""

    def __init__(
        self, source: str, loaded_kv: object, loaded_state: object, sized_kv: object, sized_state: object
    ):
        super().__init__(
            f"{source}: the loaded model keeps KV {loaded_kv} and state {loaded_state}, "
            f"but the pools were sized for KV {sized_kv} and state {sized_state}"
        )
        self.source, self.loaded_kv, self.loaded_state = source, loaded_kv, loaded_state
        self.sized_kv, self.sized_state = sized_kv, sized_state

    def __reduce__(self):
        return type(self), (self.source, self.loaded_kv, self.loaded_state, self.sized_kv, self.sized_state)
