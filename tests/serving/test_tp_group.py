"""The driver's side of TP groups, without Ray: what a group answers from its ranks' answers, what
the deployment refuses before any rank starts, and that decode TP > 1 keeps the local path off."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from distpool.model.shard import TpUnshardable
from distpool.serving.deploy.deployment import DeploymentSpec, check_tensor_parallel
from distpool.serving.deploy.deployment_checks import (
    TP_WITH_SPREAD,
    TP_WITH_TRANSFORMERS,
    DeploymentRefused,
    RankPoolRefused,
)
from distpool.serving.deploy.tp_group import (
    CALLS,
    GroupDown,
    NotAGroupCall,
    TpGroup,
    merge_decode,
    merge_prefill,
)
from distpool.serving.path.local_path import LocalPath
from distpool.serving.routing.conditional import ConditionalOptions
from distpool.serving.routing.router import Router
from distpool.worker.config import WorkerConfig
from distpool.worker.messages import (
    DecodeFailed,
    DecodeFinished,
    PrefillBusy,
    PrefillCause,
    PrefillFailed,
    PrefillSent,
)
from tests.factories import tp_spec
from tests.serving import helpers
from transfer.wire.failure import FailureKind


def finished(
    tokens: list[int], *, received: int, verified: bool = True, decode_s: float = 1.0
) -> DecodeFinished:
    return DecodeFinished(
        tokens=tokens,
        decode_s=decode_s,
        admit_s=0.1,
        destination_runs=3,
        prefix_hit_tokens=0,
        verified=verified,
        received_bytes=(received,),
    )


def test_a_request_is_verified_only_when_every_rank_verified_its_shard():
    merged = merge_decode([finished([5, 6], received=100), finished([5, 6], received=120, decode_s=2.0)])
    assert isinstance(merged, DecodeFinished)
    assert merged.tokens == [5, 6] and merged.verified
    assert merged.received_bytes == (100, 120) and merged.destination_runs == 6 and merged.decode_s == 2.0
    one_unchecked = merge_decode(
        [finished([5, 6], received=100), finished([5, 6], received=100, verified=False)]
    )
    assert not one_unchecked.verified


def test_a_corrupt_shard_fails_the_request_and_ranks_that_disagree_fail_it_unretried():
    corrupt = DecodeFailed(kind=FailureKind.CORRUPT, reason="rank 1: byte 7", retry=False)
    aborted = DecodeFailed(kind=FailureKind.ABORTED, reason="cancelled", retry=True)
    assert merge_decode([aborted, corrupt]) is corrupt
    assert merge_decode([finished([1], received=8), aborted]) is aborted
    disagree = merge_decode([finished([1, 2], received=8), finished([1, 3], received=8)])
    assert isinstance(disagree, DecodeFailed) and disagree.kind is FailureKind.INTERNAL and not disagree.retry


def sent(nbytes: int, seconds: float) -> PrefillSent:
    return PrefillSent(transfer_bytes=nbytes, transfer_s=seconds, source_runs=2, computed_tokens=9)


def test_prefill_is_sent_when_every_rank_sent_and_busy_or_failed_otherwise():
    both = PrefillSent(transfer_bytes=22, transfer_s=0.7, source_runs=4, computed_tokens=9)
    assert merge_prefill([sent(10, 0.5), sent(12, 0.7)]) == both  # bytes summed, the slowest's time
    busy = PrefillBusy(reason="no room", cause=PrefillCause.NO_ROOM)
    failed = PrefillFailed(
        kind=FailureKind.TIMEOUT, reason="channel", retry=True, cause=PrefillCause.TRANSFER
    )
    assert merge_prefill([sent(10, 0.5), busy]) is busy
    assert merge_prefill([busy, failed]) is failed
    uneven = merge_prefill([sent(10, 0.5), dataclasses.replace(sent(10, 0.5), computed_tokens=4)])
    assert isinstance(uneven, PrefillFailed) and not uneven.retry


def tp_worker(prefill_tp: int, decode_tp: int) -> WorkerConfig:
    return helpers.tp_worker(tp_spec("mamba2_groups1"), prefill_tp, decode_tp, local_prefill=True)


@pytest.mark.parametrize(
    "sizes, model_impl, spread, problem",
    [
        ((2, 2), "transformers", False, TP_WITH_TRANSFORMERS),
        ((2, 1), "transformers", False, TP_WITH_TRANSFORMERS),
        ((1, 2), "synthetic", True, TP_WITH_SPREAD),
    ],
)
def test_what_tensor_parallelism_cannot_run_is_refused(sizes, model_impl, spread, problem):
    with pytest.raises(DeploymentRefused) as refused:
        check_tensor_parallel(tp_worker(*sizes), model_impl, spread=spread)
    assert (refused.value.problem, refused.value.prefill_tp, refused.value.decode_tp) == (problem, *sizes)
    check_tensor_parallel(tp_worker(1, 1), model_impl, spread=spread)  # TP 1 runs anything


def test_a_tp_size_the_model_cannot_shard_is_refused_naming_the_flag():
    with pytest.raises(RankPoolRefused) as refused:
        DeploymentSpec.build(tp_worker(1, 3))
    assert (refused.value.role, refused.value.tp) == ("decode", 3)
    assert isinstance(refused.value.refusal, TpUnshardable) and refused.value.refusal.tp == 3


def test_decode_at_tp_2_takes_the_disaggregated_path_for_every_request():
    """Conditional disaggregation prefills on decode only where decode runs one rank."""
    options = ConditionalOptions()
    router = Router(["prefill-0"], ["decode-0"], page_size=4)

    def local_path(decode_tp: int) -> LocalPath | None:
        spec = DeploymentSpec.build(tp_worker(decode_tp, decode_tp))
        return LocalPath.build(SimpleNamespace(spec=spec), router, options, attempts=None)

    assert isinstance(local_path(1), LocalPath)
    assert local_path(2) is None


class RecordingRank:
    """A rank whose `prefill_and_send` takes a moment and records when it started and ended."""

    def __init__(self, rank: int, log: list) -> None:
        self.rank, self.log = rank, log
        self.prefill_and_send = SimpleNamespace(remote=self._call)

    def _call(self, batch: list[str]):
        self.log.append(("start", self.rank, batch[0]))
        return asyncio.ensure_future(self._answer(batch))

    async def _answer(self, batch: list[str]):
        await asyncio.sleep(0.02)
        self.log.append(("end", self.rank, batch[0]))
        return {rid: sent(10, 0.1) for rid in batch}


def test_a_group_makes_prefill_calls_one_at_a_time_so_every_rank_runs_them_in_one_order():
    async def two_batches(log: list) -> list:
        group = TpGroup("prefill-0", [RecordingRank(0, log), RecordingRank(1, log)])
        return await asyncio.gather(
            group.prefill_and_send.remote(["a"]), group.prefill_and_send.remote(["b"])
        )

    log: list = []
    answers = asyncio.run(two_batches(log))
    assert [set(a) for a in answers] == [{"a"}, {"b"}]
    first_b = log.index(("start", 0, "b"))
    assert {("end", 0, "a"), ("end", 1, "a")} <= set(log[:first_b])  # b reached no rank before a ended
    assert [entry for entry in log if entry[0] == "start"] == [
        ("start", 0, "a"),
        ("start", 1, "a"),
        ("start", 0, "b"),
        ("start", 1, "b"),
    ]


def test_a_group_taken_down_makes_no_call_that_waited_for_its_turn_until_its_ranks_formed_again():
    """Regression: a prefill call queued behind the one in flight when a rank died reached the
    restarted ranks before their group formed, and every new life exited ("computed before its
    group formed") until Ray's restarts were used up."""

    async def scenario(log: list) -> tuple:
        group = TpGroup("prefill-0", [RecordingRank(0, log), RecordingRank(1, log)])
        in_flight = asyncio.ensure_future(group.prefill_and_send.remote(["a"]))
        queued = asyncio.ensure_future(group.prefill_and_send.remote(["b"]))  # waits for a's turn
        await asyncio.sleep(0)
        group.down()  # a rank died: the driver takes the group down
        while_down = group.prefill_and_send.remote(["c"])
        outcomes = await asyncio.gather(in_flight, queued, while_down, return_exceptions=True)
        group.up()  # the new ranks formed their group
        return outcomes, await group.prefill_and_send.remote(["d"])

    log: list = []
    (a, b, c), d = asyncio.run(scenario(log))
    assert set(a) == {"a"} and set(d) == {"d"}  # made before the group went down, and after it came back
    assert isinstance(b, GroupDown) and isinstance(c, GroupDown)
    assert {entry[2] for entry in log} == {"a", "d"}  # b and c reached no rank


def test_a_group_makes_only_the_calls_it_knows():
    group = TpGroup("decode-0", [object(), object()])
    with pytest.raises(NotAGroupCall) as caught:
        group.stats.remote()
    assert isinstance(caught.value, AttributeError)
    assert (caught.value.group, caught.value.method) == ("decode-0", "stats")
    assert set(group.settles) <= CALLS
