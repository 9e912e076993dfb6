"""Prometheus metrics: a local cluster started with `ray_init_options` exports what a worker actor and
the driver record as `ray_distpool_*`, about once a second; without Ray, recording is a no-op.

Clusters run in subprocesses, apart from the session cluster of the other serving tests."""

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from distpool.serving.metrics import METRICS_REPORT_INTERVAL_MS, ray_init_options, validate_metrics_port
from transfer.connect.rendezvous import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
ENV.pop("RAY_ADDRESS", None)
FIRST_REPORT_S = 20.0  # from the last record to every series on the endpoint
NEXT_REPORT_S = 5.0  # a later record: a few report intervals, well under Ray's default 10 s

# The cluster: one worker actor and the driver record, then one more completed request per stdin line.
RECORDER = r"""
import sys
import ray
from distpool.serving.metrics import DriverMetrics, ray_init_options
from distpool.worker.metrics import WorkerMetrics
from transfer.wire.failure import FailureKind

ray.init(
    address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
    **ray_init_options(int(sys.argv[1])),
)
try:
    @ray.remote
    class Worker:
        def record(self):
            self.metrics = m = WorkerMetrics("prefill-0", "prefill")
            m.set_usage(pages_used=12, pages_capacity=64, slots_used=1, slots_capacity=8)
            m.add_compactions(2, 4096)
            m.add_compactions(0, 0)
            m.add_transfer(1 << 20, 0.25)
            m.add_transfer(3 << 20, 0.5)
            m.add_failure(FailureKind.TIMEOUT)
            m.add_failure(FailureKind.CORRUPT)
            m.add_failure("sunspots")  # not a failure kind: logged, never raised
            m.add_compactions(-1, 0)  # broken values are logged, never raised
            m.set_usage("many", 0, 0, 0)
            return m.enabled

    worker = Worker.remote()
    assert ray.get(worker.record.remote(), timeout=60)
    driver = DriverMetrics()
    assert driver.enabled
    driver.observe_ttft(0.02)
    driver.observe_ttft(3.0)
    driver.observe_ttft(0.5, "local")
    driver.observe_ttft(0.5, "sideways")  # not a path: logged, never raised
    driver.count("completed", 2)
    driver.count("retried")
    driver.count("lost")  # not an outcome: logged, never raised
    print("recorded", flush=True)
    for _ in sys.stdin:
        driver.count("completed")
        print("recorded", flush=True)
finally:
    ray.shutdown()
"""

WORKER = {"worker": "prefill-0", "role": "prefill"}
EXPECTED = [  # (name, labels, value)
    ("ray_distpool_pages_used", WORKER, 12),
    ("ray_distpool_pages_capacity", WORKER, 64),
    ("ray_distpool_slots_used", WORKER, 1),
    ("ray_distpool_slots_capacity", WORKER, 8),
    ("ray_distpool_compactions_total", WORKER, 2),
    ("ray_distpool_compaction_bytes_total", WORKER, 4096),
    ("ray_distpool_transfer_bytes_total", WORKER, 4 << 20),
    ("ray_distpool_transfer_seconds_total", WORKER, 0.75),
    ("ray_distpool_transfer_failures_total", {**WORKER, "reason": "timeout"}, 1),
    ("ray_distpool_transfer_failures_total", {**WORKER, "reason": "corrupt"}, 1),
    ("ray_distpool_requests_total", {"outcome": "completed"}, 2),
    ("ray_distpool_requests_total", {"outcome": "retried"}, 1),
    ("ray_distpool_ttft_seconds_count", {"path": "remote"}, 2),
    # Ray re-records each bucket count at the bucket's midpoint: the sum is (0.01+0.025)/2 + (2.5+5)/2.
    ("ray_distpool_ttft_seconds_sum", {"path": "remote"}, 3.7675),
    ("ray_distpool_ttft_seconds_bucket", {"path": "remote", "le": "0.025"}, 1),
    ("ray_distpool_ttft_seconds_bucket", {"path": "remote", "le": "5.0"}, 2),
    ("ray_distpool_ttft_seconds_count", {"path": "local"}, 1),
]
SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return ""  # the agent is not serving yet


def value(body: str, name: str, labels: dict[str, str]) -> float | None:
    """The sum of `name`'s samples that carry `labels` (None: no such sample)."""
    found = None
    for line in body.splitlines():
        match = SAMPLE.match(line)
        if match and match[1] == name and labels.items() <= dict(LABEL.findall(match[2] or "")).items():
            found = (found or 0.0) + float(match[3])
    return found


def missing(body: str, expected: list[tuple[str, dict, float]]) -> list[str]:
    return [
        f"{name}{labels}: {value(body, name, labels)} != {want}"
        for name, labels, want in expected
        if value(body, name, labels) != pytest.approx(want)
    ]


def wait_for_metrics(port: int, expected: list, timeout_s: float) -> tuple[str, float]:
    """The first body with every expected sample, and how long it took."""
    started = time.monotonic()
    while True:
        body = scrape(port)
        waited = time.monotonic() - started
        if not missing(body, expected) or waited > timeout_s:
            assert not missing(body, expected), f"after {waited:.1f} s: {missing(body, expected)}"
            return body, waited
        time.sleep(0.2)


@pytest.mark.ray
def test_a_local_cluster_exports_worker_and_driver_metrics_every_second(tmp_path):
    port = free_port()
    validate_metrics_port(port)
    log = tmp_path / "stderr"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", RECORDER, str(port)],
            cwd=ROOT,
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            assert proc.stdout.readline() == "recorded\n", log.read_text()[-3000:]
            body, waited = wait_for_metrics(port, EXPECTED, FIRST_REPORT_S)
            assert "# TYPE ray_distpool_compactions_total counter" in body
            assert "# TYPE ray_distpool_ttft_seconds histogram" in body
            print(f"every series exported {waited:.1f} s after recording")

            proc.stdin.write("one more\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "recorded\n"
            one_more = [("ray_distpool_requests_total", {"outcome": "completed"}, 3)]
            wait_for_metrics(port, one_more, NEXT_REPORT_S)
            wait_for_metrics(port, EXPECTED[:4], 0)  # gauges set once stay exported while their process lives
        finally:
            proc.stdin.close()  # the recorder shuts its cluster down
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.terminate()  # Ray's SIGTERM handler in the driver shuts the cluster down too
                proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert "driver metrics: recording a metric failed" in log.read_text()  # count("lost")


def test_recording_without_ray_is_a_no_op_that_does_not_import_it():
    script = """
import sys
from distpool.serving.metrics import DriverMetrics
from distpool.worker.metrics import WorkerMetrics
from transfer.wire.failure import FailureKind

def record_everything():
    worker, driver = WorkerMetrics("decode-0", "decode"), DriverMetrics()
    worker.set_usage(1, 2, 3, 4)
    worker.add_compactions(-1, 10)
    worker.add_transfer(10, 0.1)
    worker.add_failure(FailureKind.PEER_LOST)
    driver.observe_ttft(0.1)
    driver.count("lost")
    return worker.enabled, driver.enabled

assert record_everything() == (False, False)
assert "ray" not in sys.modules
import ray  # imported, not initialized
assert record_everything() == (False, False)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""  # not even a warning


def test_metrics_options_export_on_the_port_and_report_every_second():
    assert ray_init_options(None) == {}
    assert ray_init_options(9100) == {
        "_metrics_export_port": 9100,
        "_system_config": {"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
    }
    assert METRICS_REPORT_INTERVAL_MS == 1000


@pytest.mark.parametrize("port", [0, 80, 1023, 65536])
def test_a_privileged_or_impossible_metrics_port_is_refused(port):
    with pytest.raises(ValueError, match=f"--metrics-port {port} is outside 1024-65535"):
        validate_metrics_port(port)


def test_a_metrics_port_in_use_is_refused():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(ValueError, match=f"--metrics-port {port} is already in use"):
            validate_metrics_port(port)
    validate_metrics_port(port)  # free again once closed
