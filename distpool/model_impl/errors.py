"""What the model implementations refuse, as facts: which implementation, what it was given, why.
The command line turns them into sentences with its flags and the fix (`distpool.cli.errors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distpool.facts import Facts

# Why the reference model cannot run a model (`ImplCannotRun.problem`; None: another reason).
NOT_MAMBA2_HYBRID = "not_mamba2_hybrid"  # it runs attention and Mamba2 in separate layers only
TOO_LARGE = "too_large"  # it builds random weights for small configs only


class ImplCannotRun(Facts, ValueError):
    """Implementation `impl` ("reference", "transformers") cannot run the model at `source`:
    `reason` says why, in the model's terms (its architectures, layers, sizes); `problem`, where
    one of the names above applies."""

    def __init__(self, impl: str, source: str, reason: str, problem: str | None = None) -> None:
        super().__init__(reason)
        self.impl, self.source, self.reason, self.problem = impl, source, reason, problem


class WeightOptionsUnused(Facts, ValueError):
    """A weights dtype or load format (`dtype`, `load_format`; "auto" when not given) for an
    implementation (`impl`: reference or synthetic) that loads no weights."""

    def __init__(self, impl: str, dtype: str, load_format: str) -> None:
        super().__init__(
            f"the {impl} implementation loads no weights; got dtype {dtype!r}, load format {load_format!r}"
        )
        self.impl, self.dtype, self.load_format = impl, dtype, load_format


class NoWeights(Facts, ValueError):
    """`folder` holds no safetensors weights beside its config.json for `load_format` to load."""

    def __init__(self, folder: str, load_format: str) -> None:
        super().__init__(f"{folder} holds no *.safetensors weights beside a config.json ({load_format})")
        self.folder, self.load_format = folder, load_format


class CheckpointDtypeUnsupported(Facts, ValueError):
    """The checkpoint is stored in `dtype`, which the transformers runner does not compute in;
    `supported`: the dtypes it does."""

    def __init__(self, dtype: str, supported: tuple[str, ...]) -> None:
        computes = ", ".join(supported)
        super().__init__(f"the checkpoint is stored in {dtype}; the runner computes in {computes}")
        self.dtype, self.supported = dtype, supported


class CacheDtypesUnused(Facts, ValueError):
    """KV or state dtype overrides (`kv_dtype`, `ssm_dtype`; None: not given) for the transformers
    runner, which keeps K/V and state in the dtype its modeling code computes them in (`dtype`)."""

    def __init__(self, dtype: str, kv_dtype: str | None, ssm_dtype: str | None) -> None:
        super().__init__(
            f"the transformers runner keeps K/V and state in its compute dtype ({dtype}); got kv dtype "
            f"{kv_dtype!r}, state dtype {ssm_dtype!r}"
        )
        self.dtype, self.kv_dtype, self.ssm_dtype = dtype, kv_dtype, ssm_dtype


class TokenIdsOutOfRange(Facts, ValueError):
    """`what` ("prompt", "last_tokens", "first_token") holds token ids (`tokens`) outside the
    vocabulary [0, `vocab_size`); `bad`: the first of them."""

    def __init__(self, what: str, tokens: tuple[int, ...], vocab_size: int) -> None:
        super().__init__(f"{what} has token ids outside [0, {vocab_size}): {list(tokens)}")
        self.what, self.tokens, self.vocab_size = what, tokens, vocab_size

    @property
    def bad(self) -> int:
        return next(t for t in self.tokens if not 0 <= t < self.vocab_size)


class TokenizerUnloadable(Facts, ValueError):
    """`folder` holds tokenizer files (`files`) that transformers cannot load: `reason`, what it said
    (one line)."""

    def __init__(self, folder: str, files: tuple[str, ...], reason: str) -> None:
        super().__init__(
            f"{folder} holds tokenizer files ({', '.join(files)}) that transformers cannot load: {reason}"
        )
        self.folder, self.files, self.reason = folder, files, reason


class TpGroupMismatch(Facts, ValueError):
    """Rank `rank` of a TP group of `tp` ranks was given a process group of `group_size` ranks in
    which it is rank `group_rank` (both None: no group). TP 1 computes alone (no group, or a group
    of one); TP > 1 needs the group of exactly its ranks, in rank order."""

    def __init__(self, tp: int, rank: int, group_size: int | None, group_rank: int | None) -> None:
        if group_size is None:
            text = f"TP {tp} needs its process group (all-reduce); rank {rank} was given none"
        else:
            text = (
                f"rank {rank} of TP {tp} was given a group of {group_size} ranks in which it is rank "
                f"{group_rank}"
            )
        super().__init__(text)
        self.tp, self.rank, self.group_size, self.group_rank = tp, rank, group_size, group_rank


class TpSplitUneven(Facts, ValueError):
    """`tp` ranks cannot split the reference model's `count` `unit` (query heads, MLP channels)
    evenly: a TP size that divides `count` can."""

    def __init__(self, tp: int, count: int, unit: str) -> None:
        super().__init__(
            f"tensor parallelism of {tp} ranks cannot split the reference model's {count} {unit}"
        )
        self.tp, self.count, self.unit = tp, count, unit


# What is wrong with a batch a model implementation refuses before writing anything (`BatchRefused`),
# with its facts (`value`, `limit`) and what a caller does about it.
DUPLICATE_REQUEST = "duplicate_request"  # a batch names a request twice (value: the ids)
EMPTY_PROMPT = "empty_prompt"  # value: 0
# The pool holds another number of tokens (value) than the prompt (limit): reserve len(prompt) tokens.
TOKENS_NOT_RESERVED = "tokens_not_reserved"
# Cached tokens (value) not whole pages below the prompt's length (limit: (page_size, prompt tokens)):
# pass the prefix match's num_tokens (a match never covers the whole prompt).
CACHED_OUT_OF_RANGE = "cached_out_of_range"
# Cached tokens (value) other than the shared pages' tokens reserved (limit): pass the num_tokens of the
# match the request was reserved with.
CACHED_NOT_AS_RESERVED = "cached_not_as_reserved"
# Cached tokens (value) of a model with recurrent state, and no state to start from: pass the match's
# checkpoint slot (`prefix_cache.checkpoint_slot(match.checkpoint)`).
NO_CHECKPOINT = "no_checkpoint"
# A snapshot after `value` tokens, not a page boundary in (cached, prompt tokens] (limit: that pair):
# a depth in whole pages past the cached ones, or no snapshot.
SNAPSHOT_OUT_OF_RANGE = "snapshot_out_of_range"
# A checkpoint or snapshot slot (value) outside the pool's slot positions (limit): a physical slot id
# from the prefix cache (take_checkpoint / checkpoint_slot).
SLOT_OUT_OF_RANGE = "slot_out_of_range"
# A snapshot would overwrite a slot the batch writes (value) or reads (limit): a fresh checkpoint unit
# (`prefix_cache.take_checkpoint()`) for each snapshot.
SLOTS_OVERLAP = "slots_overlap"
# A decode step of a request not extended by the token it is fed (value: the tokens the pool holds;
# limit: the tokens written, plus one): prefill, then extend the request by 1 before each step.
NOT_EXTENDED = "not_extended"
# the synthetic cache's own records of what it wrote
NOT_REGISTERED = "not_registered"  # a request the cache neither prefilled nor admitted: prefill or admit it
ALREADY_REGISTERED = "already_registered"  # an admit of a request the cache holds: forget it first
# A decode step fed another token (value) than the cache generated (limit): feed each request the
# token its last step returned.
WRONG_TOKEN = "wrong_token"


class BatchRefused(Facts, ValueError):
    """A prefill or decode batch refused before anything was written: `problem` (one of the names
    above) for `request_id` (None: the batch as a whole), what the batch gave (`value`) and what it
    must be or lie within (`limit`), as each name above says; the message states them in the pool's
    terms."""

    def __init__(
        self, problem: str, request_id: str | None, message: str, value: object = None, limit: object = None
    ) -> None:
        super().__init__(message)
        self.problem, self.request_id, self.value, self.limit = problem, request_id, value, limit


class ShardMismatch(Facts, ValueError):
    """A TP rank's shard disagrees with what it was given: `field` is "model" (the shard is of another
    spec: `expected` and `got` are their sources; shard the spec the cache runs) or a tensor's name
    (the pool's bytes per row of it: `expected` the rank's, `got` the pool's; build the pool from the
    shard's spec)."""

    def __init__(self, field: str, expected: object, got: object, message: str) -> None:
        super().__init__(message)
        self.field, self.expected, self.got = field, expected, got


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


class LayoutMismatch(Facts, ValueError):
    """The pools of the model at `source` hold tensors other than transformers allocates for it:
    `differences`, per layer and tensor."""

    def __init__(self, source: str, differences: Sequence[LayoutDifference]) -> None:
        self.source, self.differences = source, tuple(differences)
        super().__init__(
            f"{source}: the pool's layout does not match the model: " + "; ".join(map(str, self.differences))
        )


class PoolsSizedOtherwise(Facts, ValueError):
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
