"""`distpool serve`: the deployment `run` would start, behind an OpenAI-compatible endpoint on Ray Serve
(`distpool.api.serve_app`), until SIGINT or SIGTERM. `app_builder` gives the same application to
`serve run` / `serve deploy` of a config (README, "Online serving").
"""

from __future__ import annotations

import argparse
import shlex
import socket
from pathlib import Path

from distpool.api.settings import ApiSettings
from distpool.cli.commands import DeploymentPlan, plan_deployment
from distpool.settings import Settings
from transfer.faults import SENDER_ABORT

# `run` flags that shape its batch workload or its report: a server takes its requests over HTTP.
RUN_ONLY = {
    "requests": "--requests",
    "workload": "--workload",
    "turns": "--turns",
    "prompts": "--prompts",
    "min_prompt_len": "--min-prompt-len",
    "max_prompt_len": "--max-prompt-len",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "ignore_eos": "--ignore-eos",
    "parity_sample": "--parity-sample",
    "json": "--json",
    "outputs": "--outputs",
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, beside every deployment flag of `run` (whose workload flags are hidden
    here, and refused)."""
    for action in parser._actions:
        if action.dest in RUN_ONLY:
            action.help = argparse.SUPPRESS
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: its folder's)"
    )
    parser.add_argument(
        "--api-key", default=None, help="bearer token every /v1 call must carry (or DISTPOOL_API_KEY)"
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=ApiSettings.max_waiting_requests,
        help="requests waiting for their first token beyond which new ones get 503 "
        f"({ApiSettings.max_waiting_requests})",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may finish after SIGINT/SIGTERM before they are cancelled (30)",
    )
    parser.add_argument(
        "--ingress-replicas", type=int, default=1, help="replicas of the HTTP ingress (1; README)"
    )


def refuse_run_only(ns: argparse.Namespace, defaults: argparse.Namespace) -> None:
    for dest, flag in RUN_ONLY.items():
        if getattr(ns, dest) != getattr(defaults, dest):
            raise ValueError(
                f"{flag} shapes `distpool run`'s batch workload; `distpool serve` takes its requests "
                f"over HTTP, each with its own parameters. Fix: drop {flag}"
            )


def served_name_of(ns: argparse.Namespace, plan: DeploymentPlan) -> str:
    """--served-model-name, else the checkpoint folder's name, else the preset's or config's."""
    if ns.served_model_name:
        return ns.served_model_name
    if plan.model_folder is not None:
        return plan.model_folder.name
    return Path(ns.model).stem if ns.model.endswith(".json") else ns.model


def check_port_free(host: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be 1-65535; got {port}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(
                f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pick another port"
            ) from None


def engine_setup(ns: argparse.Namespace, plan: DeploymentPlan, name: str):
    """The engine deployment's `EngineSetup` from the flags and their checked plan."""
    from distpool.api.pd_engine import EngineSetup
    from distpool.model_impl.hf.tokenizer import holds_tokenizer
    from distpool.serving.path import ServeOptions

    folder = str(plan.model_folder) if holds_tokenizer(plan.config_path) else None
    options = ServeOptions(
        faults={SENDER_ABORT: ns.fault_rate},
        seed=ns.seed,
        progress=False,
        overlap_reservation=not ns.reserve_first,
        conditional=plan.conditional,
    )
    return EngineSetup(plan.spec, options, name, folder)


def build(ns: argparse.Namespace, defaults: argparse.Namespace):
    """(the application, its plan, the served name, the API settings) from parsed flags, checked."""
    from distpool.api.serve_app import serve_application

    refuse_run_only(ns, defaults)
    if ns.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds; got {ns.drain_timeout}")
    if ns.ingress_replicas < 1:
        raise ValueError(f"--ingress-replicas must be >= 1; got {ns.ingress_replicas}")
    try:
        api = ApiSettings(
            api_key=ns.api_key or Settings.from_env().api_key, max_waiting_requests=ns.max_waiting_requests
        )
    except ValueError as exc:
        raise ValueError(f"--max-waiting-requests / --api-key: {exc}") from None
    plan = plan_deployment(ns, {})
    name = served_name_of(ns, plan)
    setup = engine_setup(ns, plan, name)
    return serve_application(setup, api, ingress_replicas=ns.ingress_replicas), plan, name, api


def cmd_serve(ns: argparse.Namespace, defaults: argparse.Namespace) -> int:
    import ray

    from distpool.api.serve_app import ServeRun, serve_until_signal
    from distpool.serving.job import start_ray

    app, plan, name, _ = build(ns, defaults)
    if not plan.address:
        check_port_free(ns.host, ns.port)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        start_ray(plan.spec, plan.address, ns.num_cpus, ns.metrics_port)
    try:
        run = ServeRun(ns.host, ns.port, ns.drain_timeout, ns.ingress_replicas)
        return serve_until_signal(app, run, name)
    finally:
        if owns_ray:
            ray.shutdown()


def app_builder(args: dict):
    """For `serve run` / `serve deploy`: the application of `distpool serve` FLAGS, given as the
    config's `args: {flags: "--model DIR --prefill 1 --decode 1"}` (host and port are Serve's)."""
    from distpool.cli import build_parser

    flags = args.get("flags", "")
    argv = ["serve", *(shlex.split(flags) if isinstance(flags, str) else [str(f) for f in flags])]
    parser = build_parser()
    ns, defaults = parser.parse_args(argv), parser.parse_args(["serve"])
    return build(ns, defaults)[0]
