"""`distpool` command line: `check` (classify and size) and `run` (PD serving, the main job).

Exit status 0 on success, 2 with the reason on stderr (no traceback) for refusals and bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from distpool.configurator import GIB, PoolArgs, PoolPlan, plan
from distpool.spec import ModelSpec

DEFAULT_MEMORY_GIB = 8.0


def _mode(value: str) -> str | None:
    if value not in ("null", "prefill", "decode"):
        raise argparse.ArgumentTypeError(f"must be one of null, prefill, decode; got {value!r}")
    return None if value == "null" else value


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The pool flags shared by `check` and `run` (defaults come from PoolArgs)."""
    defaults = PoolArgs()
    parser.add_argument("--enable-unified-memory", action="store_true", help="one arena for KV and state")
    parser.add_argument("--page-size", type=int, default=defaults.page_size, help="tokens per page")
    parser.add_argument("--context-len", type=int, default=defaults.context_len, help="longest request")
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--kv-dtype", default=None, help="override the KV cache dtype")
    parser.add_argument("--ssm-dtype", default=None, help="override the SSM state dtype")
    parser.add_argument("--mamba-state-ratio", type=float, default=defaults.mamba_state_ratio)
    parser.add_argument("--swa-full-tokens-ratio", type=float, default=defaults.swa_full_tokens_ratio)


def pool_args_from(ns: argparse.Namespace, disaggregation_mode: str | None) -> PoolArgs:
    return PoolArgs(
        enable_unified_memory=ns.enable_unified_memory,
        disaggregation_mode=disaggregation_mode,
        page_size=ns.page_size,
        context_len=ns.context_len,
        max_running_requests=ns.max_running_requests,
        kv_dtype=ns.kv_dtype,
        ssm_dtype=ns.ssm_dtype,
        mamba_state_ratio=ns.mamba_state_ratio,
        swa_full_tokens_ratio=ns.swa_full_tokens_ratio,
    )


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_plan(p: PoolPlan) -> str:
    s = p.summary()
    spec = p.spec
    lines = [
        f"model        {', '.join(spec.architectures) or spec.model_type} ({spec.source})",
        f"kind         {spec.kind}",
        f"layers       {spec.num_layers}: {spec.num_full_attention_layers} full attention, "
        f"{spec.num_sliding_window_layers} sliding window, {spec.num_mamba_layers} mamba",
        f"pool         {'unified arena' if p.unified else 'static pools'}, mode "
        f"{p.args.disaggregation_mode or 'colocated'}, budget {_human_bytes(p.budget_bytes)}",
        f"page         {p.page_size} tokens = {s['page_bytes']} bytes ({_human_bytes(p.page_bytes)})",
    ]
    if p.swa_page_bytes:
        lines.append(f"swa page     {s['swa_page_bytes']} bytes, window {spec.sliding_window} tokens")
    if p.slot_bytes:
        lines.append(f"slot         {s['slot_bytes']} bytes ({_human_bytes(p.slot_bytes)}) per request")
    lines += [
        f"pages        {s['num_pages']}" + (f" (+{s['num_swa_pages']} swa)" if p.num_swa_pages else ""),
        f"slots        {s['num_slots']}",
        f"capacity     {s['requests_at_full_context']} requests at full context ({p.args.context_len} "
        f"tokens); max {s['max_total_tokens']} tokens with {s['max_running_requests']} requests running",
    ]
    return "\n".join(lines)


def cmd_check(ns: argparse.Namespace) -> int:
    spec = ModelSpec.from_hf(ns.config)
    budget = int(ns.memory_gib * GIB)
    p = plan(spec, pool_args_from(ns, ns.disaggregation_mode), budget)
    print(json.dumps(p.summary()) if ns.json else format_plan(p))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="classify a model config and size its pools")
    check.add_argument("config", help="config.json, or a directory holding one")
    check.add_argument("--disaggregation-mode", type=_mode, default=None, metavar="{null,prefill,decode}")
    check.add_argument("--memory-gib", type=float, default=DEFAULT_MEMORY_GIB, help="pool budget")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    add_pool_arguments(check)
    check.set_defaults(handler=cmd_check)

    from distpool.run_cli import add_run_parser

    add_run_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as exc:  # refusals and bad input: the message is the whole story
        print(f"distpool: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
