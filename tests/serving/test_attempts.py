"""The driver's attempts in flight (`serving.path.attempts`) and waiting for room on an event rather than
polling (`Reservations.reserve_first`), with fakes in place of Ray: no cluster."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from distpool.memory.pool import DoesNotFit
from distpool.serving.path.attempt_errors import AdmissionTimedOut, Busy, Retry
from distpool.serving.path.attempts import Attempts
from distpool.serving.path.reservations import Reservations
from distpool.serving.routing.router import Router
from distpool.serving.workloads.workload import Request
from distpool.worker.messages import DecodeFinished
from transfer.wire.failure import FailureKind


class DirectRecovery:
    """Calls go straight to their awaitable (no pings, nobody lost)."""

    async def call(self, name, awaitable, *, silence_s):
        return await awaitable


def make_attempts() -> Attempts:
    attempts = Attempts(DirectRecovery(), silence_s=5.0)
    attempts.start()
    return attempts


def finished(rid: str) -> DecodeFinished:
    return DecodeFinished(
        tokens=[1, 2], decode_s=0.0, admit_s=0.0, destination_runs=1, prefix_hit_tokens=0, verified=True
    )


def test_a_result_fills_the_attempt_on_its_worker_only():
    async def scenario():
        attempts = make_attempts()
        with attempts.open("r1", "decode-0") as attempt:
            assert attempts.waits_on("decode-0", "r1") and not attempts.waits_on("decode-1", "r1")
            attempts.deliver("decode-1", {"r1": finished("r1")})  # an older attempt's news, elsewhere
            assert not attempt.result.done()
            attempts.deliver("decode-0", {"r1": finished("r1")})
            assert attempt.result.result().tokens == [1, 2]
        assert attempts.by_request == {} and not attempts.waits_on("decode-0", "r1")

    asyncio.run(scenario())


def test_a_lost_worker_fails_the_attempts_waiting_on_it():
    async def scenario():
        attempts = make_attempts()
        with attempts.open("r1", "decode-0") as lost, attempts.open("r2", "decode-1") as kept:
            attempts.fail_on("decode-0")
            with pytest.raises(Retry) as failed:
                lost.result.result()
            assert failed.value.kind is FailureKind.WORKER_LOST
            assert not kept.result.done()

    asyncio.run(scenario())


def test_room_is_set_when_an_attempt_ends_or_results_arrive_never_before():
    async def scenario():
        attempts = make_attempts()
        before = attempts.room
        with attempts.open("r1", "decode-0"):
            assert not before.is_set()
        assert before.is_set()  # the attempt ended: what it held is free
        after = attempts.room
        assert not after.is_set()
        attempts.deliver("decode-0", {})  # nothing finished: nothing freed
        assert not after.is_set()
        attempts.deliver("decode-0", {"gone": finished("gone")})  # a request nobody waits for ended
        assert after.is_set()

    asyncio.run(scenario())


def test_a_refused_attempt_frees_no_room():
    """Two refused requests would otherwise wake each other in turn, as fast as workers answer."""

    async def scenario():
        attempts = make_attempts()
        room = attempts.room
        with pytest.raises(Busy), attempts.open("r1", "decode-0"):
            raise Busy("decode-0 has no room")
        with attempts.open("r2", "decode-0") as attempt:
            attempt.refused = True  # refused where it was asked (a local prefill's refusal)
        assert not room.is_set()
        with pytest.raises(Retry), attempts.open("r3", "decode-0"):  # it held room while it failed
            raise Retry(FailureKind.TIMEOUT, "no progress")
        assert room.is_set()

    asyncio.run(scenario())


class FullThenRoomy:
    """A decode worker that refuses reservations until `room` is made."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.has_room = False

        async def reserve(*args):
            self.asked.append(time.monotonic())
            if not self.has_room:
                raise DoesNotFit(args[0], "no room")

        self.reserve = SimpleNamespace(remote=reserve)


def make_reservations(worker: FullThenRoomy, attempts: Attempts, timeout_s: float) -> Reservations:
    deployment = SimpleNamespace(decode={"decode-0": worker})
    router = Router(["prefill-0"], ["decode-0"], page_size=4)
    return Reservations(
        deployment, router, attempts, overlap=False, cache_affinity=False, admission_timeout_s=timeout_s
    )


REQUEST = Request(request_id="r1", prompt=[1, 2, 3])


def test_reserving_first_waits_for_room_to_free_and_asks_again_at_once():
    async def scenario():
        worker, attempts = FullThenRoomy(), make_attempts()
        reservations = make_reservations(worker, attempts, timeout_s=30.0)
        reserving = asyncio.ensure_future(reservations.reserve_first(REQUEST, "prefill-0", set()))
        await asyncio.sleep(0.2)
        assert len(worker.asked) == 1  # refused once, then waiting: no polling meanwhile
        worker.has_room = True
        freed_at = time.monotonic()
        attempts.room_freed()
        assert await reserving == "decode-0"
        assert len(worker.asked) == 2 and worker.asked[1] - freed_at < 0.1

    asyncio.run(scenario())


def test_reserving_first_gives_up_at_the_admission_timeout():
    async def scenario():
        worker, attempts = FullThenRoomy(), make_attempts()
        reservations = make_reservations(worker, attempts, timeout_s=0.3)
        began = time.monotonic()
        with pytest.raises(AdmissionTimedOut) as caught:
            await reservations.reserve_first(REQUEST, "prefill-0", set())
        assert 0.3 <= time.monotonic() - began < 1.0
        assert isinstance(caught.value, Busy)  # waited and tried again by the driver, as any Busy
        assert (caught.value.request_id, caught.value.timeout_s) == ("r1", 0.3)
        assert len(worker.asked) == 2  # once at first, once at the deadline

    asyncio.run(scenario())
