"""Bad flags of `distpool bench serve` end with exit status 2 and a message naming the flag and the
fix, before any server is launched or called."""

from __future__ import annotations

import sys

import pytest

from distpool.bench.launch import free_port
from distpool.cli import main

URL = ["--base-url", "http://127.0.0.1:9"]  # never called: each case is refused before


def refused(capsys, *argv: str) -> str:
    """The stderr of a refusal: argparse's SystemExit(2), or the handler's ValueError (status 2)."""
    try:
        status = main(["bench", "serve", *argv])
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*URL, "--request-rate", "0"], "--request-rate: must be > 0"),
        ([*URL, "--request-rate", "1,x"], "--request-rate: must be a number"),
        ([*URL, "--request-rate", "2,2"], "names a rate twice"),
        ([*URL, "--burstiness", "-1"], "--burstiness: must be > 0"),
        ([*URL, "--goodput", "latency:5"], "KEY one of ttft, tpot, e2el"),
        ([*URL, "--goodput", "ttft:0"], "--goodput: must be > 0"),
        ([*URL, "--percentiles", "0,50"], "each percentile must be in (0, 100]"),
        ([*URL, "--num-prompts", "0"], "--num-prompts: must be a whole number >= 1"),
        ([*URL, "--seed", "-3"], "--seed: must be a whole number >= 0"),
        ([*URL, "--endpoint", "embeddings"], "invalid choice"),
        ([*URL, "--launch", "--decode 2"], "not allowed with argument"),
        ([], "one of the arguments --base-url --launch --compare is required"),
        (["--base-url", "127.0.0.1:8000"], "--base-url must start with http:// or https://"),
        ([*URL, "--launch-args", "--model x"], "--base-url launches none"),
        (["--launch", "--decode 2 --port 8000"], "--port is chosen by the benchmark"),
        (["--compare", "pd:--prefill 1 --decode 1", "colocated:--prefill 0 --decode 2"], "--goodput ttft:"),
        (["--compare", "--prefill 1 --decode 1", "--goodput", "ttft:9"], "NAME:DEPLOYMENT_FLAGS"),
        (["--compare", "a:--decode 1", "a:--decode 2", "--goodput", "ttft:9"], "names 'a' twice"),
        ([*URL, "--goodput", "ttft:9", "--slo-from-unloaded", "3"], "give one of them"),
        ([*URL, "--slo-from-unloaded", "0"], "--slo-from-unloaded: must be > 0"),
        ([*URL, "--dataset", "sharegpt"], "--dataset sharegpt reads --dataset-path"),
        ([*URL, "--dataset-path", "x.json"], "Fix: drop --dataset-path"),
        ([*URL, "--input-len", "8"], "Fix: drop --input-len, or use --dataset random"),
        ([*URL, "--json", "/no/such/folder/out.json"], "its folder does not exist"),
    ],
)
def test_bad_flags_are_refused_with_the_fix(capsys, argv, message):
    assert message in refused(capsys, *argv)


def test_plot_without_matplotlib_says_how_to_get_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert "pip install 'distpool[bench]'" in refused(capsys, *URL, "--plot", "out.png")


def test_a_server_that_does_not_answer_is_named(capsys):
    err = refused(capsys, "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1")
    assert "/v1/models failed" in err and "is the server up" in err
