"""PD serving with the synthetic cache: real-size configs run end to end, every envelope verified,
the summary reports link utilization and the TTFT breakdown, and `--metrics-port` serves metrics
while the run lasts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from distpool.memory.sizing import PoolArgs, size_pools
from distpool.model.hf_config import spec_from_hf
from distpool.serving.deploy.deployment import DeploymentSpec
from distpool.serving.job.main import exit_status, run
from distpool.serving.summary.parity import colocated_tokens
from distpool.worker.config import WorkerConfig
from distpool.worker.stats import DecodeStats
from tests.factories import FIXTURES, make_spec
from tests.serving.helpers import mixed_requests
from transfer import TransferOptions
from transfer.connect.rendezvous import free_port

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
TTFT_PARTS = {"queue", "reserve", "prefill", "transfer", "first_token"}


def synthetic_spec(**counts) -> DeploymentSpec:
    spec = make_spec(num_layers=6, kv_heads=2, head_dim=32, conv_shape=(3, 256), ssm_shape=(8, 32, 64))
    worker = WorkerConfig(
        spec=spec,
        pool_args=PoolArgs(page_size=16, context_len=512),
        budget_bytes=32 << 20,
        transfer=TransferOptions(timeout_s=10),
        model_impl="synthetic",
    )
    return DeploymentSpec.build(worker, **counts)


def test_run_reports_verification_link_utilization_and_ttft_parts(ray_session, tmp_path):
    spec = synthetic_spec(num_prefill=1, num_decode=2)
    requests = mixed_requests(12, max_new_tokens=5, max_prompt=300)
    path = tmp_path / "deep" / "run.json"
    status = run(spec, requests, address=None, parity_sample=3, json_path=str(path))
    report = json.loads(path.read_text())
    assert status == exit_status(report) == 0, report["errors"]
    assert report["model_impl"] == "synthetic"
    assert report["completed"] == 12 and report["verified_envelopes"] >= 12
    assert report["corrupt_envelopes"] == 0 and report["parity_mismatches"] == 0
    slot = size_pools(spec.worker.spec, spec.worker.for_role("decode"), spec.worker.budget_bytes).slot_bytes
    assert (
        report["transfer_bytes_p50"] >= slot and report["transfer_bytes_max"] >= report["transfer_bytes_p50"]
    )
    assert 1 <= report["runs_per_envelope_p50"] <= report["runs_per_envelope_max"]
    assert report["link_gbps"] > 0 and report["link_utilization"] > 0
    assert report["link_message_bytes"] == int(report["transfer_bytes_p50"])
    assert {link["channel"] for link in report["links"]} <= {"prefill-0->decode-0", "prefill-0->decode-1"}
    assert set(report["ttft_breakdown_ms"]) == TTFT_PARTS
    parts_p50 = sum(v["p50"] for v in report["ttft_breakdown_ms"].values())
    assert report["ttft_breakdown_ms"]["transfer"]["p50"] > 0 and parts_p50 > 0
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)


def test_synthetic_tokens_are_the_colocated_ones(ray_session):
    from tests.serving.helpers import serve

    spec = synthetic_spec()
    requests = mixed_requests(6, max_new_tokens=4, seed=2, max_prompt=100)
    outcomes, stats, _ = serve(spec, requests)
    assert {o.request_id: o.tokens for o in outcomes} == colocated_tokens(spec, requests)
    assert sum(s.verified_envelopes for s in stats if isinstance(s, DecodeStats)) == 6


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return ""


def test_a_config_outside_the_presets_runs_at_its_true_size_with_metrics_served(tmp_path):
    """What a new user does: their own hybrid config.json, the synthetic cache chosen for them."""
    config = FIXTURES / "bamba.json"  # 29 Mamba2 layers: about 116 MiB of state per request
    port, out = free_port(), tmp_path / "run.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "distpool", "run", "--model", str(config), "--requests", "6"]
    command += ["--memory-gib", "1", "--metrics-port", str(port), "--json", str(out)]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = ""
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            body = scrape(port)
            if "ray_distpool_transfer_bytes_total" in body and "ray_distpool_pages_capacity" in body:
                seen = body
            time.sleep(0.5)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    first = next(line for line in output.splitlines() if line.startswith("distpool:"))
    assert "synthetic cache" in first  # the run says which cache it chose
    for name in ("pages_used", "slots_capacity", "transfer_bytes_total", "transfer_seconds_total"):
        assert f"ray_distpool_{name}" in seen, name
    report = json.loads(out.read_text())
    slot = size_pools(spec_from_hf(config), PoolArgs(disaggregation_mode="decode"), 1 << 30).slot_bytes
    assert report["model_impl"] == "synthetic" and report["completed"] == 6
    assert report["verified_envelopes"] >= 6 and report["corrupt_envelopes"] == 0
    assert report["transfer_bytes_p50"] >= slot > 100 << 20
    assert report["link_utilization"] > 0


@pytest.mark.parametrize("unified", [True, False])
def test_the_parity_pool_holds_one_sampled_request_not_a_whole_worker_budget(unified):
    """nemotron-h-56b at 2 GiB per worker: the driver's parity pool took a whole worker budget (one
    request at full context needs about 1.03 GiB, more than the 1 GiB cap), about a third of the
    run's memory. It now holds one request of the longest sampled length, whatever the split."""
    from distpool.model.presets import resolve_model
    from distpool.serving.summary.parity import parity_pool_sizes

    spec = spec_from_hf(resolve_model("nemotron-h-56b"))
    args = PoolArgs(enable_unified_memory=unified, mamba_state_ratio=0.5)
    worker = WorkerConfig(spec=spec, pool_args=args, budget_bytes=2 << 30, model_impl="synthetic")
    sizes = parity_pool_sizes(worker, longest_tokens=112)  # a mixed prompt of 96 and 16 new tokens
    assert sizes.requests_at_full_context >= 1 and sizes.args.context_len == 112
    one_request = spec.slot_bytes + 7 * sizes.page_stride_bytes  # 112 tokens: 7 pages of 16
    assert sizes.budget_bytes <= (1 if unified else 2) * one_request + (64 << 10) < 2 << 30
