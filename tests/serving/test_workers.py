"""Prefill and decode workers built directly (no Ray), joined by a real Gloo channel in one process."""

import threading
import time

import pytest

from decode.worker import DecodeWorker
from distpool.configs import REFERENCE_CONFIG
from distpool.configurator import PoolArgs
from distpool.pool import DoesNotFit
from distpool.reference_model import ReferenceModel
from prefill.worker import PrefillWorker
from transfer import TransferError

ARGS = PoolArgs(enable_unified_memory=True, page_size=4, context_len=128)


def make_pair(budget_bytes: int = 4 << 20, timeout_s: float = 5.0):
    common = dict(model_config=str(REFERENCE_CONFIG), pool_args=ARGS, transfer_timeout_s=timeout_s)
    p = PrefillWorker(name="prefill-0", budget_bytes=budget_bytes, **common)
    d = DecodeWorker(name="decode-0", budget_bytes=budget_bytes, **common)
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


def transfer(p, d, rid, destination, first, fault=None):
    """Run send and receive concurrently, as the driver does; return (send result, receive result)."""
    results = {}

    def run(key, fn, *args):
        try:
            results[key] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[key] = exc

    threads = [
        threading.Thread(target=run, args=("sent", p.send, rid, "decode-0", destination, fault)),
        threading.Thread(target=run, args=("received", d.receive, rid, "prefill-0", first)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results["sent"], results["received"]


def wait_finished(d, rids, timeout_s=30.0):
    done, deadline = {}, time.monotonic() + timeout_s
    while len(done) < len(rids) and time.monotonic() < deadline:
        done |= d.collect(rids)
        time.sleep(0.005)
    return done


def test_prefill_transfer_decode_matches_the_oracle(pair):
    p, d = pair
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9], "c": list(range(20))}
    destinations = {rid: d.reserve(rid, len(prompt), 5) for rid, prompt in prompts.items()}
    first = p.prefill(list(prompts.items()))
    for rid in prompts:
        started = time.monotonic()
        sent, received = transfer(p, d, rid, destinations[rid], first[rid])
        wall_s = time.monotonic() - started
        assert sent["bytes"] == received["bytes"] > 0
        # the rate counts only the time bytes were moving, not the wait for the peer
        assert 0 < received["seconds"] < wall_s and 0 < sent["seconds"] < wall_s
    streamed = d.poll(list(prompts))  # tokens as they are produced: a prefix of the final answer
    assert set(streamed) == set(prompts) and all(1 <= len(t) <= 5 for t in streamed.values())
    done = wait_finished(d, list(prompts))
    assert all(done[rid]["tokens"][: len(t)] == t for rid, t in streamed.items())
    oracle = ReferenceModel(str(REFERENCE_CONFIG))
    assert {rid: r["tokens"] for rid, r in done.items()} == {
        rid: oracle.generate_nocache(prompt, 5) for rid, prompt in prompts.items()
    }
    for worker in (p, d):
        s = worker.stats()
        assert (s["pages_used"], s["slots_used"]) == (0, 0)
    assert d.stats()["steps"] >= 4


def test_injected_fault_frees_both_sides_and_the_channel_still_works(pair):
    p, d = pair
    destination = d.reserve("x", 6, 3)
    first = p.prefill([("x", [3, 1, 4, 1, 5, 9])])["x"]
    sent, received = transfer(p, d, "x", destination, first, fault=0)
    assert isinstance(sent, TransferError) and isinstance(received, TransferError)
    assert "injected fault" in str(sent)
    for worker in (p, d):
        s = worker.stats()
        assert (s["pages_used"], s["slots_used"]) == (0, 0)
    # the retry on the same pair goes through
    destination = d.reserve("x", 6, 3)
    first = p.prefill([("x", [3, 1, 4, 1, 5, 9])])["x"]
    sent, received = transfer(p, d, "x", destination, first)
    assert not isinstance(sent, Exception) and not isinstance(received, Exception)
    assert wait_finished(d, ["x"])["x"]["tokens"] == ReferenceModel(str(REFERENCE_CONFIG)).generate_nocache(
        [3, 1, 4, 1, 5, 9], 3
    )


def test_decode_refuses_what_it_cannot_grow_and_holds_nothing(pair):
    _, d = pair
    with pytest.raises(ValueError, match="context"):
        d.reserve("long", 100, 29)  # 129 tokens > --context-len 128
    with pytest.raises(ValueError):
        d.reserve("bad", 0, 1)
    admitted = 0
    with pytest.raises(DoesNotFit):
        for i in range(1000):  # each prompt of 8 fits alone; admission counts every request's growth
            before = d.stats()
            d.reserve(f"r{i}", 8, 120)
            admitted += 1
    assert d.stats() == before  # the refused request holds nothing
    # 4 MiB holds about 95 requests at their full 128 tokens (32 pages of 1 KiB + a 9.6 KB slot)
    assert 80 <= admitted <= 100
    assert d.stats()["pages_used"] == admitted * 2
    assert d.cancel("never-reserved") is False


def test_cancel_and_drop_return_everything(pair):
    p, d = pair
    d.reserve("r", 10, 2)
    p.prefill([("r", list(range(10)))])
    assert d.stats()["pages_used"] > 0 and p.stats()["pages_used"] > 0
    assert d.cancel("r") and p.drop("r")
    assert (d.stats()["pages_used"], p.stats()["pages_used"]) == (0, 0)
    assert (d.stats()["slots_used"], p.stats()["slots_used"]) == (0, 0)
