"""The arena: band geometry, zero-copy per-layer views at the documented byte offsets, byte moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distpool.memory.arena import arena as arena_module
from distpool.memory.arena.arena import Arena, BandGeometry, band_geometry
from distpool.memory.errors import NotALayerOfKind
from distpool.memory.sizing.layout import SLOT_ORDER, page_places, slot_places
from distpool.model.spec import DENSE, HYBRID_SWA
from tests.factories import make_pool, make_sizes, make_spec


def _bytes_at(arena: Arena, offset: int, nbytes: int) -> torch.Tensor:
    return arena.buffer[offset : offset + nbytes]


def test_unified_bands_span_the_whole_arena():
    sizes = make_sizes(budget_bytes=7680)
    low, high = band_geometry(sizes)
    # 7680 bytes: 10 slots of 768 from the bottom, 15 pages of 512 ending at the top.
    assert low == BandGeometry(name="slots", base_bytes=0, stride_bytes=768, num_positions=10)
    assert high == BandGeometry(name="pages", base_bytes=0, stride_bytes=512, num_positions=15)
    arena = Arena(sizes)
    assert arena.buffer.dtype == torch.uint8 and arena.buffer.numel() == 7680


def test_static_bands_are_the_planned_sizes_and_do_not_overlap():
    sizes = make_sizes(unified=False, budget_bytes=7680)  # mamba_state_ratio 0.5
    assert (sizes.num_slots, sizes.num_pages) == (5, 7)
    low, high = band_geometry(sizes)
    assert low == BandGeometry(name="slots", base_bytes=0, stride_bytes=768, num_positions=5)
    # 7 pages end at the top (7680): they start at 7680 - 7 * 512.
    assert high == BandGeometry(name="pages", base_bytes=4096, stride_bytes=512, num_positions=7)
    assert low.end_bytes == 3840 <= high.base_bytes


def test_unified_high_band_is_top_aligned_when_the_page_stride_does_not_divide_the_region():
    sizes = make_sizes(budget_bytes=7680 + 320)  # 8000 bytes: 15 pages (7680) + 320 spare at the bottom
    low, high = band_geometry(sizes)
    assert (high.base_bytes, high.num_positions, high.end_bytes) == (320, 15, 8000)
    assert low.num_positions == 8000 // 768


def test_kv_view_aliases_the_arena_page_major_heads_outermost():
    sizes = make_sizes(unified=False, budget_bytes=7680)
    arena = Arena(sizes)
    high = arena.high
    places = {(p.layer, p.name): p for p in page_places((1, 3), sizes.spec.full_attention, 4)}
    assert places[(3, "k")].offset == 256 and places[(3, "v")].offset == 384  # L1.K | L1.V | L3.K | L3.V
    k, v = arena.kv_view(3)
    assert k.shape == (7, 4, 2, 8) and k.dtype == torch.bfloat16
    # 512-byte pages of bfloat16; in a page, (kv_heads, page_size, dim): a head's 4 tokens together
    assert k.stride() == (256, 8, 32, 1)
    assert k.data_ptr() == arena.buffer.data_ptr() + high.base_bytes + 256
    assert v.data_ptr() == arena.buffer.data_ptr() + high.base_bytes + 384

    k[5, 2, 1] = torch.arange(8, dtype=torch.bfloat16)
    v[5, 0, 0, 7] = -3.5
    page = high.base_bytes + 5 * 512
    token_k = page + 256 + (1 * 4 + 2) * 8 * 2  # head 1, token 2, 8 bf16 each
    assert torch.equal(
        _bytes_at(arena, token_k, 16).view(torch.bfloat16), torch.arange(8, dtype=torch.bfloat16)
    )
    assert float(_bytes_at(arena, page + 384 + 7 * 2, 2).view(torch.bfloat16)[0]) == -3.5
    rest = arena.buffer.clone()  # nothing outside the two written places changed
    rest[token_k : token_k + 16] = 0
    rest[page + 384 + 14 : page + 384 + 16] = 0
    assert int(rest.count_nonzero()) == 0


def test_state_view_aliases_each_tensor_in_its_own_dtype_its_rows_interleaved_by_layer():
    """A slot holds one region per state tensor, rows outermost then the layer (`SLOT_ORDER`): a
    layer's rows of a tensor lie `layers x row bytes` apart, so a TP rank's rows of every layer are
    one run. Mamba layers 0 and 2: conv (3, 16) bf16 rows of 32 bytes, ssm (2, 4, 8) f32 rows of
    128; each region as large as two tensors rounded up to 64 bytes (conv 2 x 128, ssm 2 x 256)."""
    sizes = make_sizes(budget_bytes=7680)
    arena = Arena(sizes)
    places = {(p.layer, p.name): (p.offset, p.row_stride) for p in slot_places(sizes.spec)}
    assert places == {
        (0, "conv"): (0, 64),
        (2, "conv"): (32, 64),
        (0, "ssm"): (256, 256),
        (2, "ssm"): (384, 256),
    }
    assert SLOT_ORDER == ("tensor", "rows", "layer", "rest")
    conv, ssm = arena.state_view(2)
    assert conv.shape == (10, 3, 16) and conv.dtype == torch.bfloat16
    assert ssm.shape == (10, 2, 4, 8) and ssm.dtype == torch.float32
    assert ssm.data_ptr() == arena.buffer.data_ptr() + 384
    assert ssm.stride() == (768 // 4, 256 // 4, 8, 1) and conv.stride() == (768 // 2, 64 // 2, 1)

    values = torch.linspace(-1, 1, 64).reshape(2, 4, 8)
    ssm[3] = values
    conv[3, 2, 15] = 7.0
    for row in range(2):  # layer 2's row r of slot 3: after layer 0's, 256 bytes after row r - 1
        at = 3 * 768 + 384 + row * 256
        assert torch.equal(_bytes_at(arena, at, 128).view(torch.float32).reshape(4, 8), values[row])
    assert float(_bytes_at(arena, 3 * 768 + 32 + 2 * 64 + 15 * 2, 2).view(torch.bfloat16)[0]) == 7.0
    assert int(_bytes_at(arena, 3 * 768 + 256, 128).count_nonzero()) == 0  # layer 0's row 0: untouched


def test_swa_view_lives_in_the_low_band_and_kv_view_in_the_high_band():
    spec = make_spec(HYBRID_SWA, sliding_window=8)  # layers 0, 2 sliding window; 1, 3 full
    sizes = make_sizes(spec, unified=False, budget_bytes=16384)
    arena = Arena(sizes)
    assert arena.low.name == "swa_pages" and arena.low.base_bytes == 0
    swa_k, swa_v = arena.swa_kv_view(2)
    assert swa_k.shape == (sizes.num_swa_pages, 4, 2, 8)
    assert swa_v.data_ptr() == arena.buffer.data_ptr() + 384
    swa_v[1, 3, 1, 2] = 9.0
    offset = 1 * sizes.swa_page_stride_bytes + 384 + (3 * 2 + 1) * 16 + 2 * 2
    assert float(_bytes_at(arena, offset, 2).view(torch.bfloat16)[0]) == 9.0
    assert arena.kv_view(1)[0].data_ptr() == arena.buffer.data_ptr() + arena.high.base_bytes


def test_views_refuse_layers_of_another_kind():
    arena = Arena(make_sizes(budget_bytes=7680))
    for view, layer, facts in (
        (arena.kv_view, 0, ("full-attention", (1, 3))),
        (arena.state_view, 1, ("Mamba", (0, 2))),
        (arena.swa_kv_view, 0, ("sliding-window", ())),
    ):
        with pytest.raises(NotALayerOfKind) as info:
            view(layer)
        assert (info.value.layer, info.value.kind, info.value.layers) == (layer, *facts)


def test_dense_has_only_pages_and_attention_free_only_slots():
    dense = Arena(make_sizes(make_spec(DENSE), unified=False, budget_bytes=7680))
    # Four attention layers: 1024-byte pages, 7 of them in 7680 bytes (the top 7168).
    assert dense.low is None and (dense.high.stride_bytes, dense.high.num_positions) == (1024, 7)
    with pytest.raises(NotALayerOfKind) as info:
        dense.state_view(0)
    assert (info.value.kind, info.value.layers) == ("Mamba", ())
    mamba_only = Arena(make_sizes(make_spec(DENSE, attention_free=True), unified=False, budget_bytes=8192))
    # Four Mamba layers: 1536-byte slots: 5 in 8192 bytes.
    assert mamba_only.high is None and (mamba_only.low.stride_bytes, mamba_only.low.num_positions) == (
        1536,
        5,
    )
    assert len(mamba_only.state_view(3)) == 2


def test_copy_runs_moves_bytes_once_per_run():
    arena = Arena(make_sizes(budget_bytes=7680))
    arena.buffer[:1024] = torch.arange(1024) % 251
    expected = arena.buffer[:1024].clone()
    arena.copy_runs(torch.tensor([[0, 4096, 1024]]))
    assert torch.equal(arena.buffer[4096:5120], expected)


@pytest.mark.parametrize("staging", [4, 64])  # pieces of at most the shift, or through staging
@pytest.mark.parametrize("shift", [3, -3, 5, -5])
def test_a_copy_whose_destination_overlaps_its_source_keeps_the_bytes(monkeypatch, staging, shift):
    monkeypatch.setattr(arena_module, "SLIDE_STAGING_BYTES", staging)
    arena = Arena(make_sizes(budget_bytes=7680))
    arena.buffer[:] = torch.arange(arena.buffer.numel()) % 251
    src = 100
    expected = arena.buffer[src : src + 40].clone()
    arena.copy_runs(np.array([[src, src + shift, 40]]))
    assert torch.equal(arena.buffer[src + shift : src + shift + 40], expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arena_views_and_compaction_keep_bytes():
    pool = make_pool(budget_bytes=7680, device="cuda")
    assert pool.buffer.is_cuda and pool.kv_view(1)[0].is_cuda
    pool.reserve_batch([("a", 8), ("b", 8)])
    k, _ = pool.kv_view(3)
    k[pool.page_ids("b")] = 1.5
    conv, _ = pool.state_view(0)
    conv[pool.slot_id("b")] = -2.0
    pool.release("a")
    assert pool.compact() == 768 + 1024
    assert bool((pool.kv_view(3)[0][pool.page_ids("b")] == 1.5).all())
    assert bool((pool.state_view(0)[0][pool.slot_id("b")] == -2.0).all())
    pool.check_invariants()
