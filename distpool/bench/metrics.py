"""The figures of one run, with `vllm bench serve`'s names and definitions.

TTFT: the first output chunk's arrival after sending. TPOT: (latency - TTFT) / (output tokens - 1),
over requests of more than one output token. ITL: every gap between two output chunks. E2EL: to the
last output chunk. Throughputs divide by the run's duration. A request is good when it meets every SLO
of `--goodput` (TPOT counted 0 for a one-token reply, as vLLM does); `request_goodput` is good
requests per second, `slo_attainment` (ours, DistServe's) good requests over all requests planned,
failed and never-sent ones counted as missing their SLOs.
"""

from __future__ import annotations

import numpy as np

from distpool.bench.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCIES = ("ttft", "tpot", "itl", "e2el")


def percentile_name(p: float) -> str:
    """vLLM's key for a percentile: p99, p99.9."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def run_figures(
    results: list[RequestResult], duration_s: float, percentiles: list[float], slos_ms: dict[str, float]
) -> dict:
    """The figures of one run: a JSON-ready dict keyed by vLLM's names."""
    done = [r for r in results if r.success]
    samples_s = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.latency_s for r in done],
    }
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if meets_slos(r, slos_ms))
    figures: dict = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s if slos_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "slo_attainment": good / len(results) if slos_ms and results else None,
    }
    for name in LATENCIES:
        ms = np.asarray(samples_s[name] or [0.0]) * 1000.0  # vLLM reports 0 for an empty sample
        figures[f"mean_{name}_ms"] = float(ms.mean())
        figures[f"median_{name}_ms"] = float(np.median(ms))
        figures[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            figures[f"{percentile_name(p)}_{name}_ms"] = float(np.percentile(ms, p))
    figures["errors"] = sorted({r.error for r in results if not r.success})[:10]
    return figures


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    if not result.success or not slos_ms:
        return False
    tpot_s = (
        (result.latency_s - result.ttft_s) / (result.output_tokens - 1) if result.output_tokens > 1 else 0.0
    )
    measured_s = {"ttft": result.ttft_s, "tpot": tpot_s, "e2el": result.latency_s}
    return all(measured_s[key] * 1000.0 <= limit for key, limit in slos_ms.items())
