"""The flags of `distpool bench serve`: their types, defaults and help. Each value is checked as it
is parsed (exit 2 naming the flag); combinations are checked by `distpool.bench.command`."""

from __future__ import annotations

import argparse
import math

from distpool.bench.client import ENDPOINTS
from distpool.bench.datasets import DATASETS, DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN
from distpool.bench.metrics import SLO_KEYS
from distpool.bench.unloaded import UNLOADED_REQUESTS
from distpool.serving.workloads import DEFAULT_TURNS

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
# Token ids of completions prompts are drawn from [0, 96): the bundled reference models' vocabulary,
# the smallest distpool ships, so the ids are valid for every preset (a server states no vocabulary).
DEFAULT_VOCAB_SIZE = 96


def _positive_int(value: str) -> int:
    if not value.isdecimal() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {value!r}")
    return int(value)


def _seed(value: str) -> int:
    if not value.isdecimal():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0; got {value!r}")
    return int(value)


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {value!r}") from None
    if not number > 0 or math.isnan(number):
        raise argparse.ArgumentTypeError(f"must be > 0; got {value!r}")
    return number


def parse_rates(value: str) -> list[float]:
    """`1,2,4,inf`: requests per second, each > 0 (inf: every request at once), none twice."""
    rates = [_positive_float(part.strip()) for part in value.split(",")]
    if len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"names a rate twice: {value!r}")
    return rates


def parse_slo(value: str) -> tuple[str, float]:
    """`ttft:500`: an SLO in milliseconds on TTFT, TPOT or E2EL."""
    key, sep, ms = value.partition(":")
    if not sep or key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(
            f"an SLO is KEY:MS with KEY one of {', '.join(SLO_KEYS)} (e.g. ttft:500); got {value!r}"
        )
    return key, _positive_float(ms)


def parse_percentiles(value: str) -> list[float]:
    """`50,90,99`: percentiles in (0, 100]."""
    try:
        percentiles = [float(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be numbers separated by commas (50,90,99); got {value!r}"
        ) from None
    if not all(0 < p <= 100 for p in percentiles):
        raise argparse.ArgumentTypeError(f"each percentile must be in (0, 100]; got {value!r}")
    return sorted(set(percentiles))


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve",
        help="requests arriving at rates, streamed and timed at the client: vLLM's serving figures, goodput",
        description="Sends a seeded workload to an OpenAI-compatible endpoint at each --request-rate and "
        "prints vLLM's serving figures per rate (TTFT, TPOT, ITL, E2EL, throughputs, goodput).",
    )
    target = serve.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="the endpoint to measure, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--launch",
        metavar="DEPLOYMENT_FLAGS",
        help="start `distpool serve DEPLOYMENT_FLAGS` on a free port, measure it, stop it "
        '(one quoted string, e.g. --launch "--prefill 1 --decode 1")',
    )
    target.add_argument(
        "--compare",
        nargs="+",
        metavar="NAME:DEPLOYMENT_FLAGS",
        help='launch each deployment in turn and serve each the same workload, e.g. "pd:--prefill 1 '
        '--decode 1" "colocated:--prefill 0 --decode 2"; needs --goodput',
    )
    serve.add_argument(
        "--launch-args",
        default="",
        metavar="FLAGS",
        help="flags every launched deployment gets (e.g. --model)",
    )
    serve.add_argument(
        "--launch-timeout",
        type=_positive_float,
        default=900.0,
        help="seconds a launched server has to answer",
    )
    serve.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    serve.add_argument("--model", default=None, help="the requests' model (default: the first of /v1/models)")
    serve.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    serve.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[math.inf],
        metavar="R[,R...]",
        help="requests per second, a run per rate (inf: all at once; multi-turn: conversations per second)",
    )
    serve.add_argument(
        "--burstiness", type=_positive_float, default=1.0, help="gamma shape of the gaps (1: Poisson)"
    )
    serve.add_argument(
        "--max-concurrency", type=_positive_int, default=None, help="requests in flight at most"
    )
    serve.add_argument(
        "--num-prompts", type=_positive_int, default=100, help="requests per run (multi-turn: turns in all)"
    )
    serve.add_argument("--seed", type=_seed, default=0, help="the workload's and the arrivals'")
    serve.add_argument(
        "--dataset",
        choices=list(DATASETS),
        default="mixed",
        help="; ".join(f"{k}: {v}" for k, v in DATASETS.items()).replace("%", "%%"),
    )
    serve.add_argument("--dataset-path", default=None, help="a ShareGPT-format JSON file")
    serve.add_argument(
        "--input-len", type=_positive_int, default=None, help=f"random's prompt tokens ({DEFAULT_INPUT_LEN})"
    )
    serve.add_argument(
        "--output-len",
        type=_positive_int,
        default=None,
        help=f"tokens asked of each request, EOS ignored ({DEFAULT_OUTPUT_LEN}; sharegpt: its reply's)",
    )
    serve.add_argument("--turns", type=_positive_int, default=DEFAULT_TURNS, help="multi-turn: turns each")
    serve.add_argument(
        "--vocab-size",
        type=_positive_int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"token-id prompts draw ids from [0, N) ({DEFAULT_VOCAB_SIZE})",
    )
    serve.add_argument(
        "--goodput",
        nargs="+",
        type=parse_slo,
        default=[],
        metavar="KEY:MS",
        help="SLOs in ms (ttft, tpot, e2el): goodput and SLO attainment count requests meeting all",
    )
    serve.add_argument(
        "--slo-from-unloaded",
        type=_positive_float,
        default=None,
        metavar="K",
        help="instead of --goodput: before the rated runs the first deployment serves "
        f"{UNLOADED_REQUESTS} of the workload's requests (prompts reversed) one at a time, and the SLOs "
        "are K x their median TTFT and K x their median TPOT, for every deployment (e.g. 3)",
    )
    serve.add_argument(
        "--percentiles", type=parse_percentiles, default=list(DEFAULT_PERCENTILES), metavar="P[,P...]"
    )
    serve.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds a request may wait for its next chunk",
    )
    serve.add_argument("--json", default=None, metavar="PATH", help="write every run's figures as JSON")
    serve.add_argument("--plot", default=None, metavar="PNG", help="TTFT, TPOT and attainment against rate")
    return serve
