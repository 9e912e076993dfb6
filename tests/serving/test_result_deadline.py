"""The driver's deadline on a decode result: waited on while decode makes progress on the request,
given up (a timeout, retried) once it stops, never awaited without end."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest

from distpool.serving.path.attempt_errors import NOT_HELD, NoProgress, Retry
from distpool.serving.path.attempts import STALLS_ALLOWED, await_result
from transfer.wire.failure import FailureKind

SILENCE_S = 0.05


def asked(answers: list[dict[str, int]]):
    """A worker's `progress` answers, one per ask (the last one repeats)."""
    calls = []

    async def progress() -> dict[str, int]:
        calls.append(time.monotonic())
        return answers[min(len(calls), len(answers)) - 1]

    return progress, calls


def test_a_result_that_never_comes_from_a_worker_that_holds_the_request_stuck_is_given_up():
    async def scenario():
        future = asyncio.get_running_loop().create_future()  # never set: a rank dropped the request
        progress, calls = asked([{"r": 4}])
        with pytest.raises(NoProgress) as caught:
            await await_result(future, progress, "r", worker="decode-0", silence_s=SILENCE_S)
        return caught.value, calls

    error, calls = asyncio.run(scenario())
    assert isinstance(error, Retry) and error.kind is FailureKind.TIMEOUT
    assert (error.worker, error.request_id, error.progress, error.held) == ("decode-0", "r", 4, True)
    assert error.waited_s == pytest.approx(STALLS_ALLOWED * SILENCE_S)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.kind, str(copy)) == (NoProgress, FailureKind.TIMEOUT, str(error))
    assert len(calls) == STALLS_ALLOWED + 1  # the first ask sees where it is, the next ones no change


def test_a_request_no_longer_held_is_given_up_and_one_that_advances_is_waited_for():
    async def not_held():
        future = asyncio.get_running_loop().create_future()
        progress, _ = asked([{}])
        with pytest.raises(NoProgress) as caught:
            await await_result(future, progress, "r", worker="decode-0", silence_s=SILENCE_S)
        assert caught.value.progress == NOT_HELD and not caught.value.held

    async def advancing():
        future = asyncio.get_running_loop().create_future()
        progress, calls = asked([{"r": n} for n in range(1, 9)])
        asyncio.get_running_loop().call_later(SILENCE_S * 7.5, future.set_result, "tokens")
        return await await_result(future, progress, "r", worker="decode-0", silence_s=SILENCE_S), calls

    asyncio.run(not_held())
    result, calls = asyncio.run(advancing())
    assert result == "tokens" and len(calls) >= STALLS_ALLOWED + 2  # waited past where stalls would end it
