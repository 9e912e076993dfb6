"""The configurator's rules and sizes, with every figure worked out by hand."""

import pickle

import pytest

from distpool.memory.sizing.errors import (
    DEEPSEEK_V4_POOLS,
    NOT_HYBRID,
    SWA_UNDER_PD,
    BudgetTooSmall,
    PoolArgInvalid,
    RequestNeeds,
    UnifiedMemoryRefused,
)
from distpool.memory.sizing.layout import align_up, slot_stride_bytes
from distpool.memory.sizing.sizing import DEFAULT_MAX_RUNNING_REQUESTS, GIB, PoolArgs, size_pools
from distpool.model.spec import AttentionSpec, MambaSpec, ModelSpec, StateTensorSpec

MIB = 1 << 20


def make_spec(kind: str = "hybrid_mamba", **changes) -> ModelSpec:
    """A 4-layer model: full attention on layer 1, Mamba2 on 0/2/3 (or SWA for hybrid_swa)."""
    attn = AttentionSpec(num_kv_heads=2, head_dim=64, v_head_dim=64, dtype="bfloat16")
    fields = dict(
        kind=kind,
        architectures=("TestForCausalLM",),
        model_type="test",
        num_layers=4,
        full_attention_layers=(1,),
        sliding_window_layers=(),
        mamba_layers=(),
        full_attention=attn,
        sliding_attention=None,
        mamba=None,
        dtype="bfloat16",
    )
    if kind == "hybrid_mamba":
        fields["mamba_layers"] = (0, 2, 3)
        fields["mamba"] = MambaSpec(
            family="mamba2",
            tensors=(
                StateTensorSpec(name="conv", shape=(640, 3), dtype="bfloat16"),
                StateTensorSpec(name="ssm", shape=(8, 64, 64), dtype="float32"),
            ),
        )
    elif kind == "hybrid_swa":
        fields["sliding_window_layers"] = (0, 2, 3)
        fields["sliding_attention"] = AttentionSpec(
            num_kv_heads=2, head_dim=64, v_head_dim=64, dtype="bfloat16", sliding_window=128
        )
    fields.update(changes)
    return ModelSpec(**fields)


# One token of one layer: 2 heads x (64 K + 64 V) x 2 bytes.
KV_TOKEN = 2 * (64 + 64) * 2
# One Mamba layer: conv 640x3 bf16 (3840 B, aligned to 3840) + ssm 8x64x64 fp32 (131072 B).
SLOT = 3 * (640 * 3 * 2 + 8 * 64 * 64 * 4)


def test_spec_sizes_by_hand():
    spec = make_spec()
    assert spec.full_kv_bytes_per_token == 1 * KV_TOKEN == 512
    assert spec.slot_bytes == SLOT == 404736
    assert slot_stride_bytes(spec) == SLOT  # 3840 and 131072 are both 64-aligned


def test_unified_mamba_reports_requests_at_full_context_and_tokens():
    p = size_pools(make_spec(), PoolArgs(enable_unified_memory=True, page_size=16, context_len=4096), GIB)
    page = 16 * KV_TOKEN  # 8192
    assert (p.page_bytes, p.page_stride_bytes, p.slot_bytes) == (page, page, SLOT)
    usable = GIB
    assert p.requests_at_full_context == usable // (SLOT + 256 * page)
    assert p.max_running_requests == DEFAULT_MAX_RUNNING_REQUESTS
    assert p.num_slots == 512
    assert p.num_pages == (usable - 512 * SLOT) // page
    assert p.max_total_tokens == p.num_pages * 16


def test_static_mamba_splits_by_ratio():
    p = size_pools(make_spec(), PoolArgs(mamba_state_ratio=0.25, max_running_requests=100000), 64 * MIB)
    usable = 64 * MIB
    assert p.num_slots == int(usable * 0.25) // SLOT
    assert p.num_pages == (usable - p.num_slots * SLOT) // 8192
    assert p.max_running_requests == min(p.num_slots, p.num_pages)
    assert p.requests_at_full_context == min(p.num_slots, p.num_pages // 256)


def test_dense_static_gives_everything_to_kv():
    p = size_pools(make_spec(kind="dense"), PoolArgs(page_size=32, context_len=1000), 16 * MIB)
    page = 32 * KV_TOKEN
    assert p.num_slots == 0 and p.slot_bytes == 0
    assert p.num_pages == 16 * MIB // page
    assert p.pages_per_request == 32  # ceil(1000 / 32)


def test_static_swa_uses_token_ratio_and_window_pages():
    p = size_pools(make_spec(kind="hybrid_swa"), PoolArgs(page_size=16, swa_full_tokens_ratio=0.5), 64 * MIB)
    full_page, swa_page = 16 * KV_TOKEN, 16 * 3 * KV_TOKEN
    usable = 64 * MIB
    assert p.num_pages == int(usable / (full_page + 0.5 * swa_page))
    assert p.num_swa_pages == (usable - p.num_pages * full_page) // swa_page
    assert p.swa_pages_per_request == 128 // 16 + 1  # the window can straddle one more page


@pytest.mark.parametrize(("kind", "reason"), [("dense", NOT_HYBRID), ("deepseek_v4", DEEPSEEK_V4_POOLS)])
def test_unified_refused_for_non_hybrid(kind, reason):
    with pytest.raises(UnifiedMemoryRefused) as err:
        size_pools(make_spec(kind=kind), PoolArgs(enable_unified_memory=True), GIB)
    assert (err.value.reason, err.value.architectures, err.value.kind) == (reason, "TestForCausalLM", kind)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_unified_swa_refused_under_pd(mode):
    args = PoolArgs(enable_unified_memory=True, disaggregation_mode=mode)
    with pytest.raises(UnifiedMemoryRefused) as err:
        size_pools(make_spec(kind="hybrid_swa"), args, GIB)
    assert (err.value.reason, err.value.architectures, err.value.disaggregation_mode) == (
        SWA_UNDER_PD,
        "TestForCausalLM",
        mode,
    )


def test_allowed_combinations():
    for mode in (None, "prefill", "decode"):
        assert size_pools(make_spec(), PoolArgs(enable_unified_memory=True, disaggregation_mode=mode), GIB)
        for kind in ("hybrid_mamba", "hybrid_swa", "dense", "deepseek_v4"):
            assert size_pools(make_spec(kind=kind), PoolArgs(disaggregation_mode=mode), GIB)
    assert size_pools(make_spec(kind="hybrid_swa"), PoolArgs(enable_unified_memory=True), GIB).unified


def test_budget_too_small_names_the_numbers():
    needed = SLOT + 256 * 8192
    with pytest.raises(BudgetTooSmall) as err:
        size_pools(make_spec(), PoolArgs(enable_unified_memory=True), needed - 64)
    spec = make_spec()
    assert err.value.needs == RequestNeeds(
        architectures="TestForCausalLM",
        context_len=4096,
        needed_bytes=needed,
        slot_bytes=spec.slot_bytes,
        kv_bytes_per_token=spec.full_kv_bytes_per_token,
    )
    assert (err.value.budget_bytes, err.value.split) == (needed - 64, None)
    assert size_pools(make_spec(), PoolArgs(enable_unified_memory=True), needed).requests_at_full_context == 1


def test_static_split_that_starves_one_pool_is_refused():
    # 3 MiB: one request fits overall, but 1% of it cannot hold a single 395 KiB slot.
    with pytest.raises(BudgetTooSmall) as err:
        size_pools(make_spec(), PoolArgs(mamba_state_ratio=0.01), 3 * MIB)
    assert (err.value.split, err.value.budget_bytes) == ("state/KV", 3 * MIB)


def test_dtype_overrides_change_sizes():
    p = size_pools(make_spec(), PoolArgs(kv_dtype="float32", ssm_dtype="bfloat16"), GIB)
    assert p.page_bytes == 16 * 2 * KV_TOKEN
    assert p.slot_bytes == 3 * (640 * 3 * 2 + 8 * 64 * 64 * 2)
    assert p.slot_stride_bytes == 3 * (align_up(3840) + 65536)


@pytest.mark.parametrize(
    "changes",
    [
        dict(page_size=0),
        dict(context_len=-1),
        dict(max_running_requests=0),
        dict(disaggregation_mode="both"),
        dict(kv_dtype="int4"),
        dict(mamba_state_ratio=1.5),
        dict(swa_full_tokens_ratio=0.0),
    ],
)
def test_bad_arguments_name_their_field_and_value(changes):
    with pytest.raises(PoolArgInvalid) as err:
        PoolArgs(**changes)
    assert {err.value.field: err.value.value} == changes


def test_unified_swa_keeps_a_whole_window_per_running_request():
    """Regression: running requests were counted at one SWA page each while the plan set a whole
    window aside for each, so the full-attention page count went negative."""
    spec = make_spec(kind="hybrid_swa")  # window 128 tokens: 9 SWA pages of 16 tokens at most
    p = size_pools(spec, PoolArgs(enable_unified_memory=True, page_size=16, context_len=256), 2 * MIB)
    full_page, swa_page = 16 * KV_TOKEN, 16 * 3 * KV_TOKEN
    usable = 2 * MIB
    assert p.max_running_requests == usable // (full_page + 9 * swa_page)
    assert p.num_swa_pages == p.max_running_requests * 9
    assert p.num_pages == (usable - p.num_swa_pages * swa_page) // full_page >= p.max_running_requests
    assert p.max_total_tokens > 0


def test_refusals_cross_a_process_boundary_with_their_facts():
    """Ray pickles what a worker raises: each refusal arrives as itself, its fields intact."""
    needs = RequestNeeds(
        architectures="A", context_len=8, needed_bytes=64, slot_bytes=32, kv_bytes_per_token=4
    )
    for refusal in (
        PoolArgInvalid("page_size", 0, ">= 1"),
        UnifiedMemoryRefused(SWA_UNDER_PD, "A", "hybrid_swa", "decode"),
        BudgetTooSmall(needs, 32, "full/SWA"),
    ):
        back = pickle.loads(pickle.dumps(refusal))
        assert type(back) is type(refusal) and vars(back) == vars(refusal)
