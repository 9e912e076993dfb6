"""The driver's Prometheus metrics, and the options that make an embedded Ray cluster export them.

Ray's metrics agent (the dashboard agent every raylet starts, also with `include_dashboard=False`;
with a minimal `ray` install instead of `ray[default]` it exports nothing) serves what every process
of its node records with `ray.util.metrics`, at http://<node>:<metrics export port>/metrics, each
name prefixed `ray_`. A cluster started with `ray start` exports on a random port per node unless
given `--metrics-export-port` (`ray.nodes()` lists it as `MetricsExportPort`); the head's dashboard
writes every node's address to Prometheus' file-based service discovery in
/tmp/ray/session_latest/prom_metrics_service_discovery.json (under `--temp-dir` if set), every 5 s.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from distpool.worker.metrics import LoggedOnce, increment, ray_is_running

# Ray reports metrics every 10 s by default; a run lasts seconds to minutes, so report every second
# (Ray's floor: `max(metrics_report_interval_ms, 1000)`).
METRICS_REPORT_INTERVAL_MS = 1000
# Time to first token, from 1 ms (a cached prefix on a GPU) to a minute (a queue that never drains).
TTFT_BOUNDARIES_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = ("completed", "failed", "corrupt", "retried", "cancelled")
# Seconds between two streamed deltas of a request, from 1 ms to 10 s.
ITL_BOUNDARIES_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
# Seconds from submitting a request to its last token: up to ten minutes.
E2E_BOUNDARIES_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PATHS = ("remote", "local")  # where a request was prefilled (`Outcome.path`)
MIN_PORT, MAX_PORT = 1024, 65535


def ray_init_options(metrics_port: int | None) -> dict[str, Any]:
    """The extra `ray.init` keyword arguments for an embedded local cluster that exports metrics at
    http://127.0.0.1:`metrics_port`/metrics, reported about once a second ({} for None). Only for a
    cluster `ray.init` starts: attaching to a running one refuses `_system_config`."""
    if metrics_port is None:
        return {}
    return {
        "_metrics_export_port": metrics_port,
        "_system_config": {"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
    }


def validate_metrics_port(port: int) -> None:
    """Raises ValueError unless `port` is unprivileged and free. Ray's own failure on a taken port
    is a startup timeout that does not name the port, half a minute later."""
    if not MIN_PORT <= port <= MAX_PORT:
        raise ValueError(
            f"--metrics-port {port} is outside {MIN_PORT}-{MAX_PORT}; pick an unprivileged port such as 9100"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As Prometheus' HTTP server binds: reusing a port whose last connections linger is fine.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            # Every interface: Ray binds loopback on a loopback node, and every interface otherwise.
            probe.bind(("", port))
        except OSError as exc:
            raise ValueError(
                f"--metrics-port {port} is already in use on this machine ({exc.strerror}); "
                "pick another port or stop what listens there"
            ) from None


@dataclass(frozen=True)
class _DriverInstruments:
    ttft: Any  # ray.util.metrics.Histogram
    requests: Any  # ray.util.metrics.Counter, tagged by `outcome`
    stream_ttft: Any  # Histograms of what a streaming caller sees (online serving)
    itl: Any
    e2e: Any
    running: Any  # ray.util.metrics.Gauge: requests in the pipeline
    waiting: Any  # and submitted, waiting for room in it

    @classmethod
    def build(cls) -> _DriverInstruments:
        from ray.util.metrics import Counter, Gauge, Histogram

        return cls(
            stream_ttft=Histogram(
                "distpool_stream_ttft_seconds",
                "Seconds from a streamed request's arrival to its first token handed to its caller.",
                list(TTFT_BOUNDARIES_S),
            ),
            itl=Histogram(
                "distpool_itl_seconds",
                "Seconds between two token deltas handed to a streaming caller (inter-token latency).",
                list(ITL_BOUNDARIES_S),
            ),
            e2e=Histogram(
                "distpool_e2e_seconds",
                "Seconds from a streamed request's arrival to its last token handed to its caller.",
                list(E2E_BOUNDARIES_S),
            ),
            running=Gauge("distpool_requests_running", "Requests in the pipeline (prefill to last token)."),
            waiting=Gauge(
                "distpool_requests_waiting", "Requests submitted, waiting for room in the pipeline."
            ),
            ttft=Histogram(
                "distpool_ttft_seconds",
                "Seconds from submitting a request to its first token, by the path it took.",
                list(TTFT_BOUNDARIES_S),
                ("path",),
            ),
            requests=Counter("distpool_requests_total", "Requests, by outcome.", ("outcome",)),
        )


class DriverMetrics:
    """What the driver records: time to first token, and requests by outcome (one of OUTCOMES).

    Best effort like the workers' (`distpool.worker.metrics`): never raises, a no-op without Ray.
    """

    def __init__(self) -> None:
        self._errors = LoggedOnce("driver metrics")
        self._instruments: _DriverInstruments | None = None
        if ray_is_running():
            with self._errors.guard():
                self._instruments = _DriverInstruments.build()

    @property
    def enabled(self) -> bool:
        """Whether records reach Ray's exporter (False: every method is a no-op)."""
        return self._instruments is not None

    def observe_ttft(self, seconds: float, path: str = "remote") -> None:
        """A completed request's TTFT; `path`: "remote" (prefilled on a prefill worker and
        transferred) or "local" (prefilled on decode, `serving.routing.conditional`)."""
        if (m := self._instruments) is None:
            return
        with self._errors.guard():
            if path not in PATHS:
                raise ValueError(f"request path {path!r} is not one of {', '.join(PATHS)}")
            m.ttft.observe(float(seconds), {"path": path})

    def count(self, outcome: str, n: int = 1) -> None:
        """`n` more requests ended with (or, for "retried", went through) `outcome`."""
        if (m := self._instruments) is None:
            return
        with self._errors.guard():
            if outcome not in OUTCOMES:
                raise ValueError(f"request outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
            increment(m.requests, n, {"outcome": outcome})

    def observe_stream(self, ttft_s: float | None, gaps_s: list[float], e2e_s: float) -> None:
        """A streamed request as its caller saw it: first token, gaps between deltas, last token."""
        if (m := self._instruments) is None:
            return
        with self._errors.guard():
            if ttft_s is not None:
                m.stream_ttft.observe(float(ttft_s))
            for gap in gaps_s:
                m.itl.observe(float(gap))
            m.e2e.observe(float(e2e_s))

    def set_load(self, running: int, waiting: int) -> None:
        """Requests in the pipeline and waiting for it, now."""
        if (m := self._instruments) is None:
            return
        with self._errors.guard():
            m.running.set(running)
            m.waiting.set(waiting)
