"""The flags of `distpool check`, `presets` and `run`: their types, defaults and help, and the pool
flags read back into `PoolArgs`. What each command does with them is `distpool.cli.commands`."""

from __future__ import annotations

import argparse
import math

from distpool.cli.model_impl_flags import add_model_impl_arguments
from distpool.memory.sizing import GIB, PoolArgs
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.serving.workloads import (
    DEFAULT_PROMPT_LEN,
    DEFAULT_REQUESTS,
    DEFAULT_TURNS,
    DEFAULT_WORKLOAD,
    WORKLOADS,
    RequestFlags,
)
from distpool.worker.config import DEFAULT_BUDGET_BYTES, DEFAULT_LOCAL_PREFILL_CHUNK
from transfer.defaults import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, MIN_TIMEOUT_S

CHECK_MEMORY_GIB = 8.0  # `check` sizes a real model: a GPU-sized budget
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


def _tp_size(value: str) -> int:
    """A tensor-parallel size: a whole number of ranks, 1 to MAX_TP."""
    tp = int(value) if value.isdecimal() else 0
    if not 1 <= tp <= MAX_TP:
        raise argparse.ArgumentTypeError(f"must be a whole number of ranks, 1 to {MAX_TP}; got {value!r}")
    return tp


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


def add_check_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    return check


def add_presets_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    presets = sub.add_parser("presets", help="list the bundled model presets with their per-request memory")
    presets.add_argument("--json", action="store_true", help="print one JSON list")
    return presets


RUN_HELP = "serve a workload through prefill/decode disaggregation on Ray (--prefill 0: colocated)"


def add_run_parser(
    sub: argparse._SubParsersAction, name: str = "run", help: str = RUN_HELP
) -> argparse.ArgumentParser:
    """`run`'s flags (`serve` starts from them too: its deployment flags are run's)."""
    run = sub.add_parser(name, help=help)
    run.add_argument(
        "--model",
        default=str(REFERENCE_HYBRID_CONFIG),
        metavar="NAME|PATH",
        help="a preset (`distpool presets`) or a config.json (default: the bundled reference model)",
    )
    run.add_argument(
        "--prefill",
        type=int,
        default=1,
        help="number of prefill workers (0: colocated, each decode worker prefills its own requests in "
        "chunks of --local-prefill-chunk tokens between decode steps)",
    )
    run.add_argument("--decode", type=int, default=1, help="number of decode workers")
    run.add_argument(
        "--prefill-tp", type=_tp_size, default=1, help="tensor-parallel ranks per prefill worker (1)"
    )
    run.add_argument(
        "--decode-tp", type=_tp_size, default=1, help="tensor-parallel ranks per decode worker (1)"
    )
    requests_help = f"generated requests (multi-turn: turns; {DEFAULT_REQUESTS})"
    run.add_argument("--requests", type=int, help=requests_help)
    run.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        # argparse formats help with %: the descriptions' "95%" must be escaped
        help=f"prompt lengths ({DEFAULT_WORKLOAD}): "
        + "; ".join(f"{k}: {v}" for k, v in WORKLOADS.items()).replace("%", "%%"),
    )
    run.add_argument("--turns", type=int, help=f"multi-turn: turns per conversation ({DEFAULT_TURNS})")
    run.add_argument("--prompts", default=None, help="JSONL file of prompts instead of a generated workload")
    low, high = DEFAULT_PROMPT_LEN
    run.add_argument("--min-prompt-len", type=int, default=None, help=f"shortest prompt of mixed ({low})")
    run.add_argument("--max-prompt-len", type=int, default=None, help=f"longest prompt of mixed ({high})")
    run.add_argument("--max-new-tokens", type=int, default=RequestFlags.max_new_tokens)
    run.add_argument(
        "--temperature",
        type=float,
        default=RequestFlags.temperature,
        help="sampling temperature of every request (0: greedy, the default); a --prompts line may "
        "set its own",
    )
    run.add_argument(
        "--top-p", type=float, default=RequestFlags.top_p, help="nucleus sampling: (0, 1], 1 off"
    )
    run.add_argument(
        "--top-k", type=int, default=RequestFlags.top_k, help="sample among the k likeliest (0: off)"
    )
    run.add_argument(
        "--ignore-eos", action="store_true", help="generate past the checkpoint's end-of-sequence ids"
    )
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
        default=None,  # None: on with the prefix cache (WorkerConfig.local_prefill), which keeps the states
        help="prefill a request on the decode worker holding the state its prompt extends, when the cost "
        "model says that beats moving the slot (README: conditional disaggregation; default: on, with "
        "the prefix cache)",
    )
    run.add_argument(
        "--local-prefill-max-tokens",
        default=None,
        metavar="N",
        help="new prompt tokens a decode worker may prefill for one request (default: the cost model's)",
    )
    run.add_argument(
        "--local-prefill-chunk",
        default=None,  # None: DEFAULT_LOCAL_PREFILL_CHUNK (given: conditional disaggregation, or --prefill 0)
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
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the workload's, and each request's sampling seed unless it has one",
    )
    run.add_argument("--json", default=None, metavar="PATH", help="write the summary as JSON")
    run.add_argument(
        "--outputs",
        default=None,
        metavar="PATH.jsonl",
        help="write each served request's prompt and output ids (and text, with the model's tokenizer)",
    )
    add_pool_arguments(run)
    add_model_impl_arguments(run)
    return run
