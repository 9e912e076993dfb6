"""`distpool bench serve` against the front end over the fake engine, served by uvicorn in a thread
(no Ray): the JSON's figures agree with each other and with the workload, at two rates; multi-turn
sends each turn after the previous reply with the conversation in front; chat sends text."""

from __future__ import annotations

import json

import pytest

from distpool.bench.arrivals import arrival_offsets
from distpool.cli import main
from tests.api.byte_tokenizer import save_byte_tokenizer
from tests.api.fake_engine import echo_reply
from tests.bench.fake_server import fake_engine, serving_in_thread

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@pytest.fixture(scope="module")
def ids_server():
    """A server without a tokenizer, as the synthetic model: token-id prompts, ids streamed back."""
    engine = fake_engine()
    with serving_in_thread(engine) as url:
        yield url, engine


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    engine = fake_engine(str(save_byte_tokenizer(tmp_path_factory.mktemp("tokenizer"))))
    with serving_in_thread(engine) as url:
        yield url, engine


def bench(url: str, tmp_path, *flags: str) -> dict:
    path = tmp_path / "bench.json"
    assert (
        main(["bench", "serve", "--base-url", url, "--vocab-size", "256", "--json", str(path), *flags]) == 0
    )
    return json.loads(path.read_text())


def assert_consistent(run: dict, num_requests: int, percentiles=(50, 90, 99)) -> None:
    assert run["completed"] + run["failed"] == num_requests
    assert run["duration"] > 0
    assert run["request_throughput"] == pytest.approx(run["completed"] / run["duration"])
    assert run["request_goodput"] <= run["request_throughput"]
    assert 0.0 <= run["slo_attainment"] <= 1.0
    assert run["total_token_throughput"] == pytest.approx(
        (run["total_input_tokens"] + run["total_output_tokens"]) / run["duration"]
    )
    for name in LATENCIES:
        ordered = [run[f"p{p}_{name}_ms"] for p in percentiles]
        assert ordered == sorted(ordered), (name, ordered)
        assert ordered[0] <= run[f"median_{name}_ms"] <= ordered[-1]
        assert run[f"std_{name}_ms"] >= 0 and run[f"mean_{name}_ms"] > 0
    top = percentiles[-1]
    assert run[f"p{top}_ttft_ms"] <= run[f"p{top}_e2el_ms"]
    assert run["median_ttft_ms"] <= run["median_e2el_ms"]


def test_two_rates_give_consistent_figures(ids_server, tmp_path, capsys):
    url, engine = ids_server
    doc = bench(
        url, tmp_path,
        "--dataset", "random", "--input-len", "16", "--output-len", "8", "--num-prompts", "12",
        "--request-rate", "40,inf", "--goodput", "ttft:5000", "tpot:5000", "--seed", "3",
    )  # fmt: skip
    runs = {run["request_rate"]: run for run in doc["runs"]}
    assert set(runs) == {40.0, "inf"}
    for run in runs.values():
        assert_consistent(run, 12)
        assert run["completed"] == 12 and run["failed"] == 0 and run["errors"] == []
        assert run["total_input_tokens"] == 12 * 16  # usage.prompt_tokens, as the server counted
        assert run["total_output_tokens"] == 12 * 8  # ignore_eos and max_tokens: exactly as asked
        assert run["slo_attainment"] == 1.0  # SLOs of seconds against a fake of milliseconds
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        # TPOT excludes the first token: the fake's 2 ms steps, not its first token's wait
        assert 1.0 < run["median_tpot_ms"] < run["median_e2el_ms"]
    # at 40/s the run lasts at least until its last seeded arrival (about 0.3 s in)
    assert runs[40.0]["duration"] >= arrival_offsets(12, 40.0, 1.0, seed=3)[-1] > 0.1
    found = doc["rate_at_attainment"]["endpoint"]
    assert found["kind"] == "measured" and found["rate"] == 40.0 and found["measured"] == [[40.0, 1.0]]
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "P99 TPOT (ms):" in out and "at least 40 req/s" in out


def test_tight_slos_lower_attainment_and_goodput(ids_server, tmp_path):
    url, _ = ids_server
    doc = bench(
        url, tmp_path,
        "--dataset", "random", "--input-len", "8", "--output-len", "4", "--num-prompts", "6",
        "--goodput", "ttft:0.001", "--percentiles", "25,75",
    )  # fmt: skip
    (run,) = doc["runs"]
    assert_consistent(run, 6, percentiles=(25, 75))
    assert run["slo_attainment"] == 0.0 and run["request_goodput"] == 0.0
    assert "p99_ttft_ms" not in run and "p25_ttft_ms" in run


def test_slos_from_unloaded_are_k_times_its_medians_and_recorded(ids_server, tmp_path, capsys):
    url, _ = ids_server
    doc = bench(
        url, tmp_path,
        "--dataset", "random", "--input-len", "8", "--output-len", "4", "--num-prompts", "6",
        "--request-rate", "inf", "--slo-from-unloaded", "2.5",
    )  # fmt: skip
    rule = doc["config"]["slo_from_unloaded"]
    assert rule["k"] == 2.5 and rule["requests"] == 5 and rule["deployment"] == "endpoint"
    assert rule["median_ttft_ms"] > 0 and rule["median_tpot_ms"] > 0
    assert doc["config"]["goodput"] == pytest.approx(
        {"ttft": 2.5 * rule["median_ttft_ms"], "tpot": 2.5 * rule["median_tpot_ms"]}
    )
    (run,) = doc["runs"]
    assert_consistent(run, 6)
    assert "SLOs 2.5 x the unloaded medians of 5 requests" in capsys.readouterr().out


def test_multi_turn_sends_each_turn_after_the_previous_reply(ids_server, tmp_path):
    url, engine = ids_server
    before = set(engine.prompts)
    doc = bench(
        url, tmp_path, "--dataset", "multi-turn", "--turns", "3", "--num-prompts", "6", "--output-len", "4",
        "--request-rate", "inf",
    )  # fmt: skip
    (run,) = doc["runs"]
    assert run["completed"] == 6
    sent = [engine.prompts[i] for i in engine.started if i not in before]
    # the test request first: a first turn reversed (nothing of it cached for the run)
    assert len(sent) == 7 and sent[0][::-1] in sent[1:]
    prompts = sent[1:]
    # every later turn's prompt is an earlier turn's prompt, its reply (the fake echoes), then more
    firsts = [p for p in prompts if not any(_extends(p, q) for q in prompts)]
    assert len(firsts) == 2
    later = [p for p in prompts if p not in firsts]
    assert all(any(_extends(p, q) for q in prompts) for p in later)


def _extends(prompt: tuple[int, ...], earlier: tuple[int, ...]) -> bool:
    from distpool.api.engine import GenerationArgs

    reply = echo_reply(earlier, GenerationArgs(max_tokens=4))
    history = earlier + tuple(reply)
    return len(prompt) > len(history) and prompt[: len(history)] == history


def test_chat_sends_text_and_counts_the_servers_tokens(text_server, tmp_path):
    url, engine = text_server
    doc = bench(
        url, tmp_path, "--endpoint", "chat", "--dataset", "mixed", "--num-prompts", "4", "--output-len", "5"
    )
    (run,) = doc["runs"]
    assert run["completed"] == 4 and run["total_output_tokens"] == 20, run["errors"]
    # the byte tokenizer counts a token per byte (and <s>): more prompt tokens than words
    assert run["total_input_tokens"] > 4 * 4
    assert run["request_goodput"] is None and run["slo_attainment"] is None  # no SLOs given
    assert doc["config"]["endpoint"] == "chat" and doc["rate_at_attainment"] == {}


def test_flags_the_server_refuses_fail_the_test_request_before_any_run(ids_server, tmp_path, capsys):
    url, _ = ids_server
    argv = [
        "bench",
        "serve",
        "--base-url",
        url,
        "--dataset",
        "random",
        "--input-len",
        "64",
        "--num-prompts",
        "3",
    ]
    assert main([*argv, "--vocab-size", "5000"]) == 2  # ids past the fake model's 260
    err = capsys.readouterr().err
    assert "the test request to" in err and "HTTP 400" in err and "--vocab-size" in err


def test_sharegpt_conversations_go_turn_by_turn_as_chat(text_server, tmp_path):
    url, engine = text_server
    path = tmp_path / "sharegpt.json"
    exchanges = [("first question", "r1"), ("second question", "r2")]
    messages = [
        {"from": side, "value": text} for q, r in exchanges for side, text in (("human", q), ("gpt", r))
    ]
    path.write_text(json.dumps([{"id": "only", "conversations": messages}]))
    before = set(engine.prompts)
    doc = bench(
        url, tmp_path, "--endpoint", "chat", "--dataset", "multi-turn", "--dataset-path", str(path),
        "--output-len", "3", "--num-prompts", "2",
    )  # fmt: skip
    (run,) = doc["runs"]
    assert run["completed"] == 2 and run["failed"] == 0
    texts = [
        bytes(i for i in engine.prompts[r] if i < 256).decode() for r in engine.started if r not in before
    ]
    second = texts[-1]  # the test request, then the two turns
    assert second.index("first question") < second.index("<|assistant|>") < second.index("second question")
    assert "first question" in texts[-2] and "second question" not in texts[-2]
