"""`distpool serve`: the OpenAI-compatible endpoint as a Ray Serve application over a PD deployment.

    app = serve_application(setup, ApiSettings(...))   # engine deployment + FastAPI ingress
    serve_until_signal(app, ServeRun(...))             # start, print the URL, serve, drain, summary

Two Serve deployments: `distpool-engine` (one replica: the driver and the workers it started, the home
of what the requests share) and `distpool-api` (the ingress; any number of replicas, each with its own
waiting room). Serve's own HTTP proxy answers clients.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ray import serve

from distpool.api.ingress import ApiIngress
from distpool.api.pd_engine import EngineSetup, PdEngine
from distpool.api.settings import ApiSettings

APP_NAME = "distpool"
ENGINE_NAME = "distpool-engine"
# Requests one replica takes at once: Serve's default (5) would queue clients in the proxy, ahead of
# the server's own waiting room and its 503.
MAX_ONGOING_REQUESTS = 4096
READY_TIMEOUT_S = 600.0  # workers start, checkpoints load
DRAIN_GRACE_S = 60.0  # past the drain timeout: cancelled requests let go, leaks read


@dataclass(frozen=True)
class ServeRun:
    """How `serve_until_signal` runs: where it listens and how long a drain may take."""

    host: str = "127.0.0.1"
    port: int = 8000
    drain_timeout_s: float = 30.0
    ingress_replicas: int = 1


def serve_application(setup: EngineSetup, api: ApiSettings, *, ingress_replicas: int = 1):
    """The application: the engine deployment (one replica) bound under the ingress."""
    engine = serve.deployment(
        PdEngine,
        name=ENGINE_NAME,
        num_replicas=1,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
    )
    ingress = ApiIngress.options(
        num_replicas=ingress_replicas,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine.bind(setup), api)


class Stopped(Exception):
    """SIGINT or SIGTERM came before the endpoint answered."""


def wait_until_answering(url: str, timeout_s: float, stop: threading.Event) -> None:
    """Until GET `url` answers 200; TimeoutError after `timeout_s`, Stopped once `stop` is set."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if stop.is_set():
            raise Stopped("stopped before the endpoint answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
                last = f"HTTP {answer.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer within {timeout_s:g} s ({last})")


def ttft_parts_line(parts: dict[str, float]) -> str:
    """Where the served requests' time to first token went (medians, as the driver measured it)."""
    shown = ", ".join(f"{name.replace('_', ' ')} {ms:g}" for name, ms in parts.items() if name != "requests")
    return f"distpool: TTFT p50 parts (ms) over {parts['requests']} served: {shown}"


def summary_line(summary: dict) -> str:
    """The server's last line: what it served, and what its workers still hold (by whom, and in
    which state a decode worker holds its requests) when something leaked."""

    def held(key: str) -> str:
        return "unknown" if summary[key] is None else str(summary[key])

    where = "; ".join(
        f"{name}: {pages} pages, {slots} slots" + (f" by {states}" if states else "")
        for name, (pages, slots, states) in summary["held_by"].items()
    )
    return (
        f"distpool: served {summary['served']}, cancelled {summary['cancelled']}, "
        f"failed {summary['failed']} (retried {summary['retried']}); "
        f"leaked {held('leaked_pages')} pages, {held('leaked_slots')} slots"
        + (f" ({where})" if where else "")
        + (f"; errors: {' | '.join(summary['errors'])}" if summary["failed"] else "")
    )


def serve_until_signal(app, run: ServeRun, served_name: str) -> int:
    """Serve `app` on Ray Serve until SIGINT or SIGTERM; then drain (up to `run.drain_timeout_s`),
    print the one-line summary and return the exit status: 0, or 1 when memory leaked (or could not
    be read). Ray must be initialised."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": run.host, "port": run.port})
        print("distpool: starting the workers ...", flush=True)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        base = f"http://{run.host}:{run.port}"
        wait_until_answering(f"{base}/health", READY_TIMEOUT_S, stop)
        print(f"distpool: serving {served_name!r} at {base}/v1 (Ctrl-C or SIGTERM to stop)", flush=True)
        while not stop.wait(1.0):
            pass
        print(f"distpool: draining (up to {run.drain_timeout_s:g} s) ...", flush=True)
        engine = serve.get_deployment_handle(ENGINE_NAME, app_name=APP_NAME)
        summary = engine.drain.remote(run.drain_timeout_s).result(
            timeout_s=run.drain_timeout_s + DRAIN_GRACE_S
        )
        engine.stop_workers.remote().result(timeout_s=DRAIN_GRACE_S)
    finally:
        try:
            serve.shutdown()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print(ttft_parts_line(summary["ttft_parts_ms"]), flush=True)
    print(summary_line(summary), flush=True)
    return 0 if summary["leaked_pages"] == 0 and summary["leaked_slots"] == 0 else 1
