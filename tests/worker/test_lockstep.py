"""The ranks of a TP group agree before each model call: on the requests of a decode step, on each
prefill wave, and on stopping; a collective that fails breaks the group for good."""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from decode.request import DecodeRequest
from decode.worker import DecodeWorker
from distpool.memory.pool import DoesNotFit
from distpool.memory.sizing import PoolArgs
from distpool.model.sampling import SamplingParams
from distpool.model_impl.errors import TpGroupMismatch
from distpool.model_impl.prefill_job import PrefillJob
from distpool.worker.config import WorkerConfig
from distpool.worker.lockstep import GroupBroken, Lockstep
from distpool.worker.messages import (
    DecodeFailed,
    DecodeFinished,
    PrefillBusy,
    PrefillCause,
    PrefillFailed,
    PrefillItem,
)
from distpool.worker.stats import PoolHeld
from prefill.worker import PrefillWorker
from tests.factories import accounting, tp_spec
from transfer import FailureKind, TransferOptions
from transfer.connect.groups import gloo_group


def gloo_groups(size: int, timeout_s: float = 10.0) -> list[dist.ProcessGroup]:
    """`size` Gloo groups of one group, formed in this process (one thread per rank)."""
    store, groups = dist.HashStore(), [None] * size

    def form(rank: int) -> None:
        groups[rank] = gloo_group(store, rank, size, datetime.timedelta(seconds=timeout_s), 1, loopback=True)

    on_ranks(size, form)
    return groups


def on_ranks(size: int, fn: Callable[[int], object]) -> list:
    """`fn(rank)` on every rank at once (threads); their results in rank order, or the first error."""
    results, errors = [None] * size, []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # handed to the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def locksteps(size: int, timeout_s: float = 10.0) -> list[Lockstep]:
    steps = [Lockstep(tp=size, rank=rank, device=torch.device("cpu")) for rank in range(size)]
    for step, group in zip(steps, gloo_groups(size, timeout_s), strict=True):
        step.bind(group)
    return steps


def test_a_step_is_the_requests_every_rank_holds_in_rank_0s_order():
    steps = locksteps(3)
    held = [["c", "a", "b", "d"], ["a", "b", "c"], ["b", "x", "c", "a"]]
    agreed = on_ranks(3, lambda rank: steps[rank].common(held[rank]))
    assert agreed == [["c", "a", "b"]] * 3
    # a rank that holds nothing yet: no step, on every rank
    assert on_ranks(3, lambda rank: steps[rank].common([] if rank == 1 else held[rank])) == [[]] * 3
    assert on_ranks(3, lambda rank: steps[rank].common([])) == [[]] * 3


def test_a_rank_knows_whether_another_holds_a_request_it_lacks():
    steps = locksteps(3)
    held = [["a", "b"], ["a"], ["b", "a"]]  # rank 1 lacks b (its shard has not landed there yet)
    agreed = on_ranks(3, lambda rank: steps[rank].agree(held[rank]))
    assert [a.common for a in agreed] == [["a"]] * 3
    assert [a.lacking for a in agreed] == [False, True, False]
    agreed = on_ranks(3, lambda rank: steps[rank].agree(["a"] if rank == 2 else []))
    assert [(a.common, a.lacking) for a in agreed] == [([], True), ([], True), ([], False)]
    agreed = on_ranks(3, lambda rank: steps[rank].agree([]))
    assert [(a.common, a.lacking) for a in agreed] == [([], False)] * 3


def test_the_ranks_stop_together_and_compare_signatures():
    steps = locksteps(2)
    assert on_ranks(2, lambda rank: steps[rank].go(False)) == [True, True]
    assert on_ranks(2, lambda rank: steps[rank].go(rank == 1)) == [False, False]
    assert on_ranks(2, lambda rank: steps[rank].same(7)) == [True, True]
    assert on_ranks(2, lambda rank: steps[rank].same(7 + rank)) == [False, False]


def test_the_model_sums_over_the_group_it_was_bound_to():
    steps = locksteps(2)
    values = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]
    on_ranks(2, lambda rank: steps[rank].allreduce([values[rank]]).wait())
    assert all(v.tolist() == [11.0, 22.0] for v in values)


def test_a_rank_that_never_comes_breaks_the_group_within_its_timeout():
    steps = locksteps(2, timeout_s=1.0)
    with pytest.raises(GroupBroken) as broken:
        steps[0].go(False)  # rank 1 never joins this round
    assert (broken.value.rank, broken.value.tp, broken.value.formed) == (0, 2, True)
    assert broken.value.cause  # the process group's own error, as it read


def test_computing_before_the_group_formed_is_refused():
    with pytest.raises(GroupBroken) as unformed:
        Lockstep(tp=2, rank=1, device=torch.device("cpu")).allreduce([torch.zeros(1)])
    assert (unformed.value.rank, unformed.value.tp, unformed.value.formed) == (1, 2, False)
    again = pickle.loads(pickle.dumps(unformed.value))  # Ray carries it with its fields
    assert (again.rank, again.formed, str(again)) == (1, False, str(unformed.value))
    with pytest.raises(TpGroupMismatch) as mismatch:
        Lockstep(tp=2, rank=1, device=torch.device("cpu")).bind(gloo_groups(2)[0])
    assert (mismatch.value.group_size, mismatch.value.group_rank) == (2, 0)


def test_prefill_ranks_that_reserved_different_waves_compute_none_and_hold_nothing():
    """Rank 1 has no room for the prompt, rank 0 has: neither computes the wave (an all-reduce
    would pair with nothing), both answer busy, and rank 0 gave its reservation back."""
    config = WorkerConfig(
        spec=tp_spec("mamba2_groups1"),
        pool_args=PoolArgs(page_size=4, context_len=64),
        budget_bytes=1 << 20,
        transfer=TransferOptions(timeout_s=5),
        model_impl="synthetic",
        prefill_tp=2,
    )
    ranks = [PrefillWorker(name="prefill-0", config=config, rank=rank) for rank in range(2)]
    for worker, group in zip(ranks, gloo_groups(2), strict=True):
        worker.lockstep.bind(group)
    prompt = list(range(1, 40))
    fillers = 0
    with pytest.raises(DoesNotFit):  # fill rank 1 until the prompt no longer fits there
        while True:
            ranks[1].pool.reserve(f"filler-{fillers}", len(prompt))
            fillers += 1
    before = accounting(ranks[0].pool)
    item = PrefillItem(request_id="r", prompt=prompt, decode_worker="decode-0")
    results = on_ranks(2, lambda rank: ranks[rank].prefill_and_send([item]))
    assert all(isinstance(r["r"], PrefillBusy) for r in results)
    # rank 0 reserved it and gave it back; rank 1, full, never reserved it
    assert [r["r"].cause for r in results] == [PrefillCause.WAVES_DIFFER, PrefillCause.NO_ROOM]
    assert accounting(ranks[0].pool) == before and ranks[0].stats().held == 0
    for worker in ranks:
        worker.shutdown()


def tp2_config(**changes) -> WorkerConfig:
    return WorkerConfig(
        spec=tp_spec("mamba2_groups1"),
        pool_args=PoolArgs(page_size=4, context_len=64),
        budget_bytes=1 << 20,
        transfer=TransferOptions(timeout_s=5),
        model_impl="synthetic",
        **changes,
    )


def test_a_prefill_rank_called_before_its_group_formed_computes_nothing_and_the_batch_is_retried():
    """Regression: a restarted prefill rank given a batch before the driver re-formed its group
    (a call Ray queued while it restarted) exited "computed before its group formed", in every new
    life, until Ray's restarts were used up. It now answers every request failed (retried
    elsewhere), holding nothing, and stays up for its group to form."""
    worker = PrefillWorker(name="prefill-0", config=tp2_config(prefill_tp=2), rank=1)
    before = accounting(worker.pool)
    item = PrefillItem(request_id="r", prompt=list(range(1, 20)), decode_worker="decode-0")
    result = worker.prefill_and_send([item])["r"]
    assert isinstance(result, PrefillFailed) and result.retry and result.kind is FailureKind.WORKER_LOST
    assert result.cause is PrefillCause.GROUP_NOT_FORMED
    assert accounting(worker.pool) == before and worker.stats().held == 0
    worker.shutdown()


def land(worker: DecodeWorker, rid: str, prompt: list[int], *, flip: bool) -> None:
    """`rid`'s shard lands on decode rank `worker` as its transfer writes it (a synthetic prefill of
    the same shard), with one byte flipped if `flip`; the decode loop takes it from there."""
    with worker.lock:
        worker.pool.reserve(rid, len(prompt), final_tokens=len(prompt) + 3)
        first = worker.model.prefill(worker.pool, [PrefillJob(rid, prompt)])[0].first_token
        worker.model.forget(rid)  # decode registers it when it verifies it
        if flip:
            offset = int(worker.pool.envelope(rid).ranges[0, 0])
            worker.pool.buffer[offset] ^= 0xFF
        params = SamplingParams(max_tokens=3)
        worker.arrived[rid] = DecodeRequest(prompt=prompt, params=params, tokens=[first])
        worker.wake.notify_all()


def test_a_shard_corrupt_on_one_decode_rank_fails_the_request_as_corrupt_on_every_rank():
    """Regression: a shard that failed verification on rank 1 only left the request running on
    rank 0, where no step took it (a step is the requests running on every rank): rank 0 never
    finished it, and the driver, waiting for every rank's result, hung. Every rank now fails it as
    corrupt (to be retried), the request beside it completes, and nothing stays held."""
    config = tp2_config(decode_tp=2)
    ranks = [DecodeWorker(name="decode-0", config=config, rank=rank) for rank in range(2)]
    try:
        for worker, group in zip(ranks, gloo_groups(2), strict=True):
            with worker.lock:  # as join_tp_group binds it
                worker.lockstep.bind(group)
                worker.wake.notify_all()
        prompts = {"clean": list(range(1, 12)), "damaged": list(range(30, 45))}
        for rank, worker in enumerate(ranks):
            land(worker, "clean", prompts["clean"], flip=False)
            land(worker, "damaged", prompts["damaged"], flip=rank == 1)
        results = [finished_on(worker, {"clean", "damaged"}) for worker in ranks]
        for rank, done in enumerate(results):
            assert isinstance(done["clean"], DecodeFinished) and len(done["clean"].tokens) == 3
            failed = done["damaged"]
            assert isinstance(failed, DecodeFailed), (rank, failed)
            assert failed.kind is FailureKind.CORRUPT and failed.corrupt and failed.retry
        assert results[0]["clean"].tokens == results[1]["clean"].tokens
        assert [worker.stats().corrupt_envelopes for worker in ranks] == [0, 1]  # rank 1's shard only
        for worker in ranks:  # what the finished request left is its cached prefix, nothing else
            assert worker.drop_prefix_cache() == PoolHeld(pages_used=0, slots_used=0)
    finally:
        for worker in ranks:
            worker.shutdown()


def finished_on(worker: DecodeWorker, rids: set[str], timeout_s: float = 20.0) -> dict:
    """Every result of `rids` that `worker` hands out within `timeout_s`."""
    done: dict = {}
    deadline = time.monotonic() + timeout_s
    while set(done) != rids and time.monotonic() < deadline:
        done |= worker.next_finished(timeout_s=0.2)
    assert set(done) == rids, f"{worker.name} handed out only {sorted(done)}"
    return done
