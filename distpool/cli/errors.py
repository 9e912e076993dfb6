"""The one line `distpool` prints for a refusal: a lower layer's typed error, its facts put in the
command line's words (the flag that set the value, what is supported, the fix). An error of no type
named here prints as it reads.
"""

from __future__ import annotations

from collections.abc import Callable

from distpool.memory.sizing import (
    DEEPSEEK_V4_POOLS,
    GIB,
    NOT_HYBRID,
    SWA_UNDER_PD,
    BudgetTooSmall,
    PoolArgInvalid,
    UnifiedMemoryRefused,
)
from distpool.model.hf_schedule import ScheduleMissing
from distpool.model.shard import MAX_LISTED_TP, TpUnshardable
from distpool.model_impl.errors import (
    NOT_MAMBA2_HYBRID,
    TOO_LARGE,
    CacheDtypesUnused,
    CheckpointDtypeUnsupported,
    ImplCannotRun,
    NoWeights,
    TokenizerUnloadable,
    WeightOptionsUnused,
)
from distpool.model_impl.hf.checkpoint import CheckpointError
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.serving.deploy import (
    COLOCATED_DECODE_TP,
    COLOCATED_WITHOUT_STATE,
    PREFILL_TP_WITHOUT_PREFILL,
    TP_WITH_SPREAD,
    TP_WITH_TRANSFORMERS,
    DeploymentRefused,
    RankPoolRefused,
    TooFewNodes,
)
from distpool.worker.config import WorkerConfigInvalid

UNIFIED_FLAG = "--enable-unified-memory"
UNIFIED_SUPPORTED = (
    "supported: hybrid Mamba / linear-attention models (colocated or PD) and hybrid sliding-window "
    "models (colocated only)"
)


def flag_of(field: str) -> str:
    """The flag that sets a `PoolArgs` field (`context_len` -> `--context-len`)."""
    return "--" + field.replace("_", "-")


def _pool_arg(exc: PoolArgInvalid | WorkerConfigInvalid) -> str:
    return f"{flag_of(exc.field)} must be {exc.expected}; got {exc.value!r}"


def _unified(exc: UnifiedMemoryRefused) -> str:
    arch, flag = exc.architectures, UNIFIED_FLAG
    if exc.reason == DEEPSEEK_V4_POOLS:
        return (
            f"{flag} is not supported for {arch}: DeepSeek-V4 keeps its own compressed and sliding-window "
            f"pools, which are never unified; {UNIFIED_SUPPORTED}. Fix: drop {flag}."
        )
    if exc.reason == NOT_HYBRID:
        return (
            f"{flag} does nothing for {arch}: the model is {exc.kind}, not hybrid (it has no second kind "
            f"of per-request memory to share an arena with); {UNIFIED_SUPPORTED}. Fix: drop {flag}."
        )
    if exc.reason == SWA_UNDER_PD:
        return (
            f"{flag} is not supported for {arch} (hybrid sliding-window) with --disaggregation-mode "
            f"{exc.disaggregation_mode}: there is no whole-envelope transfer scheme for the sliding-window "
            f"band; {UNIFIED_SUPPORTED}. Fix: drop {flag}, or run without PD (--disaggregation-mode null)."
        )
    return str(exc)


def _budget(exc: BudgetTooSmall) -> str:
    needs = exc.needs
    if exc.split is None:
        return (
            f"the memory budget of {exc.budget_bytes / GIB:.3f} GiB ({exc.budget_bytes} bytes) cannot hold "
            f"one request of {needs.architectures} at --context-len {needs.context_len}: it needs "
            f"{needs.needed_bytes} bytes (state slot {needs.slot_bytes} bytes, {needs.kv_bytes_per_token} KV "
            f"bytes per token). Fix: raise --memory-gib to at least {needs.needed_bytes / GIB:.3f}, or lower "
            "--context-len."
        )
    return (
        f"the static {exc.split} split of the budget cannot hold one request of {needs.architectures} at "
        f"--context-len {needs.context_len} (one request needs {needs.needed_bytes} bytes in all). Fix: "
        "raise --memory-gib, lower --context-len, change the split ratio, or use "
        f"{UNIFIED_FLAG} for a hybrid model."
    )


def _impl(exc: ImplCannotRun) -> str:
    if exc.impl == "reference":
        fixes = {
            NOT_MAMBA2_HYBRID: f". Fix: use {REFERENCE_HYBRID_CONFIG} or another Mamba2 hybrid config",
            TOO_LARGE: f". Fix: use {REFERENCE_HYBRID_CONFIG} or shrink hidden_size / vocab_size / layers",
        }
        fix = fixes.get(exc.problem, "")
        return f"{exc.reason}{fix}; or run it with the synthetic cache (--model-impl synthetic)"
    return f"{exc.reason}. Fix: run it at its true sizes without weights (--model-impl synthetic)"


def _weight_options(exc: WeightOptionsUnused) -> str:
    kept = "model" if exc.impl == "reference" else "cache"
    return (
        f"--dtype and --load-format set the transformers runner's weights; the {exc.impl} {kept} keeps "
        "--kv-dtype / --ssm-dtype. Fix: drop them, or add --model-impl transformers"
    )


def _no_weights(exc: NoWeights) -> str:
    return (
        f"{exc.folder} holds no *.safetensors weights beside a config.json, so --load-format "
        f"{exc.load_format} has nothing to load. Fix: pass the checkpoint's folder, or --load-format dummy "
        "for seeded random weights from the config alone"
    )


def _checkpoint_dtype(exc: CheckpointDtypeUnsupported) -> str:
    return (
        f"the checkpoint is stored in {exc.dtype}, which the runner does not compute in. Fix: --dtype float32"
    )


def _checkpoint(exc: CheckpointError) -> str:
    if exc.path.name == "config.json":
        return f"{exc}. Fix: correct config.json"
    return (
        f"{exc}. Fix: save or download the checkpoint again (or --load-format dummy: weights from the config)"
    )


def _cache_dtypes(exc: CacheDtypesUnused) -> str:
    return (
        f"the transformers runner keeps K/V and state as its modeling code computes them (--dtype "
        f"{exc.dtype}); --kv-dtype and --ssm-dtype apply to the reference model and the synthetic cache. "
        "Fix: drop them"
    )


def _tokenizer(exc: TokenizerUnloadable) -> str:
    return (
        f"{exc}. Fix: repair or remove them (without a tokenizer, text prompts are UTF-8 bytes), or give "
        "prompt_ids"
    )


def _tp_unshardable(exc: TpUnshardable) -> str:
    sizes = ", ".join(map(str, exc.valid_sizes)) or "none"
    return f"{exc}. Fix: use a TP size that shards every tensor (up to {MAX_LISTED_TP}: {sizes})"


def _schedule_missing(exc: ScheduleMissing) -> str:
    return (
        f"{exc}. Fix: add the one its checkpoint's config.json has (e.g. hybrid_override_pattern or "
        "layer_types)"
    )


def _deployment(exc: DeploymentRefused) -> str:
    sizes = f"--prefill-tp {exc.prefill_tp} --decode-tp {exc.decode_tp}"
    texts = {
        PREFILL_TP_WITHOUT_PREFILL: f"--prefill-tp {exc.prefill_tp} sizes prefill workers, and --prefill 0 "
        "starts none. Fix: drop --prefill-tp, or run prefill workers (--prefill 1)",
        COLOCATED_DECODE_TP: f"--decode-tp {exc.decode_tp} with --prefill 0: a decode worker of TP > 1 "
        "prefills nothing itself, so a colocated deployment serves at TP 1 only. Fix: --decode-tp 1, or run "
        "prefill workers (--prefill 1)",
        COLOCATED_WITHOUT_STATE: "--prefill 0: a colocated worker prefills in chunks, each continuing the "
        f"request's recurrent state in place, and {exc.architectures} ({exc.kind}) keeps no recurrent state "
        "beside KV pages. Fix: run prefill workers (--prefill 1), or serve a hybrid Mamba model",
        TP_WITH_TRANSFORMERS: f"{sizes}: the transformers runner has no TP (transformers has no "
        "tensor-parallel plan for Mamba or gated delta net mixers). Fix: --prefill-tp 1 --decode-tp 1, or "
        "use --model-impl synthetic or reference",
        TP_WITH_SPREAD: f"{sizes}: a TP group is packed on one node; --spread is for TP 1. "
        "Fix: drop --spread",
    }
    return texts.get(exc.problem, str(exc))


def _rank_pool(exc: RankPoolRefused) -> str:
    return f"--{exc.role}-tp {exc.tp}: {error_text(exc.refusal)}"


def _too_few_nodes(exc: TooFewNodes) -> str:
    return (
        f"--spread puts each of the {exc.workers} workers on its own node, but the cluster has "
        f"{exc.nodes} node(s). Fix: drop --spread, or add nodes"
    )


_TEXTS: dict[type, Callable] = {
    PoolArgInvalid: _pool_arg,
    WorkerConfigInvalid: _pool_arg,
    UnifiedMemoryRefused: _unified,
    BudgetTooSmall: _budget,
    RankPoolRefused: _rank_pool,
    DeploymentRefused: _deployment,
    TooFewNodes: _too_few_nodes,
    ImplCannotRun: _impl,
    WeightOptionsUnused: _weight_options,
    NoWeights: _no_weights,
    CheckpointDtypeUnsupported: _checkpoint_dtype,
    TpUnshardable: _tp_unshardable,
    TokenizerUnloadable: _tokenizer,
    CheckpointError: _checkpoint,
    CacheDtypesUnused: _cache_dtypes,
    ScheduleMissing: _schedule_missing,
}


def error_text(exc: BaseException) -> str:
    """What the command line prints for `exc` (after "distpool: error: ")."""
    text = _TEXTS.get(type(exc))
    return str(exc) if text is None else text(exc)
