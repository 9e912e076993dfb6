"""`distpool` command line: `check` (classify and size) and `run` (PD serving, the main job).

Exit status 0 on success, 2 with the reason on stderr (no traceback) for refusals and bad input.
Everything is validated here, before Ray or any actor starts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from distpool.memory.sizing import GIB, PoolArgs, PoolSizes, size_pools
from distpool.model.hf_config import spec_from_hf
from distpool.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.settings import Settings
from distpool.worker.config import DEFAULT_BUDGET_BYTES, WorkerConfig
from transfer import TransferOptions
from transfer.faults import SENDER_ABORT

CHECK_MEMORY_GIB = 8.0  # `check` sizes a real model: a GPU-sized budget


def _mode(value: str) -> str | None:
    if value not in ("null", "prefill", "decode"):
        raise argparse.ArgumentTypeError(f"must be one of null, prefill, decode; got {value!r}")
    return None if value == "null" else value


def _gib(value: str) -> float:
    """A memory budget in GiB: a finite positive number."""
    try:
        gib = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of GiB; got {value!r}") from None
    if not math.isfinite(gib) or gib <= 0 or gib * GIB >= 1 << 62:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of GiB; got {value!r}")
    return gib


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The pool flags shared by `check` and `run` (defaults come from PoolArgs)."""
    defaults = PoolArgs()
    parser.add_argument("--enable-unified-memory", action="store_true", help="one arena for KV and state")
    parser.add_argument("--page-size", type=int, default=defaults.page_size, help="tokens per page")
    parser.add_argument("--context-len", type=int, default=defaults.context_len, help="longest request")
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--kv-dtype", default=None, help="override the KV cache dtype (e.g. bf16, fp8_e4m3)")
    parser.add_argument("--ssm-dtype", default=None, help="override the SSM state dtype (e.g. fp32)")
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


def format_sizes(p: PoolSizes) -> str:
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
    ]
    if p.page_bytes == 0 and p.swa_page_bytes == 0:  # attention-free: memory does not grow with tokens
        lines.append(f"capacity     {s['num_slots']} requests of any length (state only, no KV)")
    else:
        lines.append(
            f"capacity     {s['requests_at_full_context']} requests at full context ({p.args.context_len} "
            f"tokens); max {s['max_total_tokens']} tokens with {s['max_running_requests']} requests running"
        )
    return "\n".join(lines)


def cmd_check(ns: argparse.Namespace) -> int:
    spec = spec_from_hf(ns.config)
    sizes = size_pools(spec, pool_args_from(ns, ns.disaggregation_mode), int(ns.memory_gib * GIB))
    print(json.dumps(sizes.summary()) if ns.json else format_sizes(sizes))
    return 0


def cmd_run(ns: argparse.Namespace) -> int:
    # Imported here so that `distpool check` does not pay for importing Ray.
    from distpool.serving import workload
    from distpool.serving.deployment import DeploymentSpec
    from distpool.serving.preflight import check_fits_this_machine, check_reachable
    from distpool.serving.run import run

    if not 0.0 <= ns.fault_rate < 1.0:
        raise ValueError(f"--fault-rate must be in [0, 1); got {ns.fault_rate}")
    settings = Settings.from_env()
    transfer = transfer_options(ns, settings)
    worker = WorkerConfig(
        spec=spec_from_hf(ns.model),
        pool_args=pool_args_from(ns, None),
        budget_bytes=int(ns.memory_gib * GIB),
        transfer=transfer,
        device=ns.device,
        seed=ns.seed,
    )
    unified = True if ns.enable_unified_memory else (False if ns.disable_unified_memory else None)
    spec = DeploymentSpec.build(
        worker, unified=unified, num_prefill=ns.prefill, num_decode=ns.decode, spread=ns.spread
    )  # the configurator's refusals come first, before Ray or any actor starts
    address = ns.address or settings.ray_address
    if not address:  # the embedded cluster runs every worker on this machine
        check_fits_this_machine(worker, ns.prefill + ns.decode)
    else:
        check_reachable(address)
    vocab_size = worker.spec.vocab_size
    if ns.prompts:
        requests = workload.load_jsonl(ns.prompts, vocab_size=vocab_size, max_new_tokens=ns.max_new_tokens)
    else:
        requests = workload.generate(
            ns.requests,
            vocab_size=vocab_size,
            min_prompt=ns.min_prompt_len,
            max_prompt=ns.max_prompt_len,
            max_new_tokens=ns.max_new_tokens,
            seed=ns.seed,
        )
    if max(len(r.prompt) + r.max_new_tokens for r in requests) > worker.pool_args.context_len:
        raise ValueError(f"a request is longer than --context-len {worker.pool_args.context_len}; raise it")
    return run(
        spec,
        requests,
        address=address,
        num_cpus=ns.num_cpus,
        faults={SENDER_ABORT: ns.fault_rate},  # --fault-rate: transfers aborted mid-stream
        seed=ns.seed,
        parity_sample=ns.parity_sample,
        json_path=ns.json,
    )


def transfer_options(ns: argparse.Namespace, settings: Settings) -> TransferOptions:
    """The flag, else the environment, else TransferOptions' own default; errors name the source."""
    timeout, timeout_from = TransferOptions.timeout_s, None
    if ns.transfer_timeout is not None:
        timeout, timeout_from = ns.transfer_timeout, "--transfer-timeout"
    elif settings.transfer_timeout_s is not None:
        timeout, timeout_from = settings.transfer_timeout_s, "DISTPOOL_TRANSFER_TIMEOUT_S"
    chunk_mib = settings.chunk_mib if settings.chunk_mib is not None else TransferOptions.chunk_bytes >> 20
    if not 0 < chunk_mib <= 1024:
        raise ValueError(f"DISTPOOL_CHUNK_MIB must be 1 to 1024 (MiB); got {chunk_mib}")
    try:
        return TransferOptions(timeout_s=timeout, chunk_bytes=chunk_mib << 20)
    except ValueError as exc:
        raise ValueError(f"{timeout_from}: {exc}") from None


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="serve a workload through prefill/decode disaggregation on Ray")
    run.add_argument("--model", default=str(REFERENCE_HYBRID_CONFIG), help="model config.json (reference)")
    run.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    run.add_argument("--decode", type=int, default=1, help="number of decode workers")
    run.add_argument("--requests", type=int, default=32, help="generated requests (ignored with --prompts)")
    run.add_argument("--prompts", default=None, help="JSONL file of prompts instead of a generated workload")
    run.add_argument("--min-prompt-len", type=int, default=4)
    run.add_argument("--max-prompt-len", type=int, default=96)
    run.add_argument("--max-new-tokens", type=int, default=16)
    run.add_argument("--fault-rate", type=float, default=0.0, help="probability a transfer is aborted")
    run.add_argument("--parity-sample", type=int, default=4, help="requests re-generated colocated")
    run.add_argument(
        "--memory-gib", type=_gib, default=DEFAULT_BUDGET_BYTES / GIB, help="pool budget per worker"
    )
    run.add_argument("--disable-unified-memory", action="store_true", help="static pools even for hybrid")
    run.add_argument(
        "--device", default="auto", help="auto (a GPU per worker when there are enough), cpu, cuda"
    )
    run.add_argument("--spread", action="store_true", help="place every worker on a different node")
    run.add_argument(
        "--address", default=None, help="Ray cluster to attach to (default: RAY_ADDRESS or embedded)"
    )
    run.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded Ray cluster")
    run.add_argument(
        "--transfer-timeout",
        type=float,
        default=None,
        help="seconds (0.1-3600); default 10 or DISTPOOL_TRANSFER_TIMEOUT_S",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", default=None, metavar="PATH", help="write the summary as JSON")
    add_pool_arguments(run)
    run.set_defaults(handler=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="classify a model config and size its pools")
    check.add_argument("config", help="config.json, or a directory holding one")
    check.add_argument("--disaggregation-mode", type=_mode, default=None, metavar="{null,prefill,decode}")
    check.add_argument("--memory-gib", type=_gib, default=CHECK_MEMORY_GIB, help="pool budget")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    add_pool_arguments(check)
    check.set_defaults(handler=cmd_check)
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
