"""A request moved between TP groups through the engines: prefill ranks of TP A, decode ranks of
TP B, one Gloo channel per (source rank, destination rank) pair the plan uses, all in one process.

Every source rank prefills its shard with the synthetic cache and submits its own envelope on each
of its channels; every destination rank expects its own envelope on each of its channels and has
landed when every part has (`transfer.parts`). Each destination rank then verifies every byte of
its shard against what the synthetic cache computes for that shard, and every pool gives back
every page and slot once the request is released.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

import transfer.ends.sender as sender_module
from distpool.memory.arena_pool import build_pool
from distpool.memory.sizing import TpEnd, layout_description
from distpool.model_impl.synthetic.model import SyntheticCache
from tests.factories import TP_CONFIGS, free_units, tp_spec
from tests.transfer.test_channel import connect_both, make_channel
from tests.transfer.test_reshard import (
    PAGE_SIZE,
    PROMPT,
    destination_ranks,
    layout,
    plan_between,
    prefill_ranks,
    units_of,
)
from tests.transfer.transfer_peer import failure_of, free_port
from transfer import (
    AlreadyExpected,
    EnvelopeReceiver,
    EnvelopeSender,
    FailureKind,
    HeaderRefused,
    TransferError,
    TransferOptions,
)
from transfer.parts import Parts, expect_parts, submit_parts
from transfer.plans import UnitSizesDiffer
from transfer.plans.messages import plan_messages
from transfer.plans.reshard import plan_pair, source_ranks
from transfer.wire import GIVEN_UP, LAYOUT, NOT_EXPECTED

TP_PAIRS = [(2, 1), (1, 2), (2, 4)]
MODELS = list(TP_CONFIGS)  # Mamba2 (one and eight groups), GDN, Falcon-H1, window pages, MLA + KDA


@dataclasses.dataclass
class Groups:
    """The prefill group's and the decode group's ranks, with each rank's channel ends."""

    spec: object
    src_pools: list
    dst_pools: list
    first_token: int
    senders: dict[int, list[EnvelopeSender]]  # source rank -> its ends, one per destination rank
    receivers: dict[int, list[EnvelopeReceiver]]  # destination rank -> its ends, one per source rank
    fresh: dict[int, dict[str, int]]  # id(pool) -> its free units with nothing reserved

    @property
    def pools(self) -> list:
        return self.src_pools + self.dst_pools

    def send(self, request_id: str = "r", **submit_args) -> list[Parts]:
        return [
            submit_parts(self.senders[s], pool.envelope(request_id), pool.buffer, **submit_args)
            for s, pool in enumerate(self.src_pools)
        ]

    def expect(self, request_id: str = "r", *, held_pages: int = 0) -> list[Parts]:
        return [
            expect_parts(self.receivers[d], pool.envelope(request_id, held_pages=held_pages), pool.buffer)
            for d, pool in enumerate(self.dst_pools)
        ]

    def shard_bytes(self, d: int, *, held_pages: int = 0) -> int:
        """What destination rank d's shard holds of the request, less its held pages (no padding)."""
        rank_shard = layout(self.spec, len(self.dst_pools))[d]
        pages = len(self.dst_pools[d].page_ids("r")) - held_pages
        return rank_shard.slot_bytes + pages * PAGE_SIZE * rank_shard.kv_bytes_per_token

    def mismatches(self, request_id: str = "r") -> list:
        """Each destination rank's first wrong byte against its shard's synthetic cache (None: all right)."""
        return [
            SyntheticCache(self.spec, seed=3, shard=pool_shard).admit(
                pool, request_id, PROMPT, self.first_token
            )
            for pool_shard, pool in zip(layout(self.spec, len(self.dst_pools)), self.dst_pools, strict=True)
        ]

    def release_all(self) -> None:
        """Every request released on every rank: every unit comes back."""
        for pool in self.pools:
            for rid in list(pool.request_ids):
                pool.release(rid)
            pool.check_invariants()
            assert free_units(pool) == self.fresh[id(pool)], "pages or slots leaked"


def tp_end(pool, rank_shard) -> TpEnd:
    return TpEnd.of(pool.sizes, rank_shard)


@pytest.fixture
def groups(request):
    """Prefill TP A -> decode TP B for `request.param` = (model, A, B), channels connected."""
    model, src_tp, dst_tp = request.param
    spec = tp_spec(model)
    src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
    src_pools, first = prefill_ranks(spec, src_shards, unified=True)
    dst_pools = destination_ranks(dst_shards, unified=True)
    senders: dict[int, list] = {s: [] for s in range(src_tp)}
    receivers: dict[int, list] = {d: [] for d in range(dst_tp)}
    pairs = []
    for d in range(dst_tp):
        for s in source_ranks(src_shards, dst_shards, d):
            src_pool, dst_pool = src_pools[s], dst_pools[d]
            port = free_port()
            ends = [
                make_channel(
                    role,
                    port,
                    tp=tp_end(pool, pool_shard),
                    layout=layout_description(pool.sizes),
                    fingerprint=pool.fingerprint,
                    name=f"tp-{s}-{d}",
                )
                for role, pool, pool_shard in ((0, src_pool, src_shards[s]), (1, dst_pool, dst_shards[d]))
            ]
            assert connect_both(*ends) == (None, None)
            sender = EnvelopeSender(ends[0], TransferOptions(chunk_bytes=1024, direct_min_bytes=256))
            receiver = EnvelopeReceiver(ends[1], unexpected_wait_s=1.0)
            sender.start()
            receiver.start()
            senders[s].append(sender)
            receivers[d].append(receiver)
            pairs.append((sender, receiver))
    # what each pool has free once everything is released: a fresh pool's figure, same sizes
    fresh = {id(pool): free_units(build_pool(pool.sizes, "cpu")) for pool in src_pools + dst_pools}
    yield Groups(spec, src_pools, dst_pools, first, senders, receivers, fresh)
    for sender, receiver in pairs:
        sender.close()
        receiver.close()


CASES = [(model, a, b) for model in MODELS for a, b in TP_PAIRS]
IDS = [f"{model}-{a}to{b}" for model, a, b in CASES]


def wait_all(parts: list[Parts]) -> None:
    for part in parts:
        part.wait(timeout_s=30)


@pytest.mark.parametrize("groups", CASES, ids=IDS, indirect=True)
def test_every_destination_rank_lands_its_shard_byte_exact(groups):
    """All ranks move at once: each source rank submits on each of its channels, each destination
    rank expects on each of its own; every destination rank's shard verifies."""
    incoming = groups.expect()
    outgoing = groups.send(first_token=groups.first_token)
    wait_all(outgoing + incoming)
    for d, parts in enumerate(incoming):
        # the parts of one rank add up to its shard: each byte arrived once
        assert parts.num_bytes == groups.shard_bytes(d)
        assert {t.first_token for t in parts.transfers} == {groups.first_token}
    assert sum(p.num_bytes for p in outgoing) == sum(p.num_bytes for p in incoming)
    assert groups.mismatches() == [None] * len(groups.dst_pools)
    groups.release_all()


@pytest.mark.parametrize("groups", [("gdn_kv2", 2, 1), ("mamba2_groups1", 1, 2)], indirect=True, ids=str)
def test_a_rank_shares_its_two_gloo_connections_among_its_channels_across_tp(groups):
    """The decode rank of 2:1 (the source rank of 1:2) moves over two channels at once: each has one
    payload connection, where an equal-TP channel has two; both ends of a channel agree."""
    ends = [end for ends in (*groups.senders.values(), *groups.receivers.values()) for end in ends]
    assert len(ends) == 4 and {end.channel.num_streams for end in ends} == {1}
    assert {end.channel.tp_pair.channels_per_rank for end in ends} == {2}
    assert equal_tp_streams() == 2


def equal_tp_streams() -> int:
    """A channel with no TP pair (equal sizes) keeps the default two connections."""
    channel = make_channel(0, free_port())
    return channel._payload_streams()


@pytest.mark.parametrize("groups", [("gdn_kv2", 2, 1), ("mamba2_groups1", 1, 2)], indirect=True, ids=str)
def test_held_prefix_pages_are_not_moved_across_tp(groups):
    """Destination ranks holding the request's first pages (a cached prefix) take only the rest:
    the source's copies of those pages are wiped first, and every destination still verifies."""
    wait_all(groups.expect() + groups.send(first_token=groups.first_token))  # the prefix lands
    held = 2  # of the prompt's three pages
    for pool in groups.src_pools:  # were the held pages moved again, the wiped bytes would land
        for offset, nbytes in pool.envelope_ranges("r")[1 : 1 + held].tolist():
            pool.buffer[offset : offset + nbytes] = 0
    for pool in groups.dst_pools:  # everything but the held pages must arrive again
        envelope = pool.envelope("r", held_pages=held)
        for offset, nbytes in envelope.moving.tolist():
            pool.buffer[offset : offset + nbytes] = 0xFF
    incoming = groups.expect(held_pages=held)
    wait_all(incoming + groups.send(first_token=groups.first_token))
    for d, parts in enumerate(incoming):
        assert all(t.held_pages == held for t in parts.transfers)
        assert parts.num_bytes == groups.shard_bytes(d, held_pages=held) < groups.shard_bytes(d)
    assert groups.mismatches() == [None] * len(groups.dst_pools)
    groups.release_all()


@pytest.mark.parametrize("groups", [("mamba2_groups1", 2, 1)], indirect=True, ids=str)
def test_a_header_with_unsharded_unit_sizes_is_refused_typed_and_nothing_leaks(groups, monkeypatch):
    """A source that describes its envelope with rows of another layout (here: every row twice as
    long) is refused by every destination end before anything is written; the channels stay in
    step, and the next transfer lands."""
    real = sender_module.table_bytes

    def doubled(ranges: torch.Tensor) -> bytes:
        return real(ranges * torch.tensor([1, 2]))

    monkeypatch.setattr(sender_module, "table_bytes", doubled)
    # Rows truly of another layout pair with no offer, so such a sender plans on none (test_offers):
    # its header waits for the answer.
    monkeypatch.setattr(sender_module, "planned_on_offer", lambda channel, job, chunk_bytes: None)
    before = [pool.buffer.clone() for pool in groups.dst_pools]
    incoming = groups.expect()
    outgoing = groups.send(first_token=groups.first_token)
    for parts in incoming + outgoing:
        with pytest.raises(TransferError) as failed:
            parts.wait(timeout_s=30)
        assert failed.value.kind is FailureKind.REFUSED
        assert all(t.done() for t in parts.transfers)
    # A receiving rank fails with the typed fact; a sender hears the problem its REFUSE named (or,
    # where the rank's other part failed first and gave the reservation up, that).
    for parts in incoming:
        refused = parts.error.cause
        assert isinstance(refused, HeaderRefused) and refused.problem == LAYOUT
        assert isinstance(refused.cause, UnitSizesDiffer)
        assert all(size == 2 * refused.cause.expected for size in refused.cause.sizes)
    heard = [parts.error.cause for parts in outgoing]
    assert all(isinstance(refused, HeaderRefused) for refused in heard)
    assert LAYOUT in {refused.problem for refused in heard}
    assert {refused.problem for refused in heard} <= {LAYOUT, GIVEN_UP, NOT_EXPECTED}
    assert all(refused.cause is None for refused in heard)  # the fact itself does not cross the wire
    assert all(torch.equal(a, pool.buffer) for a, pool in zip(before, groups.dst_pools, strict=True))
    monkeypatch.undo()
    wait_all(groups.expect() + groups.send(first_token=groups.first_token))
    assert groups.mismatches() == [None]
    groups.release_all()


@pytest.mark.parametrize("groups", [("gdn_kv2", 2, 1)], indirect=True, ids=str)
def test_one_failed_channel_fails_the_ranks_part_and_the_reservation_is_released(groups):
    """Source rank 1 describes another request length: its channel is refused, the destination
    rank's other part is aborted, and the rank fails typed once both concluded."""
    incoming = groups.expect()
    good = submit_parts(groups.senders[0], groups.src_pools[0].envelope("r"), groups.src_pools[0].buffer)
    short = dataclasses.replace(groups.src_pools[1].envelope("r"), num_tokens=len(PROMPT) - 1)
    bad = groups.senders[1][0].submit(short, groups.src_pools[1].buffer)
    assert failure_of(bad, 30).kind is FailureKind.REFUSED
    with pytest.raises(TransferError) as failed:
        incoming[0].wait(timeout_s=30)
    assert failed.value.kind in (FailureKind.REFUSED, FailureKind.ABORTED)
    assert all(t.done() for t in incoming[0].transfers)  # nothing writes into the reservation now
    # The good source part concludes either way: aborted by the destination, or landed before the
    # other part failed (then the abort came too late to matter, and nothing was lost either way).
    with contextlib.suppress(TransferError):
        good.wait(timeout_s=30)
    assert good.done()
    groups.release_all()


@pytest.mark.parametrize("groups", [("gdn_kv2", 2, 1)], indirect=True, ids=str)
def test_parts_that_cannot_all_start_leave_nothing_expected(groups):
    """The rank's second channel expects the request already: the part started on the first one is
    aborted before the ValueError propagates, so nothing stays registered there."""
    pool, (first, second) = groups.dst_pools[0], groups.receivers[0]
    earlier = second.expect(pool.envelope("r"), pool.buffer)
    with pytest.raises(AlreadyExpected) as already:
        expect_parts([first, second], pool.envelope("r"), pool.buffer)
    assert already.value.request_id == "r"
    assert first.expect(pool.envelope("r"), pool.buffer, deadline_s=0.2).request_id == "r"  # free again
    earlier.abort("the test is over")
    groups.release_all()


@pytest.mark.parametrize("model", list(TP_CONFIGS))
def test_each_pair_plans_its_entry_of_the_whole_plan_from_its_two_tables_alone(model):
    """What one channel computes (`plan_pair`, both ranks' units only) is the pair's entry of
    `plan_reshard` (every rank's units), for every pair, and nothing for a pair the plan skips."""
    spec = tp_spec(model)
    for src_tp, dst_tp in [*TP_PAIRS, (4, 2)]:
        src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
        src_pools, _ = prefill_ranks(spec, src_shards, unified=False)
        dst_pools = destination_ranks(dst_shards, unified=False)
        whole = {
            (p.src_rank, p.dst_rank): p.runs
            for p in plan_between(src_shards, src_pools, dst_shards, dst_pools)
        }
        for s in range(src_tp):
            for d in range(dst_tp):
                runs = plan_pair(
                    src_shards,
                    units_of(src_pools[s], "r"),
                    dst_shards,
                    units_of(dst_pools[d], "r"),
                    src_rank=s,
                    dst_rank=d,
                    page_size=PAGE_SIZE,
                )
                expected = whole.get((s, d), np.zeros((0, 3), dtype=np.int64))
                assert np.array_equal(runs, expected), (src_tp, dst_tp, s, d)


def test_a_pair_that_moves_nothing_of_an_envelope_plans_an_empty_stream():
    assert plan_messages(np.zeros((0, 3), dtype=np.int64), chunk_bytes=1024, direct_min_bytes=256) == []
