"""Prefill and decode workers built directly (no Ray), joined by a real Gloo channel in one process."""

import inspect
import pickle
import threading
import time

import pytest

from decode.request import OVER_CONTEXT, RequestRefused
from decode.worker import DecodeWorker
from distpool.memory.pool import DoesNotFit, Pool, RequestIdInvalid
from distpool.memory.sizing import PoolArgs
from distpool.model.hf_config import spec_from_hf
from distpool.model.sampling import SamplingParams
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.model_impl.reference.model import ReferenceModel
from distpool.worker.config import WorkerConfig
from distpool.worker.messages import DecodeFailed, PrefillFailed, PrefillItem, PrefillResult, PrefillSent
from prefill.worker import PrefillWorker
from transfer import ChannelError, FailureKind, TransferOptions
from transfer.defaults import MAX_CHUNK_BYTES

ARGS = PoolArgs(enable_unified_memory=True, page_size=4, context_len=128)
SPEC = spec_from_hf(REFERENCE_HYBRID_CONFIG)


def make_pair(budget_bytes: int = 4 << 20, timeout_s: float = 5.0, wrap=None, config=None):
    config = config or WorkerConfig(
        spec=SPEC, pool_args=ARGS, budget_bytes=budget_bytes, transfer=TransferOptions(timeout_s=timeout_s)
    )
    p = PrefillWorker(name="prefill-0", config=config)
    d = DecodeWorker(name="decode-0", config=config)
    if wrap is not None:
        p.pool, d.pool = wrap(p.pool), wrap(d.pool)
    host, port = p.rendezvous_address()
    opener = threading.Thread(target=d.open_channel, args=("prefill-0", host, port))
    opener.start()
    p.open_channel("decode-0", host, port)
    opener.join()
    return p, d


@pytest.fixture
def pair():
    p, d = make_pair()
    yield p, d
    p.shutdown()
    d.shutdown()


def serve(p, d, prompts: dict[str, list[int]], max_new_tokens: int, fault=None) -> dict[str, PrefillResult]:
    """The driver's calls: reserve on decode, prefill-and-send (with `fault` planned into each
    transfer through the prefill worker's seam, if given)."""
    for rid, prompt in prompts.items():
        d.reserve(rid, prompt, SamplingParams(max_tokens=max_new_tokens), "prefill-0")
        if fault is not None:
            p.plan_fault(rid, fault)
    return p.prefill_and_send([to_decode_0(rid, prompt) for rid, prompt in prompts.items()])


def prefill_one(p, request_id: str, prompt: list[int]) -> PrefillResult:
    """Prefill one request already reserved on decode-0: what became of it."""
    return p.prefill_and_send([to_decode_0(request_id, prompt)])[request_id]


def to_decode_0(request_id: str, prompt: list[int]) -> PrefillItem:
    return PrefillItem(request_id=request_id, prompt=prompt, decode_worker="decode-0")


def wait_finished(d, rids, timeout_s=30.0):
    done, deadline = {}, time.monotonic() + timeout_s
    while len(done) < len(rids) and time.monotonic() < deadline:
        done |= d.next_finished(0.5)
    return done


def assert_nothing_held(*workers):
    for worker in workers:
        s = worker.stats()
        assert (s.pages_used, s.slots_used) == (0, 0)


def test_prefill_transfer_decode_matches_the_oracle(pair):
    p, d = pair
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9], "c": list(range(20))}
    started = time.monotonic()
    sent = serve(p, d, prompts, 5)
    wall_s = time.monotonic() - started
    assert {type(r) for r in sent.values()} == {PrefillSent}
    # the rate counts only the time bytes were moving, not the wait for the peer
    assert all(r.transfer_bytes > 0 and 0 < r.transfer_s < wall_s for r in sent.values())
    done = wait_finished(d, list(prompts))  # streaming as they run: tests/worker/test_streaming.py
    oracle = ReferenceModel(SPEC)
    assert {rid: r.tokens for rid, r in done.items()} == {
        rid: oracle.generate_nocache(prompt, 5) for rid, prompt in prompts.items()
    }
    assert_nothing_held(p, d)
    assert d.stats().steps >= 4


def test_the_first_token_travels_in_the_transfer_header(pair):
    p, d = pair
    sent = serve(p, d, {"one": [5, 4, 3]}, 1)  # decode generates nothing: its only token is prefill's
    assert isinstance(sent["one"], PrefillSent)
    assert wait_finished(d, ["one"])["one"].tokens == ReferenceModel(SPEC).generate_nocache([5, 4, 3], 1)


def test_injected_fault_frees_both_sides_and_the_channel_still_works(pair):
    p, d = pair
    sent = serve(p, d, {"x": [3, 1, 4, 1, 5, 9]}, 3, fault="sender_abort")
    assert isinstance(sent["x"], PrefillFailed) and sent["x"].retry
    assert sent["x"].kind is FailureKind.ABORTED
    deadline = time.monotonic() + 5
    while d.stats().pages_used and time.monotonic() < deadline:  # decode frees on its own thread
        time.sleep(0.01)
    assert_nothing_held(p, d)
    # the retry on the same pair goes through
    assert isinstance(serve(p, d, {"x": [3, 1, 4, 1, 5, 9]}, 3)["x"], PrefillSent)
    assert wait_finished(d, ["x"])["x"].tokens == ReferenceModel(SPEC).generate_nocache([3, 1, 4, 1, 5, 9], 3)


def test_decode_refuses_what_it_cannot_grow_and_holds_nothing(pair):
    _, d = pair
    with pytest.raises(RequestRefused) as refused:
        d.reserve("long", [1] * 100, SamplingParams(max_tokens=29), "prefill-0")
    assert (refused.value.problem, refused.value.needed, refused.value.context_len) == (
        OVER_CONTEXT,
        129,
        128,
    )
    assert pickle.loads(pickle.dumps(refused.value)).needed == 129  # Ray carries it with its facts
    with pytest.raises(ValueError):
        d.reserve("bad", [], SamplingParams(max_tokens=1), "prefill-0")
    admitted = 0
    with pytest.raises(DoesNotFit):
        for i in range(1000):  # each prompt of 8 fits alone; admission counts every request's growth
            before = d.stats()
            d.reserve(f"r{i}", [1] * 8, SamplingParams(max_tokens=120), "prefill-0")
            admitted += 1
    assert d.stats() == before  # the refused request holds nothing
    # 4 MiB holds about 95 requests at their full 128 tokens (32 pages of 1 KiB + a 9.6 KB slot)
    assert 80 <= admitted <= 100
    assert d.stats().pages_used == admitted * 2
    assert d.cancel("never-reserved") is False


def test_cancel_returns_the_reservation(pair):
    p, d = pair
    d.reserve("r", list(range(10)), SamplingParams(max_tokens=2), "prefill-0")
    assert d.stats().pages_used > 0
    assert d.cancel("r")
    assert_nothing_held(p, d)
    # the prefill that comes too late is refused by decode, and frees its own copy
    sent = prefill_one(p, "r", list(range(10)))
    assert isinstance(sent, PrefillFailed) and sent.kind is FailureKind.REFUSED  # no reservation
    assert_nothing_held(p, d)


def test_a_reservation_from_an_unknown_prefill_worker_holds_nothing(pair):
    _, d = pair
    with pytest.raises(ChannelError) as failure:
        d.reserve("r", list(range(10)), SamplingParams(max_tokens=2), "prefill-9")
    assert failure.value.kind is FailureKind.PEER_LOST  # no channel to it
    assert_nothing_held(d)


class InterfaceOnly:
    """A pool that offers exactly the `Pool` interface: anything else a worker reaches for fails."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self._names = {n for n in dir(Pool) if not n.startswith("_")} | set(Pool.__annotations__)

    def __getattr__(self, name: str):
        if name not in self._names:
            raise AttributeError(f"workers use {name!r}, which the Pool interface does not offer")
        return getattr(self._pool, name)


def test_workers_use_nothing_but_the_pool_interface():
    assert {"reserve", "extend_batch", "usage", "pages_for"} <= {
        n for n, _ in inspect.getmembers(Pool, inspect.isfunction)
    }
    p, d = make_pair(wrap=InterfaceOnly)
    try:
        sent = serve(p, d, {"a": [1, 2, 3, 4, 5], "b": list(range(30))}, 6)
        assert {type(r) for r in sent.values()} == {PrefillSent}
        assert len(wait_finished(d, ["a", "b"])) == 2
        with pytest.raises(DoesNotFit):
            for i in range(1000):
                d.reserve(f"r{i}", [1] * 8, SamplingParams(max_tokens=120), "prefill-0")
        assert_nothing_held(p)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_reservation_that_fails_after_taking_memory_gives_it_all_back(pair):
    _, d = pair
    with pytest.raises(RequestIdInvalid) as err:
        # the pool holds it; the envelope cannot carry the id
        d.reserve("x" * 300, list(range(10)), SamplingParams(max_tokens=2), "prefill-0")
    assert (err.value.value, err.value.limit) == ("x" * 300, 256)
    assert_nothing_held(d)
    assert d.stats().pages_peak > 0  # it did take memory before it failed


def test_a_transfer_at_the_largest_allowed_chunk_goes_through():
    """Regression: a chunk above 256 MiB passed validation, then every transfer was refused because
    the decode end was built with its own 256 MiB limit. Staging grows to the messages actually sent,
    so a small envelope at a 1 GiB chunk allocates no more than it moves."""
    config = WorkerConfig(
        spec=SPEC,
        pool_args=ARGS,
        budget_bytes=4 << 20,
        transfer=TransferOptions(timeout_s=5.0, chunk_bytes=MAX_CHUNK_BYTES),
    )
    p, d = make_pair(config=config)
    try:
        prompts = {"big-chunk": list(range(40))}
        sent = serve(p, d, prompts, 3)
        assert isinstance(sent["big-chunk"], PrefillSent), sent
        done = wait_finished(d, list(prompts))
        assert done["big-chunk"].tokens == ReferenceModel(SPEC).generate_nocache(prompts["big-chunk"], 3)
        assert_nothing_held(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_reservation_refused_while_prefill_computes_refuses_its_transfer_and_frees_both(pair):
    """The driver reserves while prefill computes: a refused reservation leaves a refusal behind,
    so prefill's header is refused at once (not after the unexpected-header wait) and prefill frees
    its copy; once the driver gives the attempt up, the next one goes through."""
    p, d = pair
    filled, prompt = [], [1] * 8  # as large as each filling one: it cannot fit
    with pytest.raises(DoesNotFit):
        for i in range(1000):
            d.reserve(f"fill{i}", [1] * 8, SamplingParams(max_tokens=120), "prefill-0")
            filled.append(f"fill{i}")
    before = d.stats()
    with pytest.raises(DoesNotFit):
        d.reserve("late", prompt, SamplingParams(max_tokens=120), "prefill-0")
    sent = prefill_one(p, "late", prompt)
    assert isinstance(sent, PrefillFailed) and sent.retry
    assert sent.kind is FailureKind.NO_ROOM  # decode's refusal travelled to prefill as its kind
    assert_nothing_held(p)
    assert d.stats() == before
    for rid in filled:
        assert d.cancel(rid)
    assert not d.cancel("late")  # held nothing; forgets the refusal for the next attempt
    assert isinstance(serve(p, d, {"late": prompt}, 120)["late"], PrefillSent)
    assert wait_finished(d, ["late"])["late"].tokens == ReferenceModel(SPEC).generate_nocache(prompt, 120)
    assert_nothing_held(p, d)


def test_an_exception_in_the_decode_loop_fails_its_requests_and_the_loop_goes_on(pair, monkeypatch):
    """Regression: an exception raised inside the decode loop's thread ended the thread; its requests
    were never handed out and the run waited for them forever. They now fail with the reason (not to
    be retried: a bug), give their memory back, and the loop serves the next request."""
    p, d = pair

    def broken_step(*args, **kwargs):
        raise RuntimeError("a bug in the decode step")

    prompts = {"a": [1, 2, 3, 4, 5], "b": list(range(12))}
    with monkeypatch.context() as patch:
        patch.setattr(d.model, "decode_step", broken_step)
        assert {type(r) for r in serve(p, d, prompts, 4).values()} == {PrefillSent}
        done = wait_finished(d, list(prompts))
    assert set(done) == set(prompts)
    for result in done.values():
        assert isinstance(result, DecodeFailed)
        assert (result.kind, result.retry, result.corrupt) == (FailureKind.INTERNAL, False, False)
    assert_nothing_held(p, d)
    assert isinstance(serve(p, d, {"c": [7, 8, 9]}, 3)["c"], PrefillSent)
    assert wait_finished(d, ["c"])["c"].tokens == ReferenceModel(SPEC).generate_nocache([7, 8, 9], 3)
