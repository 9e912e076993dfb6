"""The main job on real Ray clusters: a submitted Ray job, and two nodes with prefill and decode apart.

Each test starts its own cluster in separate processes and stops exactly that cluster."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from transfer.connect.rendezvous import free_port

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
ENV.pop("RAY_ADDRESS", None)
SMALL_RUN = ["--requests", "6", "--max-new-tokens", "4", "--max-prompt-len", "24", "--memory-gib", "0.05"]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def stop_cluster(head: subprocess.Popen, temp_dir: str) -> None:
    """Stop exactly the cluster this test started: its process group, then any process of its session."""
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=15)
    subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)  # every one of its processes names it
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_the_main_job():
    # Every port this head listens on is picked free: the session cluster of the other serving tests
    # already holds the defaults (the dashboard agent's 52365 among them).
    gcs_port, dashboard_port, agent_port, client_port = (free_port() for _ in range(4))
    temp_dir = tempfile.mkdtemp(prefix="dpray", dir="/tmp")  # short: Ray's socket paths have a length limit
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            f"--port={gcs_port}",
            "--num-cpus=4",
            "--include-dashboard=true",
            f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={agent_port}",
            f"--ray-client-server-port={client_port}",
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={temp_dir}",
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    try:

        def ready() -> bool:
            probe = [RAY, "job", "list", "--address", address]
            return subprocess.run(probe, env=ENV, capture_output=True).returncode == 0

        wait_for(ready, 90, "the Ray head's job server")
        submit = [RAY, "job", "submit", "--address", address, "--working-dir", str(ROOT), "--"]
        submit += [sys.executable, "-m", "distpool", "run", *SMALL_RUN]
        for _ in range(30):  # the job agent comes up a little after the job server answers
            proc = subprocess.run(submit, env=ENV, capture_output=True, text=True, timeout=240, cwd=ROOT)
            if "No available agent" not in proc.stdout + proc.stderr:
                break
            time.sleep(2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "distpool PD run summary" in proc.stdout
        assert "succeeded" in proc.stdout
    finally:
        stop_cluster(head, temp_dir)


def test_two_nodes_put_prefill_and_decode_on_different_nodes(tmp_path):
    script = f"""
import json, subprocess, sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 2}})
cluster.add_node(num_cpus=2)
cluster.wait_for_nodes()
try:
    proc = subprocess.run([sys.executable, "-m", "distpool", "run", "--address", cluster.address, "--spread",
                           "--json", {str(tmp_path / "run.json")!r}, *{SMALL_RUN!r}],
                          capture_output=True, text=True, timeout=240)
    print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
    sys.exit(proc.returncode)
finally:
    cluster.shutdown()
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["completed"] == report["requests"] == 6
    nodes = {w["name"]: w["node_id"] for w in report["workers"]}
    assert nodes["prefill-0"] != nodes["decode-0"]
