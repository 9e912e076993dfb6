"""PD serving at a real model's sizes: 1P1D with the synthetic cache, one prompt length at a time.

For each prompt length it serves a few requests, one at a time, through the whole stack (decode
reserve, prefill into the pool, whole-envelope transfer, byte verification at decode, decode steps), then
measures the channel's raw link at that envelope size (`transfer.ends.link`), and reports per length:

  prompt_tokens, envelope_bytes, transfer_ms, transfer_gbps, link_gbps, link_utilization, ttft_ms
  (plus the TTFT parts, so the transfer's share of TTFT shows).

    python scripts/bench_pd.py --model nemotron-h-8b --quick --json out/bench_pd.json

The full run covers 1k, 4k, 16k and 32k tokens; `--quick` 1k and 8k. A table is printed, a plot
written under out/, and `--json` writes the rows.

With `--workload multi-turn|shared-prefix|long-tailed` it instead serves one seeded workload three ways
(prefix cache off, on, and on with conditional disaggregation; scripts/pd_policies.py), side by side:

    python scripts/bench_pd.py --model tests/fixtures/bamba.json --workload multi-turn --memory-gib 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

WORKLOADS = ("multi-turn", "shared-prefix", "long-tailed")
FULL_LENGTHS = (1024, 4096, 16384, 32768)
QUICK_LENGTHS = (1024, 8192)
MAX_NEW_TOKENS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="nemotron-h-8b", help="a preset name or a config.json")
    parser.add_argument("--quick", action="store_true", help="1k and 8k tokens only")
    parser.add_argument("--lengths", default=None, help="comma-separated prompt lengths (overrides)")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per prompt length (4); --workload: turns (32)"
    )
    parser.add_argument("--memory-gib", type=float, default=None, help="pool budget per worker")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--plot", default="out/bench_pd.png")
    policies = parser.add_argument_group("--workload: the same workload three ways (scripts/pd_policies.py)")
    policies.add_argument("--workload", choices=WORKLOADS, default=None)
    policies.add_argument("--turns", type=int, default=None, help="multi-turn: turns per conversation")
    policies.add_argument("--max-new-tokens", type=int, default=32)
    policies.add_argument("--context-len", type=int, default=16384)
    policies.add_argument("--seed", type=int, default=0)
    policies.add_argument("--repeats", type=int, default=1, help="each way this many times, round robin")
    policies.add_argument(
        "--with-always-local", action="store_true", help="a fourth way: every local prefill the state allows"
    )
    policies.add_argument("--local-prefill-chunk", type=int, default=None)
    policies.add_argument("--local-prefill-max-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    if args.requests is None:  # --requests counts a workload's requests (turns), else per length
        args.requests = 32 if args.workload is not None else 4
    return args


def prompt_lengths(args: argparse.Namespace) -> list[int]:
    """The prompt lengths to serve; ValueError (exit 2, before Ray starts) for lengths or counts
    that cannot make a request."""
    if args.requests < 1:
        raise ValueError(f"--requests must be at least 1 per prompt length; got {args.requests}")
    if not args.lengths:
        return list(QUICK_LENGTHS if args.quick else FULL_LENGTHS)
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated token counts; got {args.lengths!r}") from None
    if min(lengths) < 1:
        raise ValueError(f"--lengths must be 1 token or more each; got {args.lengths!r}")
    return lengths


def worker_config(args: argparse.Namespace, lengths: list[int]):
    from distpool.memory.sizing import GIB, PoolArgs
    from distpool.model.hf_config import spec_from_hf
    from distpool.model.presets import resolve_model
    from distpool.serving.job.preflight import default_budget_bytes
    from distpool.worker.config import WorkerConfig

    spec = spec_from_hf(resolve_model(args.model))
    context = max(lengths) + MAX_NEW_TOKENS
    # No prefix cache: the prompts of one request index at two lengths share a prefix, and this
    # measures whole-envelope transfers, not reuse.
    pool_args = PoolArgs(page_size=args.page_size, context_len=context, prefix_cache=False)
    if args.memory_gib is not None:
        if not 0 < args.memory_gib < 1 << 32:  # also refuses nan
            raise ValueError(f"--memory-gib must be a positive number of GiB; got {args.memory_gib}")
        budget = int(args.memory_gib * GIB)
    else:  # what `distpool run` would take: 4 requests at the longest length, within this machine
        budget = default_budget_bytes(spec, pool_args, "synthetic", num_workers=2)
    return WorkerConfig(spec=spec, pool_args=pool_args, budget_bytes=budget, model_impl="synthetic")


def bench(args: argparse.Namespace) -> list[dict]:
    import ray

    from distpool.model.presets import resolve_model
    from distpool.model.sampling import SamplingParams
    from distpool.serving.deploy.deployment import Deployment, DeploymentSpec
    from distpool.serving.job.main import measure_links, worker_stats
    from distpool.serving.job.output import check_output_path
    from distpool.serving.job.preflight import check_fits_this_machine
    from distpool.serving.path.driver import ServeOptions, Server
    from distpool.serving.summary.parity import Parity
    from distpool.serving.summary.report import summarize
    from distpool.serving.workloads.workload import Request

    lengths = prompt_lengths(args)
    config = worker_config(args, lengths)
    spec = DeploymentSpec.build(config, num_prefill=1, num_decode=1)
    check_fits_this_machine(
        spec.worker, num_prefill=1, num_decode=1
    )  # everything is refused before Ray starts
    if args.json:
        check_output_path(args.json, "--json", {"--model": resolve_model(args.model)})
    print(
        f"bench_pd: {args.model}, 1P1D, synthetic cache, {config.budget_bytes / 2**30:.2f} GiB per worker, "
        f"prompt lengths {lengths}",
        flush=True,
    )
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    deployment = Deployment.start(spec)
    rows = []
    try:
        for length in lengths:
            vocab = config.spec.vocab_size or 32000
            requests = [
                Request(
                    request_id=f"len{length}-{i}",
                    prompt=[(7919 * (i + 1) * (t + 1)) % vocab for t in range(length)],
                    params=SamplingParams(max_tokens=MAX_NEW_TOKENS),
                )
                for i in range(args.requests)
            ]
            # One request at a time: its transfer does not compete with another's hashing for the cores.
            server = Server(deployment, ServeOptions(progress=False, queue_bound=1))
            outcomes = asyncio.run(server.serve(requests))
            link = measure_links(deployment, outcomes)
            report = summarize(
                outcomes,
                retried=server.retried,
                worker_stats=worker_stats(deployment),
                parity=Parity(),
                wall_s=0.0,
                model_impl="synthetic",
                link=link,
            )
            if report["failed"] or report["corrupt_envelopes"]:
                raise RuntimeError(f"{length} tokens: {report['failed']} failed; {report['errors']}")
            parts = report["ttft_breakdown_ms"]
            row = {
                "prompt_tokens": length,
                "envelope_bytes": int(report["transfer_bytes_p50"]),
                "transfer_ms": parts["transfer"]["p50"],
                "transfer_gbps": report["transfer_gbps"],
                "link_gbps": report["link_gbps"],
                "link_utilization": report["link_utilization"],
                "ttft_ms": report["ttft_ms_p50"],
                "ttft_breakdown_ms": {part: v["p50"] for part, v in parts.items()},
                "verified_envelopes": report["verified_envelopes"],
            }
            rows.append(row)
            share = row["transfer_ms"] / row["ttft_ms"] if row["ttft_ms"] else 0.0
            print(
                f"  {length:>6} tokens: envelope {row['envelope_bytes'] / 2**20:8.1f} MiB, transfer "
                f"{row['transfer_ms']:8.1f} ms at {row['transfer_gbps']:.2f} GB/s "
                f"(raw {row['link_gbps']:.2f}, "
                f"utilization {row['link_utilization']:.2f}), TTFT {row['ttft_ms']:.1f} ms "
                f"(transfer {share:.0%})",
                flush=True,
            )
    finally:
        deployment.shutdown()
        ray.shutdown()
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    tokens = [r["prompt_tokens"] for r in rows]
    rate.plot(tokens, [r["transfer_gbps"] for r in rows], "-o", label="envelope transfer")
    rate.plot(tokens, [r["link_gbps"] for r in rows], "--s", color="gray", label="raw link, same size")
    rate.set_ylabel("GB/s")
    bottom = [0.0] * len(rows)
    for part in ("queue", "reserve", "prefill", "transfer", "first_token"):
        heights = [r["ttft_breakdown_ms"][part] for r in rows]
        ttft.bar([str(t) for t in tokens], heights, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ttft.set_ylabel("TTFT p50 parts (ms)")
    for ax in (rate, ttft):
        ax.set_xlabel("prompt tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    rate.set_xscale("log", base=2)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args = parse_args(argv)
    if args.workload is not None:
        return main_policies(args)
    try:
        rows = bench(args)
    except ValueError as exc:  # bad arguments, a model name, a budget too small or too large
        print(f"bench_pd: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"\n{'tokens':>7} {'envelope MiB':>13} {'transfer ms':>12} {'GB/s':>6} {'raw':>6} "
        f"{'util':>5} {'TTFT ms':>8}"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7} {r['envelope_bytes'] / 2**20:>13.1f} {r['transfer_ms']:>12.1f} "
            f"{r['transfer_gbps']:>6.2f} {r['link_gbps']:>6.2f} {r['link_utilization']:>5.2f} "
            f"{r['ttft_ms']:>8.1f}"
        )
    plot(rows, Path(args.plot), f"PD at real sizes: {args.model}, 1P1D, Gloo")
    print(f"plot: {args.plot}")
    if args.json:
        from distpool.serving.job.output import write_json

        write_json(args.json, {"model": args.model, "rows": rows})
        print(f"json: {args.json}")
    return 0


def main_policies(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pd_policies import serve_policies, table

    if args.requests < 1 or args.repeats < 1:
        got = f"{args.requests}, {args.repeats}"
        print(f"bench_pd: error: --requests and --repeats must be at least 1; got {got}", file=sys.stderr)
        return 2
    policies = serve_policies(args)
    print("\n" + table(policies))
    if args.json:
        from distpool.serving.job.output import write_json

        write_json(args.json, {"model": args.model, "workload": args.workload, "policies": policies})
        print(f"json: {args.json}")
    return 0 if all(f["exit_status"] == 0 for f in policies.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
