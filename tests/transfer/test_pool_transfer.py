"""A real pool's envelope, moved between two real pools (prefill -> decode) over a Gloo channel.

Both pools are fragmented first, so the source and destination pages are scattered differently;
after the transfer every K/V page and every state tensor of the request reads the same on both
sides, and both pools return every byte once the owners release.
"""

from __future__ import annotations

import threading

import pytest
import torch

from distpool.memory.arena_pool import build_pool
from distpool.memory.sizing import PoolArgs, layout_description, size_pools
from distpool.model.spec import HYBRID_MAMBA, AttentionSpec, MambaSpec, ModelSpec, StateTensorSpec
from tests.factories import free_units
from tests.transfer.transfer_peer import SECRET, free_port
from transfer import Channel, EnvelopeReceiver, EnvelopeSender, TransferOptions, TransferState

PROMPT_TOKENS = 37


def hybrid_spec() -> ModelSpec:
    """Layers 0 and 2 Mamba2, 1 and 3 full attention: small, with unaligned slot and page strides."""
    attention = AttentionSpec(num_kv_heads=2, head_dim=8, v_head_dim=8, dtype="bfloat16")
    mamba = MambaSpec(
        family="mamba2",
        tensors=(
            StateTensorSpec(name="conv", shape=(3, 16), dtype="bfloat16"),
            StateTensorSpec(name="ssm", shape=(2, 4, 8), dtype="float32"),
        ),
    )
    return ModelSpec(
        kind=HYBRID_MAMBA,
        architectures=("TestHybridForCausalLM",),
        model_type="test_hybrid",
        num_layers=4,
        full_attention_layers=(1, 3),
        sliding_window_layers=(),
        mamba_layers=(0, 2),
        full_attention=attention,
        sliding_attention=None,
        mamba=mamba,
        dtype="bfloat16",
    )


def make_pools():
    spec = hybrid_spec()
    pools = {}
    for mode in ("prefill", "decode"):
        args = PoolArgs(enable_unified_memory=True, disaggregation_mode=mode, page_size=4, context_len=64)
        # decode receives whole states, so its prefix cache keeps no checkpoints (as a decode worker's)
        pools[mode] = build_pool(size_pools(spec, args, 64 << 10), "cpu", checkpoints=mode != "decode")
    return pools["prefill"], pools["decode"]


def fragment(pool, prefix: str, count: int) -> list[str]:
    """Reserve `count` small requests and release every other one, leaving holes between live ones."""
    names = [f"{prefix}{i}" for i in range(count)]
    for name in names:
        pool.reserve(name, 5 + len(name) % 3)
    for name in names[::2]:
        pool.release(name)
    return names[1::2]


@pytest.fixture
def channel_pair(request):
    prefill_pool, decode_pool = make_pools()
    assert prefill_pool.fingerprint == decode_pool.fingerprint
    port, layout = free_port(), layout_description(prefill_pool.sizes)
    ends = [
        Channel(
            rank=r,
            host="127.0.0.1",
            port=port,
            device="cpu",
            fingerprint=p.fingerprint,
            layout=layout,
            timeout_s=5,
            secret=SECRET,
            name="pool",
        )
        for r, p in ((0, prefill_pool), (1, decode_pool))
    ]
    sender = EnvelopeSender(ends[0], TransferOptions(chunk_bytes=1024, direct_min_bytes=512))
    receiver = EnvelopeReceiver(ends[1])
    sender.start()
    receiver.start()
    connecting = threading.Thread(target=receiver.connect)
    connecting.start()
    sender.connect()
    connecting.join()
    yield prefill_pool, decode_pool, sender, receiver
    sender.close()
    receiver.close()


def test_a_real_envelope_moves_between_fragmented_pools(channel_pair):
    prefill_pool, decode_pool, sender, receiver = channel_pair
    fresh = {id(pool): free_units(pool) for pool in (prefill_pool, decode_pool)}
    fragment(prefill_pool, "p", 6)
    fragment(decode_pool, "d", 9)
    prefill_pool.reserve("req", PROMPT_TOKENS)
    decode_pool.reserve("req", PROMPT_TOKENS)
    src_pages, dst_pages = prefill_pool.page_ids("req"), decode_pool.page_ids("req")
    assert src_pages.tolist() != dst_pages.tolist()  # the plan really has to remap pages

    # "Prefill": fill the request's KV pages and state slot on the source.
    g = torch.Generator().manual_seed(0)
    for layer in (1, 3):
        for view in prefill_pool.kv_view(layer):
            view[src_pages] = torch.randn(view[src_pages].shape, generator=g).to(view.dtype)
    for layer in (0, 2):
        for view in prefill_pool.state_view(layer):
            slot = prefill_pool.slot_id("req")
            view[slot] = torch.randn(view[slot].shape, generator=g).to(view.dtype)

    decode_pool.pin("req")
    prefill_pool.pin("req")
    incoming = receiver.expect(decode_pool.envelope("req"), decode_pool.buffer, deadline_s=10)
    outgoing = sender.submit(prefill_pool.envelope("req"), prefill_pool.buffer, deadline_s=10)
    try:
        outgoing.wait()
        incoming.wait()
    finally:
        prefill_pool.unpin("req")
        decode_pool.unpin("req")
    assert incoming.state is outgoing.state is TransferState.SUCCESS

    for layer in (1, 3):
        for src_view, dst_view in zip(prefill_pool.kv_view(layer), decode_pool.kv_view(layer), strict=True):
            assert torch.equal(src_view[src_pages], dst_view[dst_pages])
    for layer in (0, 2):
        for src_view, dst_view in zip(
            prefill_pool.state_view(layer), decode_pool.state_view(layer), strict=True
        ):
            assert torch.equal(src_view[prefill_pool.slot_id("req")], dst_view[decode_pool.slot_id("req")])

    for pool in (prefill_pool, decode_pool):
        pool.check_invariants()
        for rid in list(pool.request_ids):
            pool.release(rid)
        pool.check_invariants()
        assert pool.request_ids == []
        assert free_units(pool) == fresh[id(pool)]  # every byte came back


def test_a_held_prefix_is_neither_moved_nor_written(channel_pair):
    """Decode holds the request's first pages already (cached from an earlier turn): only the slot
    and the other pages move, the held pages keep their bytes, and both ends count what moved."""
    prefill_pool, decode_pool, sender, receiver = channel_pair
    earlier = list(range(PROMPT_TOKENS))
    decode_pool.reserve("earlier", PROMPT_TOKENS)
    cached = decode_pool.prefix_cache.cache_request("earlier", earlier)
    decode_pool.release("earlier")
    match = decode_pool.prefix_cache.match(earlier + [7, 7, 7])
    assert len(match.pages) == len(cached.pages) == PROMPT_TOKENS // 4  # 9 full pages of 4 tokens
    prefill_pool.reserve("req", PROMPT_TOKENS + 3)
    decode_pool.reserve("req", PROMPT_TOKENS + 3, prefix=match)
    g = torch.Generator().manual_seed(1)
    src_pages, dst_pages = prefill_pool.page_ids("req"), decode_pool.page_ids("req")
    held = len(match.pages)
    for layer in (1, 3):
        for src, dst in zip(prefill_pool.kv_view(layer), decode_pool.kv_view(layer), strict=True):
            src[src_pages] = torch.randn(src[src_pages].shape, generator=g).to(src.dtype)
            dst[dst_pages[:held]] = 0  # the held prefix: whatever a transfer wrote there would show
    envelope = decode_pool.envelope("req", held_pages=held)
    incoming = receiver.expect(envelope, decode_pool.buffer, deadline_s=10)
    outgoing = sender.submit(prefill_pool.envelope("req"), prefill_pool.buffer, deadline_s=10)
    outgoing.wait()
    incoming.wait()
    whole, page_bytes = int(envelope.ranges[:, 1].sum()), int(envelope.ranges[1, 1])
    assert outgoing.num_bytes == incoming.num_bytes == envelope.num_bytes == whole - held * page_bytes
    assert outgoing.held_pages == incoming.held_pages == held
    for layer in (1, 3):
        for src, dst in zip(prefill_pool.kv_view(layer), decode_pool.kv_view(layer), strict=True):
            assert torch.equal(src[src_pages[held:]], dst[dst_pages[held:]])
            assert not dst[dst_pages[:held]].any()
    for layer in (0, 2):
        for src, dst in zip(prefill_pool.state_view(layer), decode_pool.state_view(layer), strict=True):
            assert torch.equal(src[prefill_pool.slot_id("req")], dst[decode_pool.slot_id("req")])
    for pool in (prefill_pool, decode_pool):
        pool.release("req")
        pool.check_invariants()
