"""`distpool bench serve`: one seeded workload served at each request rate by one endpoint (or by each
deployment of --compare in turn), the figures printed per run, side by side, and written as JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from distpool.bench.arrivals import arrival_offsets
from distpool.bench.attainment import TARGET_ATTAINMENT, rate_at_attainment
from distpool.bench.datasets import DatasetArgs, build_sessions
from distpool.bench.launch import LaunchError, deployment_flags, launched_server
from distpool.bench.metrics import run_figures
from distpool.bench.plot import plot_runs, require_matplotlib
from distpool.bench.report import format_run, format_side_by_side
from distpool.bench.runner import Target, probe_request, run_at_rate
from distpool.bench.sessions import Session, num_requests
from distpool.bench.unloaded import UnloadedSlos, measure_unloaded_slos

ENDPOINT_NAME = "endpoint"  # the one deployment of --base-url or --launch


def note(line: str) -> None:
    """Progress, on stderr: stdout holds the results."""
    print(line, file=sys.stderr, flush=True)


def cmd_bench(ns: argparse.Namespace) -> int:
    """Exit 0 when every run ran (failed requests are figures, not errors); 1 when a launched server
    would not start or stop cleanly; ValueError (exit 2) for bad flags, before anything starts, or
    for a test request the server refuses, before any run."""
    deployments = deployments_from(ns)
    dataset = DatasetArgs(
        dataset=ns.dataset,
        num_prompts=ns.num_prompts,
        seed=ns.seed,
        vocab_size=ns.vocab_size,
        input_len=ns.input_len,
        output_len=ns.output_len,
        dataset_path=ns.dataset_path,
        turns=ns.turns,
    )
    if ns.plot is not None:
        require_matplotlib()
    for path in (ns.json, ns.plot):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{path}: its folder does not exist; create it or write elsewhere")
    if ns.slo_from_unloaded is not None and ns.goodput:
        raise ValueError("--slo-from-unloaded chooses the SLOs that --goodput gives; give one of them")
    slos = dict(ns.goodput)
    unloaded: UnloadedSlos | None = None
    runs: dict[str, dict[float, dict]] = {}
    # a file's sessions do not depend on the server: read (and checked) before any is launched
    sessions: list[Session] | None = build_sessions(dataset, None) if ns.dataset_path else None
    try:
        for name, flags in deployments.items():
            with _endpoint(ns, flags) as base_url:
                model, context_len = _model_of(base_url, ns.model, ns.api_key)
                if sessions is None:  # one workload for every deployment, within the first's context
                    sessions = build_sessions(dataset, context_len)
                if not runs:
                    print(
                        f"workload: {ns.dataset}, {len(sessions)} sessions, {num_requests(sessions)} requests"
                    )
                target = Target(
                    base_url, ns.endpoint, model, ns.api_key, ns.max_concurrency, ns.request_timeout
                )
                probe = probe_request(target, sessions[0])
                if not probe.success:
                    raise ValueError(
                        f"the test request to {base_url} failed ({probe.error}). Fix: check --endpoint, "
                        "--model, --vocab-size and the dataset's lengths against the server"
                    )
                if ns.slo_from_unloaded is not None and unloaded is None:
                    unloaded = measure_unloaded_slos(target, sessions, ns.slo_from_unloaded)
                    slos = unloaded.slos_ms
                    print(f"{name}: {unloaded.describe()}", flush=True)
                runs[name] = {}
                for rate in ns.request_rate:
                    offsets = arrival_offsets(len(sessions), rate, ns.burstiness, ns.seed)
                    note(f"{name} at {rate:g} req/s: {len(sessions)} arrivals over {offsets[-1]:.0f} s")
                    run = run_at_rate(target, sessions, offsets)
                    figures = run_figures(run.results, run.duration_s, ns.percentiles, slos)
                    runs[name][rate] = figures
                    print(format_run(f"{name} at {rate:g} req/s", figures, ns.percentiles), flush=True)
    except LaunchError as exc:
        print(f"distpool bench serve: {exc}", file=sys.stderr)
        return 1
    at_target = _rates_at_target(runs, slos)
    if len(runs) > 1:
        print(format_side_by_side(runs))
    for name, found in at_target.items():
        print(f"{name}: highest rate at {TARGET_ATTAINMENT:.0%} SLO attainment: {found.describe()}")
    if ns.json is not None:
        document = _document(ns, deployments, runs, at_target, slos, unloaded)
        Path(ns.json).write_text(json.dumps(document, indent=2) + "\n")
    if ns.plot is not None:
        plot_runs(runs, ns.plot, f"{ns.dataset}, SLOs {_slo_words(slos) or 'none'}")
    return 0


def deployments_from(ns: argparse.Namespace) -> dict[str, list[str] | None]:
    """Deployment name -> its launch flags (None: --base-url, measured as it is)."""
    if ns.launch_args and ns.base_url is not None:
        raise ValueError(
            "--launch-args are flags of a launched server; --base-url launches none. Fix: drop one"
        )
    if ns.base_url is not None:
        if not ns.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://; got {ns.base_url!r}")
        return {ENDPOINT_NAME: None}
    if ns.launch is not None:
        return {ENDPOINT_NAME: deployment_flags(ns.launch_args, ns.launch)}
    if not ns.goodput and ns.slo_from_unloaded is None:
        raise ValueError(
            "--compare finds each deployment's highest rate meeting the SLOs: give them, e.g. "
            "--goodput ttft:2000 tpot:200, or --slo-from-unloaded 3"
        )
    deployments: dict[str, list[str] | None] = {}
    for spec in ns.compare:
        name, sep, flags = spec.partition(":")
        if not sep or not name.strip():
            raise ValueError(
                f'--compare takes NAME:DEPLOYMENT_FLAGS (e.g. "pd:--prefill 1 --decode 1"); got {spec!r}'
            )
        if name in deployments:
            raise ValueError(f"--compare names {name!r} twice; give each deployment its own name")
        deployments[name] = deployment_flags(ns.launch_args, flags)
    return deployments


@contextlib.contextmanager
def _endpoint(ns: argparse.Namespace, flags: list[str] | None) -> Iterator[str]:
    if flags is None:
        yield ns.base_url.rstrip("/")
        return
    with launched_server(flags, start_timeout_s=ns.launch_timeout, progress=note) as base_url:
        yield base_url


def _model_of(base_url: str, model: str | None, api_key: str | None) -> tuple[str, int | None]:
    """The model to ask for (--model, else the first /v1/models lists) and the server's context."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
        response.raise_for_status()
        listed = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"GET {base_url}/v1/models failed ({exc}); is the server up at --base-url?"
        ) from None
    entry = next((m for m in listed if model in (None, m.get("id"))), None)
    if entry is None and model is None:
        raise ValueError(f"{base_url}/v1/models lists no model; give --model")
    context = entry.get("max_model_len") if entry else None
    return (model or entry["id"]), (context if isinstance(context, int) else None)


def _rates_at_target(runs: dict[str, dict[float, dict]], slos: dict[str, float]) -> dict:
    if not slos:
        return {}
    found = {}
    for name, by_rate in runs.items():
        points = [(rate, f["slo_attainment"]) for rate, f in by_rate.items() if math.isfinite(rate)]
        if points:
            found[name] = rate_at_attainment(points)
    return found


def _slo_words(slos: dict[str, float]) -> str:
    return " ".join(f"{key}:{ms:g}ms" for key, ms in slos.items())


def _document(
    ns: argparse.Namespace,
    deployments: dict[str, list[str] | None],
    runs: dict[str, dict[float, dict]],
    at_target: dict,
    slos: dict[str, float],
    unloaded: UnloadedSlos | None,
) -> dict:
    config = {
        key: getattr(ns, key)
        for key in (
            "endpoint", "model", "dataset", "dataset_path", "num_prompts", "seed", "burstiness",
            "max_concurrency", "input_len", "output_len", "percentiles", "launch_args",
        )
    }  # fmt: skip
    config["goodput"] = slos
    # the rule that chose them: K x the first deployment's unloaded medians (None: --goodput's)
    config["slo_from_unloaded"] = (
        None
        if unloaded is None
        else {
            "k": unloaded.k,
            "deployment": next(iter(deployments)),
            "requests": unloaded.requests,
            "median_ttft_ms": unloaded.median_ttft_ms,
            "median_tpot_ms": unloaded.median_tpot_ms,
        }
    )
    config["request_rate"] = [_rate_json(r) for r in ns.request_rate]
    # what each deployment was: the flags it was launched with, or the URL measured
    config["deployments"] = {
        name: ns.base_url if flags is None else flags for name, flags in deployments.items()
    }
    return {
        "config": config,
        "runs": [
            {"deployment": name, "request_rate": _rate_json(rate), **figures}
            for name, by_rate in runs.items()
            for rate, figures in by_rate.items()
        ],
        "rate_at_attainment": {
            name: {
                "target": f.target,
                "rate": f.rate,
                "kind": f.kind,
                "measured": [list(p) for p in f.measured],
            }
            for name, f in at_target.items()
        },
    }


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate
