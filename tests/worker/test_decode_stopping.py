"""Stopping where tokens are made: a decode worker ends a request at the checkpoint's EOS id or a stop
id (once min_tokens are made), says why, and gives its pages and slot back at once; the first token,
picked at prefill, is drawn as decode would draw it (prefill and decode workers built directly, one
Gloo channel)."""

from __future__ import annotations

import pytest

from decode.request import NO_SEED, RequestRefused
from distpool.model.sampling import Finish, SamplingParams
from distpool.model_impl.reference.model import ReferenceModel
from distpool.worker.config import WorkerConfig
from distpool.worker.messages import DecodeFinished, PrefillItem
from tests.model_impl.test_sampling import generate_nocache
from tests.worker.test_workers import ARGS, SPEC, assert_nothing_held, make_pair, wait_finished
from transfer import TransferOptions

PROMPT = [5, 17, 3, 60, 2, 44, 9]
MAX_TOKENS = 12
ORACLE = ReferenceModel(SPEC, seed=0)
GREEDY = ORACLE.generate_nocache(PROMPT, MAX_TOKENS)
# The first token of the greedy reply not seen before it: the checkpoint's EOS id in these tests.
EOS_AT = next(i for i in range(2, MAX_TOKENS) if GREEDY[i] not in GREEDY[:i])
EOS = GREEDY[EOS_AT]


@pytest.fixture(scope="module")
def pair():
    config = WorkerConfig(
        spec=SPEC,
        pool_args=ARGS,
        budget_bytes=4 << 20,
        transfer=TransferOptions(timeout_s=5.0),
        eos_token_ids=(EOS,),
    )
    p, d = make_pair(config=config)
    yield p, d
    p.shutdown()
    d.shutdown()


def serve(p, d, requests: dict[str, SamplingParams]) -> dict[str, DecodeFinished]:
    for rid, params in requests.items():
        d.reserve(rid, PROMPT, params, "prefill-0")
    items = [PrefillItem(rid, PROMPT, "decode-0", params) for rid, params in requests.items()]
    p.prefill_and_send(items)
    done = wait_finished(d, list(requests))
    assert all(isinstance(r, DecodeFinished) for r in done.values()), done
    return done


def test_the_checkpoints_eos_ends_the_request_and_frees_it_before_max_tokens(pair):
    p, d = pair
    steps = d.stats().steps
    (done,) = serve(p, d, {"eos": SamplingParams(max_tokens=MAX_TOKENS)}).values()
    assert done.tokens == GREEDY[: EOS_AT + 1]
    assert done.finish == Finish("stop", EOS)
    # It left the batch at its EOS: EOS_AT decode steps (its first token is prefill's), not 11.
    assert d.stats().steps - steps == EOS_AT < MAX_TOKENS - 1
    assert_nothing_held(p, d)


def test_stop_ids_min_tokens_ignore_eos_and_sampling_in_one_batch(pair):
    p, d = pair
    requests = {
        "stop-id": SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(GREEDY[1],), ignore_eos=True),
        "ignore-eos": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        "min-tokens": SamplingParams(max_tokens=MAX_TOKENS, min_tokens=EOS_AT + 2),
        "sampled": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.2, top_k=20, seed=5, ignore_eos=True),
        "first-token": SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(GREEDY[0],)),
    }
    done = serve(p, d, requests)
    assert done["stop-id"].tokens == GREEDY[:2] and done["stop-id"].finish == Finish("stop", GREEDY[1])
    assert done["ignore-eos"].tokens == GREEDY and done["ignore-eos"].finish == Finish("length")
    held = done["min-tokens"].tokens
    assert held[:EOS_AT] == GREEDY[:EOS_AT] and held[EOS_AT] != EOS and len(held) >= EOS_AT + 2
    assert EOS not in held[:-1]
    # Ended at its first token, prefill's: decode handed it out on arrival.
    assert done["first-token"].tokens == GREEDY[:1] and done["first-token"].finish.reason == "stop"
    for rid, params in requests.items():
        assert done[rid].tokens == generate_nocache(ORACLE, PROMPT, params, (EOS,)), rid
    assert done["sampled"].tokens != GREEDY
    assert_nothing_held(p, d)


def test_a_sampled_request_without_a_seed_is_refused_holding_nothing(pair):
    p, d = pair
    with pytest.raises(RequestRefused) as refused:
        d.reserve("no-seed", PROMPT, SamplingParams(max_tokens=4, temperature=1.0), "prefill-0")
    assert (refused.value.request_id, refused.value.problem) == ("no-seed", NO_SEED)
    assert_nothing_held(p, d)
