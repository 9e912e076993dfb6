"""Generated workloads: seeded, in their length ranges, clipped to the context, and fast at 32k tokens."""

import statistics
import time

import pytest

from distpool.serving.workloads import workload
from distpool.serving.workloads.workload import DEFAULT_VOCAB_SIZE, WORKLOADS

NEW_TOKENS = 16
STATIC = [name for name in WORKLOADS if name != "multi-turn"]  # multi-turn: test_conversation.py


def make_requests(n: int = 64, *, seed: int = 0, **options):
    options.setdefault("vocab_size", 1000)
    return workload.generate(n, max_new_tokens=NEW_TOKENS, seed=seed, **options)


def lengths(requests) -> list[int]:
    return [len(r.prompt) for r in requests]


@pytest.mark.parametrize("name", STATIC)
def test_every_workload_is_reproducible_by_seed(name):
    first = make_requests(workload=name, context_len=40_000, seed=5)
    assert first == make_requests(workload=name, context_len=40_000, seed=5)
    assert first != make_requests(workload=name, context_len=40_000, seed=6)
    assert [r.request_id for r in first] == [f"req-{i:05d}" for i in range(64)]
    assert all(r.max_new_tokens == NEW_TOKENS and 0 <= min(r.prompt) and max(r.prompt) < 1000 for r in first)


def test_short_prompts_are_128_to_1024_tokens():
    got = lengths(make_requests(200, workload="short"))
    assert 128 <= min(got) and max(got) <= 1024
    assert min(got) < 300 and max(got) > 850  # spread over the range, not bunched


def test_long_prompts_are_8k_to_32k_tokens_and_clip_to_the_context():
    got = lengths(make_requests(40, workload="long", context_len=40_000))
    assert 8192 <= min(got) and max(got) <= 32768 and max(got) > 24_000
    clipped = lengths(make_requests(40, workload="long", context_len=12_000))
    assert 8192 <= min(clipped) and max(clipped) <= 12_000 - NEW_TOKENS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_tailed_keeps_most_prompts_around_1_to_2k_and_about_5_percent_longer(seed):
    context_len = 32_768
    got = lengths(make_requests(400, workload="long-tailed", context_len=context_len, seed=seed))
    long = [n for n in got if n > 2048]
    assert 0.02 <= len(long) / len(got) <= 0.09
    assert max(long) <= context_len - NEW_TOKENS and max(long) > 8192
    body = [n for n in got if n <= 2048]
    assert min(body) >= 256 and 1300 <= statistics.median(body) <= 1700
    assert sum(1000 <= n <= 2048 for n in body) / len(body) > 0.9


def test_mixed_keeps_the_old_defaults_and_call():
    # The call the soak script and serving tests make: no workload, no context_len.
    old_call = workload.generate(50, vocab_size=50, min_prompt=3, max_prompt=9, max_new_tokens=4, seed=7)
    assert old_call == workload.generate(
        50, vocab_size=50, min_prompt=3, max_prompt=9, max_new_tokens=4, seed=7, workload="mixed"
    )
    assert {len(r.prompt) for r in old_call} == set(range(3, 10))  # uniform: every length turns up
    assert all(max(r.prompt) < 50 for r in old_call)
    defaults = lengths(make_requests(300))
    assert 4 <= min(defaults) and max(defaults) <= 96


@pytest.mark.parametrize("name", ["short", "long-tailed", "mixed", "shared-prefix"])
def test_prompts_clip_to_the_context_instead_of_failing(name):
    got = lengths(make_requests(100, workload=name, context_len=200, min_prompt=150, max_prompt=400))
    assert max(got) == 200 - NEW_TOKENS


def test_a_config_without_a_vocab_size_draws_from_the_default_vocab():
    requests = make_requests(20, vocab_size=0, workload="short")
    assert max(t for r in requests for t in r.prompt) < DEFAULT_VOCAB_SIZE
    assert max(t for r in requests for t in r.prompt) > 1000


def test_32k_token_prompts_are_cheap_to_generate():
    started = time.perf_counter()
    requests = make_requests(16, workload="long", context_len=32_768 + NEW_TOKENS, vocab_size=131_072)
    assert sum(lengths(requests)) > 16 * 8192
    # ~0.1 s here: a generous bound against a token-at-a-time loop gone quadratic, not a speed check
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"workload": "huge"},
            "unknown workload 'huge'; choose one of short, long-tailed, long, mixed, shared-prefix, "
            "multi-turn",
        ),
        ({"workload": "multi-turn"}, "use conversation.generate_conversations"),
        ({"workload": "long", "context_len": 8192}, "raise --context-len to at least 8208"),
        ({"context_len": NEW_TOKENS}, "--context-len 16 leaves no room"),
        ({"min_prompt": 10, "max_prompt": 9}, "min <= max"),
        ({"vocab_size": -1}, "vocab_size >= 0"),
    ],
)
def test_bad_input_is_refused_with_the_fix(options, message):
    with pytest.raises(ValueError) as info:
        make_requests(**options)
    assert message in str(info.value)


@pytest.mark.parametrize("n, new_tokens", [(0, 4), (4, 0)])
def test_no_requests_or_no_new_tokens_is_refused(n, new_tokens):
    with pytest.raises(ValueError, match="must be >= 1"):
        workload.generate(n, vocab_size=10, max_new_tokens=new_tokens, seed=0)


def shared_prefix_len(requests) -> int:
    """Tokens every prompt starts with."""
    first, n = requests[0].prompt, 0
    while n < len(first) and all(len(r.prompt) > n and r.prompt[n] == first[n] for r in requests):
        n += 1
    return n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_prefix_prompts_share_one_system_prompt_then_differ(seed):
    requests = make_requests(100, workload="shared-prefix", context_len=8192, seed=seed)
    system = shared_prefix_len(requests)
    assert workload.SYSTEM_PROMPT[0] <= system <= workload.SYSTEM_PROMPT[1]
    user = [len(r.prompt) - system for r in requests]
    assert 64 <= min(user) and max(user) <= 1024 and max(user) - min(user) > 500
    # distinct users after it: a shared part that runs on by chance would be one token at most
    assert len({tuple(r.prompt[system : system + 8]) for r in requests}) == len(requests)
    assert all(0 <= t < 1000 for r in requests for t in r.prompt)


def test_shared_prefix_system_prompts_differ_by_seed_and_clip_to_leave_room_for_the_user():
    a, b = (make_requests(4, workload="shared-prefix", context_len=8192, seed=s) for s in (0, 1))
    assert a[0].prompt[:512] != b[0].prompt[:512]
    short = make_requests(20, workload="shared-prefix", context_len=1000)
    # 984 tokens of room: a system prompt of 1024+ clips to 920, leaving 64 for each user part
    assert shared_prefix_len(short) >= 920 and {len(r.prompt) for r in short} == {1000 - NEW_TOKENS}
    tiny = make_requests(6, workload="shared-prefix", context_len=100)  # under 64 left: halved
    assert {len(r.prompt) for r in tiny} == {100 - NEW_TOKENS} and shared_prefix_len(tiny) == 42
