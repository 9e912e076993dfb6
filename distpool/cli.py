"""`distpool` command line: `check` (classify and size), `presets` and `run` (PD serving, the main job).

Exit status 0 on success, 2 with the reason on stderr (no traceback) for refusals and bad input.
Everything is validated here, before Ray or any actor starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence

from distpool.memory.describe import format_sizes
from distpool.memory.sizing import GIB, PoolArgs
from distpool.memory.tp_sizes import size_tp_pools
from distpool.model.presets import format_presets, preset_rows, resolve_model
from distpool.model.spec import ENGINE_CONVENTION, TRANSFORMERS_CONVENTION
from distpool.model_impl.flags import add_model_impl_arguments, implementation_from
from distpool.model_impl.hf.tokenizer import find_tokenizer
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.model_impl.select import compute_dtype
from distpool.serving import request_flags
from distpool.serving.conditional import ConditionalOptions
from distpool.serving.conversation import DEFAULT_TURNS
from distpool.serving.request_flags import RequestFlags
from distpool.serving.workload import WORKLOADS
from distpool.settings import Settings
from distpool.worker.config import DEFAULT_BUDGET_BYTES, DEFAULT_LOCAL_PREFILL_CHUNK, WorkerConfig
from transfer import TransferOptions
from transfer.defaults import DEFAULT_TIMEOUT_S, MAX_CHUNK_BYTES, MAX_TIMEOUT_S, MIN_TIMEOUT_S
from transfer.faults import SENDER_ABORT

CHECK_MEMORY_GIB = 8.0  # `check` sizes a real model: a GPU-sized budget
CONVENTION_WORDS = {
    ENGINE_CONVENTION: "a conv state of kernel - 1 columns, as SGLang and vLLM keep it",
    TRANSFORMERS_CONVENTION: "a conv state of kernel columns, as transformers' modeling code keeps it",
}
MAX_TP = 1024  # ranks in one tensor-parallel group: far past any node


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
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=defaults.prefix_cache,
        help="reuse cached prompt prefixes at prefill (pages by content, state checkpoints)",
    )


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
        prefix_cache=ns.prefix_cache,
    )


def _whole_tokens(value: str | None, flag: str) -> int | None:
    """A token count of at least 1 given as `flag` (None stays None); ValueError names the flag."""
    if value is None:
        return None
    if not value.isdecimal() or int(value) < 1:
        raise ValueError(f"{flag} must be a whole number of tokens, at least 1; got {value!r}")
    return int(value)


def _tp_size(value: str) -> int:
    """A tensor-parallel size: a whole number of ranks, 1 to MAX_TP."""
    tp = int(value) if value.isdecimal() else 0
    if not 1 <= tp <= MAX_TP:
        raise argparse.ArgumentTypeError(f"must be a whole number of ranks, 1 to {MAX_TP}; got {value!r}")
    return tp


def cmd_check(ns: argparse.Namespace) -> int:
    # `check` sizes the engine convention (spec_from_hf) unless asked for the transformers runner's.
    impl = implementation_from(ns, ns.config, auto_transformers=False)
    args = pool_args_from(ns, ns.disaggregation_mode)
    # --tp N: one rank's pool of an N-rank group, within --memory-gib per rank (N = 1: the one pool)
    tp = size_tp_pools(impl.spec, args, int(ns.memory_gib * GIB), ns.tp)
    dtype = compute_dtype(impl.spec, impl.name, impl.hf, args.kv_dtype)
    convention = impl.spec.state_convention
    summary = {**tp.summary(), "model_impl": impl.name, "dtype": dtype, "state_convention": convention}
    print(
        json.dumps(summary)
        if ns.json
        else f"{format_sizes(tp.rank, tp)}\nimplementation {impl.name}, {dtype}; "
        f"state sizes in the {convention} convention ({CONVENTION_WORDS[convention]})"
    )
    return 0


def cmd_presets(ns: argparse.Namespace) -> int:
    rows = preset_rows()
    print(json.dumps([dataclasses.asdict(r) for r in rows]) if ns.json else format_presets(rows))
    return 0


def cmd_run(ns: argparse.Namespace) -> int:
    # Imported here so that `distpool check` does not pay for importing Ray.
    from distpool.serving.deployment import DeploymentSpec
    from distpool.serving.metrics import validate_metrics_port
    from distpool.serving.output import check_output_path
    from distpool.serving.preflight import check_cluster, check_fits_this_machine, default_budget_bytes
    from distpool.serving.run import run

    if not 0.0 <= ns.fault_rate < 1.0:
        raise ValueError(f"--fault-rate must be in [0, 1); got {ns.fault_rate}")
    if ns.enable_unified_memory and ns.disable_unified_memory:
        raise ValueError("--enable-unified-memory and --disable-unified-memory contradict. Fix: keep one")
    flags = RequestFlags(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RequestFlags)})
    settings = Settings.from_env()
    transfer = transfer_options(ns, settings)
    config_path = resolve_model(ns.model)
    for path, flag in ((ns.json, "--json"), (ns.outputs, "--outputs")):
        if path is not None:
            check_output_path(path, flag, {"--prompts": ns.prompts, "--model": config_path})
    impl = implementation_from(ns, ns.model, auto_transformers=True)
    model = impl.spec  # the transformers runner's: from the model's modules
    pool_args = pool_args_from(ns, None)
    num_ranks = ns.prefill * ns.prefill_tp + ns.decode * ns.decode_tp  # a process each, --memory-gib each
    budget = (
        int(ns.memory_gib * GIB)
        if ns.memory_gib is not None
        else default_budget_bytes(model, pool_args, impl.name, num_ranks)
    )
    conditional = ConditionalOptions(
        max_tokens=_whole_tokens(ns.local_prefill_max_tokens, "--local-prefill-max-tokens"),
    )
    worker = WorkerConfig(
        spec=model,
        local_prefill=ns.conditional_disagg,
        local_prefill_chunk=_whole_tokens(ns.local_prefill_chunk, "--local-prefill-chunk"),
        pool_args=pool_args,
        budget_bytes=budget,
        transfer=transfer,
        device=ns.device,
        seed=ns.seed,
        model_impl=impl.name,
        hf=impl.hf,
        prefill_tp=ns.prefill_tp,
        decode_tp=ns.decode_tp,
    )
    unified = True if ns.enable_unified_memory else (False if ns.disable_unified_memory else None)
    spec = DeploymentSpec.build(
        worker, unified=unified, num_prefill=ns.prefill, num_decode=ns.decode, spread=ns.spread
    )  # the configurator's refusals come first, before Ray or any actor starts
    address = ns.address or settings.ray_address
    address_from = "--address" if ns.address else "RAY_ADDRESS"
    check_cluster(address, address_from, num_cpus=ns.num_cpus, spread=ns.spread, num_workers=num_ranks)
    if not address:  # the embedded cluster runs every worker (every rank) on this machine
        # unified or not, as resolved; every rank counted
        check_fits_this_machine(spec.worker, ns.prefill * ns.prefill_tp, ns.decode * ns.decode_tp)
        if ns.metrics_port is not None:
            validate_metrics_port(ns.metrics_port)
    else:
        if ns.metrics_port is not None:
            raise ValueError(
                "--metrics-port sets up the embedded cluster's exporter; a cluster exports its own "
                "metrics (start its nodes with `ray start --metrics-export-port P`)"
            )
    tokenizer = find_tokenizer(config_path) if ns.prompts is not None or ns.outputs is not None else None
    requests = flags.requests_for(
        vocab_size=model.vocab_size, context_len=worker.pool_args.context_len, tokenizer=tokenizer
    )
    return run(
        spec,
        requests,
        address=address,
        num_cpus=ns.num_cpus,
        faults={SENDER_ABORT: ns.fault_rate},  # --fault-rate: transfers aborted mid-stream
        overlap_reservation=not ns.reserve_first,
        conditional=conditional,
        seed=ns.seed,
        parity_sample=ns.parity_sample,
        json_path=ns.json,
        outputs_path=ns.outputs,
        detokenize=tokenizer.decode if tokenizer is not None else None,
        metrics_port=ns.metrics_port,
    )


def transfer_options(ns: argparse.Namespace, settings: Settings) -> TransferOptions:
    """The flag, else the environment, else TransferOptions' own default; errors name the source."""
    timeout, timeout_from = TransferOptions.timeout_s, None
    if ns.transfer_timeout is not None:
        timeout, timeout_from = ns.transfer_timeout, "--transfer-timeout"
    elif settings.transfer_timeout_s is not None:
        timeout, timeout_from = settings.transfer_timeout_s, "DISTPOOL_TRANSFER_TIMEOUT_S"
    chunk_mib = settings.chunk_mib if settings.chunk_mib is not None else TransferOptions.chunk_bytes >> 20
    if not 0 < chunk_mib <= MAX_CHUNK_BYTES >> 20:
        raise ValueError(f"DISTPOOL_CHUNK_MIB must be 1 to {MAX_CHUNK_BYTES >> 20} (MiB); got {chunk_mib}")
    try:
        return TransferOptions(timeout_s=timeout, chunk_bytes=chunk_mib << 20)
    except ValueError as exc:
        raise ValueError(f"{timeout_from}: {exc}") from None


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="serve a workload through prefill/decode disaggregation on Ray")
    run.add_argument(
        "--model",
        default=str(REFERENCE_HYBRID_CONFIG),
        metavar="NAME|PATH",
        help="a preset (`distpool presets`) or a config.json (default: the bundled reference model)",
    )
    run.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    run.add_argument("--decode", type=int, default=1, help="number of decode workers")
    run.add_argument(
        "--prefill-tp", type=_tp_size, default=1, help="tensor-parallel ranks per prefill worker (1)"
    )
    run.add_argument(
        "--decode-tp", type=_tp_size, default=1, help="tensor-parallel ranks per decode worker (1)"
    )
    requests_help = f"generated requests (multi-turn: turns; {request_flags.DEFAULT_REQUESTS})"
    run.add_argument("--requests", type=int, help=requests_help)
    run.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        # argparse formats help with %: the descriptions' "95%" must be escaped
        help=f"prompt lengths ({request_flags.DEFAULT_WORKLOAD}): "
        + "; ".join(f"{k}: {v}" for k, v in WORKLOADS.items()).replace("%", "%%"),
    )
    run.add_argument("--turns", type=int, help=f"multi-turn: turns per conversation ({DEFAULT_TURNS})")
    run.add_argument("--prompts", default=None, help="JSONL file of prompts instead of a generated workload")
    low, high = request_flags.DEFAULT_PROMPT_LEN
    run.add_argument("--min-prompt-len", type=int, default=None, help=f"shortest prompt of mixed ({low})")
    run.add_argument("--max-prompt-len", type=int, default=None, help=f"longest prompt of mixed ({high})")
    run.add_argument("--max-new-tokens", type=int, default=RequestFlags.max_new_tokens)
    run.add_argument("--fault-rate", type=float, default=0.0, help="probability a transfer is aborted")
    run.add_argument(
        "--reserve-first",
        action="store_true",
        help="reserve the decode destination before prefill starts, not while it computes (slower; "
        "kept to compare the two orders, scripts/bench_ttft.py)",
    )
    run.add_argument("--parity-sample", type=int, default=4, help="requests re-generated colocated")
    run.add_argument(
        "--memory-gib",
        type=_gib,
        default=None,
        help=f"pool budget per worker, per rank of a TP group (default: {DEFAULT_BUDGET_BYTES / GIB:g} for "
        "the reference model; for the synthetic cache, 4 requests at full context within 40%% of the "
        "available memory)",
    )
    run.add_argument("--disable-unified-memory", action="store_true", help="static pools even for hybrid")
    run.add_argument(
        "--device", default="auto", help="auto (a GPU per worker when there are enough), cpu, cuda"
    )
    run.add_argument(
        "--conditional-disagg",
        action=argparse.BooleanOptionalAction,
        default=WorkerConfig.local_prefill,
        help="prefill a request on the decode worker holding the state its prompt extends, when the cost "
        "model says that beats moving the slot (README: conditional disaggregation)",
    )
    run.add_argument(
        "--local-prefill-max-tokens",
        default=None,
        metavar="N",
        help="new prompt tokens a decode worker may prefill for one request (default: the cost model's)",
    )
    run.add_argument(
        "--local-prefill-chunk",
        default=str(DEFAULT_LOCAL_PREFILL_CHUNK),
        metavar="N",
        help=f"tokens a local prefill computes between two decode steps ({DEFAULT_LOCAL_PREFILL_CHUNK})",
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
        help=f"seconds ({MIN_TIMEOUT_S:g}-{MAX_TIMEOUT_S:g}); "
        f"default {DEFAULT_TIMEOUT_S:g} or DISTPOOL_TRANSFER_TIMEOUT_S",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics of the embedded cluster at http://127.0.0.1:PORT/metrics",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", default=None, metavar="PATH", help="write the summary as JSON")
    run.add_argument(
        "--outputs",
        default=None,
        metavar="PATH.jsonl",
        help="write each served request's prompt and output ids (and text, with the model's tokenizer)",
    )
    add_pool_arguments(run)
    add_model_impl_arguments(run)
    run.set_defaults(handler=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="classify a model config and size its pools")
    check.add_argument(
        "config",
        metavar="NAME|PATH",
        help="a preset (`distpool presets`), a config.json, or a directory holding one",
    )
    check.add_argument("--disaggregation-mode", type=_mode, default=None, metavar="{null,prefill,decode}")
    check.add_argument("--memory-gib", type=_gib, default=CHECK_MEMORY_GIB, help="pool budget (per TP rank)")
    check.add_argument(
        "--tp", type=_tp_size, default=1, help="tensor-parallel ranks: each rank's page and slot bytes"
    )
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.add_argument("--device", default="auto", help=argparse.SUPPRESS)  # --dtype auto reads it
    add_pool_arguments(check)
    add_model_impl_arguments(check)
    check.set_defaults(handler=cmd_check)

    presets = sub.add_parser("presets", help="list the bundled model presets with their per-request memory")
    presets.add_argument("--json", action="store_true", help="print one JSON list")
    presets.set_defaults(handler=cmd_presets)
    add_run_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as exc:  # refusals and bad input: the message is the whole story
        print(f"distpool: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a run started (a run writes its own summary, then exits 130)
        print("distpool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
