"""Pool sizing: a pure function of (ModelSpec, PoolArgs, budget) returning frozen PoolSizes.

Nothing is allocated here. `size_pools` refuses, with a typed error carrying the facts
(`errors.py`; the command line names its flags and the fix), before any pool or actor exists:
1. Unified memory with a model that is not hybrid (or is DeepSeek-V4): `UnifiedMemoryRefused`.
2. Unified memory with a hybrid-SWA model under PD: `UnifiedMemoryRefused`.
3. A budget in which one worst-case request (slot + pages for `context_len` tokens) cannot fit:
   `BudgetTooSmall`.

Sizing rules (every size page- or slot-aligned; see `PoolSizes` for the figures):
- unified: one arena; `max_running_requests` defaults to the number of requests that fit holding one
  page each, capped at DEFAULT_MAX_RUNNING_REQUESTS; the report gives "N requests at full context" and
  "max tokens with M requests".
- static hybrid Mamba: `mamba_state_ratio` of the budget goes to the state pool (at most one slot per
  running request), the rest to the KV pool.
- static hybrid SWA / DeepSeek-V4: full and SWA pools with `swa_full_tokens_ratio` SWA tokens per full
  token.
- dense: everything to the KV pool (or to the state pool for an attention-free model).
"""

from __future__ import annotations

from dataclasses import dataclass

from distpool.memory.sizing.errors import (
    DEEPSEEK_V4_POOLS,
    NOT_HYBRID,
    SWA_UNDER_PD,
    BudgetTooSmall,
    PoolArgInvalid,
    RequestNeeds,
    UnifiedMemoryRefused,
)
from distpool.memory.sizing.layout import ALIGN_BYTES, align_up, ceil_div, slot_stride_bytes
from distpool.model.dtypes import DTYPE_NAMES, canonical_dtype
from distpool.model.spec import DEEPSEEK_V4, HYBRID_MAMBA, HYBRID_SWA, ModelSpec

DISAGGREGATION_MODES = (None, "prefill", "decode")
DEFAULT_MAX_RUNNING_REQUESTS = 512
GIB = 1 << 30


@dataclass(frozen=True)
class PoolArgs:
    """What a user sets. Defaults live here and nowhere else."""

    enable_unified_memory: bool = False
    disaggregation_mode: str | None = None  # None (colocated) | "prefill" | "decode"
    page_size: int = 16  # tokens per page
    context_len: int = 4096  # the longest request the pool must be able to hold
    max_running_requests: int | None = None
    kv_dtype: str | None = None  # None: the spec's own dtypes
    conv_dtype: str | None = None
    ssm_dtype: str | None = None
    mamba_state_ratio: float = 0.5  # static hybrid Mamba: share of the budget for the state pool
    swa_full_tokens_ratio: float = 0.8  # static hybrid SWA: SWA-pool tokens per full-pool token
    prefix_cache: bool = True  # cache full pages (and state checkpoints) by content: prefix_cache.py

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise PoolArgInvalid(
                "disaggregation_mode", self.disaggregation_mode, "one of null, prefill, decode"
            )
        for name in ("page_size", "context_len"):
            if getattr(self, name) < 1:
                raise PoolArgInvalid(name, getattr(self, name), ">= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise PoolArgInvalid("max_running_requests", self.max_running_requests, ">= 1")
        for name in ("kv_dtype", "conv_dtype", "ssm_dtype"):  # one spelling from here on
            if getattr(self, name) is not None:
                try:
                    object.__setattr__(self, name, canonical_dtype(getattr(self, name)))
                except ValueError:
                    raise PoolArgInvalid(name, getattr(self, name), DTYPE_NAMES) from None
        for name, top in (("mamba_state_ratio", 1.0), ("swa_full_tokens_ratio", 100.0)):
            if not 0.0 < getattr(self, name) < top:
                raise PoolArgInvalid(name, getattr(self, name), f"in (0, {top:g})")


@dataclass(frozen=True)
class PoolSizes:
    """The sizes a pool is built with. Unified: one arena holding `num_slots` slots and `num_pages`
    pages when `max_running_requests` requests run; the frontier moves at run time."""

    spec: ModelSpec
    args: PoolArgs
    budget_bytes: int
    arena_bytes: int  # the whole uint8 buffer
    page_bytes: int  # one full-attention page over all full-attention layers (unpadded)
    page_stride_bytes: int
    swa_page_bytes: int
    swa_page_stride_bytes: int
    slot_bytes: int  # one request's whole Mamba state (unpadded)
    slot_stride_bytes: int
    num_pages: int
    num_swa_pages: int
    num_slots: int
    max_running_requests: int
    pages_per_request: int  # full-attention pages one request at context_len holds
    swa_pages_per_request: int

    @property
    def unified(self) -> bool:
        return self.args.enable_unified_memory

    @property
    def page_size(self) -> int:
        return self.args.page_size

    @property
    def max_total_tokens(self) -> int:
        """Tokens of full-attention KV the pool holds while `max_running_requests` requests run."""
        if self.page_bytes == 0:
            return 0
        return self.num_pages * self.page_size

    @property
    def request_bytes_at_full_context(self) -> int:
        return (
            self.slot_stride_bytes
            + self.pages_per_request * self.page_stride_bytes
            + self.swa_pages_per_request * self.swa_page_stride_bytes
        )

    @property
    def requests_at_full_context(self) -> int:
        """How many requests of `context_len` tokens fit at once."""
        if not self.unified:
            by_pages = self.num_pages // self.pages_per_request if self.pages_per_request else None
            by_swa = self.num_swa_pages // self.swa_pages_per_request if self.swa_pages_per_request else None
            by_slots = self.num_slots if self.slot_stride_bytes else None
            return min(n for n in (by_pages, by_swa, by_slots) if n is not None)
        return self.arena_bytes // self.request_bytes_at_full_context

    def summary(self) -> dict[str, object]:
        spec = self.spec
        return {
            "model_kind": spec.kind,
            "architectures": list(spec.architectures),
            "num_layers": spec.num_layers,
            "num_full_attention_layers": spec.num_full_attention_layers,
            "num_mamba_layers": spec.num_mamba_layers,
            "num_swa_layers": spec.num_sliding_window_layers,
            "unified": self.unified,
            "disaggregation_mode": self.args.disaggregation_mode,
            "page_size": self.page_size,
            "context_len": self.args.context_len,
            "page_bytes": self.page_bytes,
            "swa_page_bytes": self.swa_page_bytes,
            "slot_bytes": self.slot_bytes,
            "arena_bytes": self.arena_bytes,
            "num_pages": self.num_pages,
            "num_swa_pages": self.num_swa_pages,
            "num_slots": self.num_slots,
            "max_running_requests": self.max_running_requests,
            "max_total_tokens": self.max_total_tokens,
            "requests_at_full_context": self.requests_at_full_context,
        }


def _arch(spec: ModelSpec) -> str:
    return ", ".join(spec.architectures) or spec.model_type or "unknown"


def check_unified_allowed(spec: ModelSpec, args: PoolArgs) -> None:
    """Rules 1 and 2: refuse unified memory where it cannot mean anything safe."""
    if not args.enable_unified_memory:
        return
    if spec.kind == DEEPSEEK_V4:
        reason = DEEPSEEK_V4_POOLS
    elif spec.kind not in (HYBRID_MAMBA, HYBRID_SWA):
        reason = NOT_HYBRID
    elif spec.kind == HYBRID_SWA and args.disaggregation_mode is not None:
        reason = SWA_UNDER_PD
    else:
        return
    raise UnifiedMemoryRefused(reason, _arch(spec), spec.kind, args.disaggregation_mode)


def size_pools(spec: ModelSpec, args: PoolArgs, budget_bytes: int) -> PoolSizes:
    """Size the pools for `spec` within `budget_bytes`. Pure: no memory is touched."""
    check_unified_allowed(spec, args)
    if budget_bytes <= 0:
        raise ValueError(f"the memory budget must be positive; got {budget_bytes} bytes")
    spec = spec.with_dtypes(kv_dtype=args.kv_dtype, conv_dtype=args.conv_dtype, ssm_dtype=args.ssm_dtype)
    ps = args.page_size
    page_bytes = ps * spec.full_kv_bytes_per_token
    swa_page_bytes = ps * spec.swa_kv_bytes_per_token
    page_stride = align_up(page_bytes, ALIGN_BYTES)
    swa_stride = align_up(swa_page_bytes, ALIGN_BYTES)
    slot_stride = slot_stride_bytes(spec)
    ppr = ceil_div(args.context_len, ps) if page_bytes else 0
    # A request keeps the pages its window touches: the window can straddle one extra page.
    window = spec.sliding_window or args.context_len
    swa_ppr = min(ceil_div(args.context_len, ps), ceil_div(window, ps) + 1) if swa_page_bytes else 0
    arena_bytes = budget_bytes - budget_bytes % ALIGN_BYTES
    usable = arena_bytes
    worst = slot_stride + ppr * page_stride + swa_ppr * swa_stride
    needs = RequestNeeds(
        architectures=_arch(spec),
        context_len=args.context_len,
        needed_bytes=worst,
        slot_bytes=spec.slot_bytes,
        kv_bytes_per_token=spec.full_kv_bytes_per_token,
    )
    if worst > usable:
        raise BudgetTooSmall(needs, budget_bytes)
    # The least a running request holds: its slot, one full page, and (once it is a window long)
    # the SWA pages of its window, which it keeps for the rest of its life.
    min_request = slot_stride + (page_stride if ppr else 0) + swa_ppr * swa_stride
    cap = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS

    num_slots = num_pages = num_swa = 0
    if args.enable_unified_memory:
        running = min(cap, usable // min_request)
        num_slots = running if slot_stride else 0
        num_swa = running * swa_ppr
        num_pages = (usable - num_slots * slot_stride - num_swa * swa_stride) // page_stride if ppr else 0
        if num_pages < 0:  # running requests were sized to leave each at least one page
            raise ValueError(f"{running} running requests leave {num_pages} pages of {usable} usable bytes")
    elif spec.kind == HYBRID_MAMBA or (slot_stride and not ppr):
        state_share = args.mamba_state_ratio if ppr else 1.0
        num_slots = min(int(usable * state_share) // slot_stride, cap)
        num_pages = (usable - num_slots * slot_stride) // page_stride if ppr else 0
        running = min(num_slots, num_pages) if ppr else num_slots
        _check_static_fits(needs, budget_bytes, num_slots >= 1 and num_pages >= ppr, "state/KV")
    elif swa_ppr:
        # full_pages * page_stride + ratio * full_pages * swa_stride == usable (same page size)
        num_pages = int(usable / (page_stride + args.swa_full_tokens_ratio * swa_stride)) if ppr else 0
        num_swa = (usable - num_pages * page_stride) // swa_stride
        running = min(cap, num_swa, num_pages) if ppr else min(cap, num_swa)
        _check_static_fits(needs, budget_bytes, num_pages >= ppr and num_swa >= swa_ppr, "full/SWA")
    else:
        num_pages = usable // page_stride
        running = min(cap, num_pages)
    return PoolSizes(
        spec=spec,
        args=args,
        budget_bytes=budget_bytes,
        arena_bytes=arena_bytes,
        page_bytes=page_bytes,
        page_stride_bytes=page_stride,
        swa_page_bytes=swa_page_bytes,
        swa_page_stride_bytes=swa_stride,
        slot_bytes=spec.slot_bytes,
        slot_stride_bytes=slot_stride,
        num_pages=num_pages,
        num_swa_pages=num_swa,
        num_slots=num_slots,
        max_running_requests=running,
        pages_per_request=ppr,
        swa_pages_per_request=swa_ppr,
    )


def _check_static_fits(needs: RequestNeeds, budget_bytes: int, fits: bool, split: str) -> None:
    if not fits:
        raise BudgetTooSmall(needs, budget_bytes, split)
