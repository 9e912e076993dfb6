"""Decode's streaming long-poll (`DecodeWorker.next_events(stream=True)`) on workers built directly:
tokens go out in order while a request runs, each once, the token that ends it only with its result;
before its envelope lands, a request's first token is its transfer header's (`DecodeRequest`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from decode.request import DecodeRequest
from distpool.model.sampling import SamplingParams
from distpool.model_impl.reference.model import ReferenceModel
from tests.worker.test_workers import SPEC, make_pair, serve


def test_tokens_stream_in_order_and_the_last_comes_with_the_result():
    p, d = make_pair()
    try:
        prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": list(range(20))}
        serve(p, d, prompts, 40)
        streamed = {rid: [] for rid in prompts}
        finished, calls = {}, 0
        deadline = time.monotonic() + 60
        while len(finished) < len(prompts) and time.monotonic() < deadline:
            events = d.next_events(0.5, stream=True)
            calls += 1
            for rid, (start, tokens) in events.tokens.items():
                assert start == len(streamed[rid]), "each token once, in order"
                streamed[rid] += tokens
            finished |= events.finished
        oracle = ReferenceModel(SPEC)
        for rid, prompt in prompts.items():
            tokens = finished[rid].tokens
            assert tokens == oracle.generate_nocache(prompt, 40)
            assert streamed[rid] == tokens[: len(streamed[rid])] and len(streamed[rid]) < len(tokens)
        assert calls >= 3  # tokens went out while the requests ran, not all at the end
        assert d.next_events(0.05, stream=True).tokens == {}  # nothing handed out twice
    finally:
        p.shutdown()
        d.shutdown()


EIGHT = SamplingParams(max_tokens=8)


def _waiting(first_token, params: SamplingParams = EIGHT) -> DecodeRequest:
    req = DecodeRequest(prompt=[1, 2, 3], params=params)
    req.transfers.append(SimpleNamespace(first_token=first_token))  # what the receiver sets on a header
    return req


def test_a_waiting_request_streams_its_header_token_once():
    req = _waiting(None)
    assert req.unstreamed(eos_token_ids=()) is None  # no header yet
    req.transfers[0].first_token = 42
    assert req.unstreamed(eos_token_ids=()) == (0, [42])
    assert req.unstreamed(eos_token_ids=()) is None
    req.tokens = [42, 7]  # landed, then one step
    assert req.unstreamed(eos_token_ids=()) == (1, [7])


def test_a_token_that_ends_the_request_is_not_streamed():
    assert _waiting(42).unstreamed(eos_token_ids=(42,)) is None  # EOS: it comes with the result
    assert _waiting(42, SamplingParams(max_tokens=1)).unstreamed(eos_token_ids=()) is None  # max_tokens
    stop = SamplingParams(max_tokens=8, stop_token_ids=(9,))
    req = _waiting(None, stop)
    req.tokens = [5, 9]
    assert req.unstreamed(eos_token_ids=()) is None
    req.tokens = [5, 6]
    assert req.unstreamed(eos_token_ids=()) == (0, [5, 6])
