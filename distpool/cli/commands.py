"""What each `distpool` command does with its parsed flags (`distpool.cli.flags`): `check` sizes a
model's pools, `presets` lists the bundled models, `run` turns its flags into a deployment and serves.

A handler returns the exit status; bad input raises ValueError with the fix, before Ray starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from distpool.cli.describe_sizes import format_sizes
from distpool.cli.flags import pool_args_from
from distpool.cli.model_impl_flags import implementation_from
from distpool.memory.sizing import GIB, size_tp_pools
from distpool.model.eos import eos_token_ids
from distpool.model.presets import PresetRow, preset_rows, resolve_model
from distpool.model.spec import ENGINE_CONVENTION, TRANSFORMERS_CONVENTION
from distpool.model_impl.hf.tokenizer import find_tokenizer
from distpool.model_impl.select import compute_dtype
from distpool.serving.routing import ConditionalOptions
from distpool.serving.workloads import RequestFlags
from distpool.settings import Settings
from distpool.worker.config import DEFAULT_LOCAL_PREFILL_CHUNK, WorkerConfig
from transfer import TransferOptions
from transfer.defaults import MAX_CHUNK_BYTES
from transfer.faults import SENDER_ABORT

CONVENTION_WORDS = {
    ENGINE_CONVENTION: "a conv state of kernel - 1 columns, as SGLang and vLLM keep it",
    TRANSFORMERS_CONVENTION: "a conv state of kernel columns, as transformers' modeling code keeps it",
}


def _whole_tokens(value: str | None, flag: str) -> int | None:
    """A token count of at least 1 given as `flag` (None stays None); ValueError names the flag."""
    if value is None:
        return None
    if not value.isdecimal() or int(value) < 1:
        raise ValueError(f"{flag} must be a whole number of tokens, at least 1; got {value!r}")
    return int(value)


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


def format_presets(rows: list[PresetRow]) -> str:
    """The `distpool presets` table: one row per preset, then what its columns mean."""
    n, a = max(len(r.name) for r in rows), max(len(r.architecture) for r in rows)
    head = "kind          attention  mamba  slot MiB  transformers  KV KiB/token  dtypes"
    lines = [f"{'preset':{n}}  {'architecture':{a}}  {head}"]
    lines += [
        f"{r.name:{n}}  {r.architecture:{a}}  {r.kind:12}  {r.num_attention_layers:9}  "
        f"{r.num_mamba_layers:5}  {r.slot_bytes / (1 << 20):8.2f}  {_mib(r.transformers_slot_bytes):>12}  "
        f"{r.kv_bytes_per_token / (1 << 10):12.2f}  KV {r.kv_dtype}, SSM {r.ssm_dtype or '-'}"
        for r in rows
    ]
    lines += [
        "slot: one request's recurrent state, in the engine convention (a conv state of kernel - 1",
        "columns, as SGLang and vLLM keep it; see --kv-dtype, --ssm-dtype); transformers: the slot the",
        "transformers runner keeps in the same dtype (conv of kernel columns). KV: every attention layer.",
        "Pass the preset name to `distpool check NAME` or `distpool run --model NAME`.",
    ]
    return "\n".join(lines)


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 20):.2f}"


@dataclasses.dataclass(frozen=True)
class DeploymentPlan:
    """What `run` and `serve` start, from their shared flags, every refusal made before Ray starts."""

    spec: Any  # distpool.serving.deploy.deployment.DeploymentSpec
    address: str | None  # the Ray cluster to attach to; None: an embedded one
    config_path: Path  # the model's config.json (a preset's, or a checkpoint folder's)
    model_folder: Path | None  # the checkpoint folder, when the model is one
    conditional: ConditionalOptions


def plan_deployment(ns: argparse.Namespace, outputs: dict[str, str | None]) -> DeploymentPlan:
    """The deployment the flags describe, checked; `outputs` (flag -> path) are checked as outputs."""
    from distpool.serving.deploy import DeploymentSpec
    from distpool.serving.job import (
        check_cluster,
        check_distinct_outputs,
        check_fits_this_machine,
        check_output_path,
        default_budget_bytes,
    )
    from distpool.serving.metrics import validate_metrics_port

    if not 0.0 <= ns.fault_rate < 1.0:
        raise ValueError(f"--fault-rate must be in [0, 1); got {ns.fault_rate}")
    if ns.enable_unified_memory and ns.disable_unified_memory:
        raise ValueError("--enable-unified-memory and --disable-unified-memory contradict. Fix: keep one")
    settings = Settings.from_env()
    transfer = transfer_options(ns, settings)
    config_path = resolve_model(ns.model)
    # A checkpoint's folder (DIR/config.json) holds its weights and tokenizer: no output goes there.
    model_folder = config_path.parent if config_path.name == "config.json" else None
    for flag, path in outputs.items():
        if path is not None:
            inputs = {"--prompts": getattr(ns, "prompts", None), "--model": config_path}
            check_output_path(path, flag, inputs, {"--model": model_folder})
    check_distinct_outputs(outputs)
    impl = implementation_from(ns, ns.model, auto_transformers=True)
    model = impl.spec  # the transformers runner's: from the model's modules
    pool_args = pool_args_from(ns, None)
    num_ranks = ns.prefill * ns.prefill_tp + ns.decode * ns.decode_tp  # a process each, --memory-gib each
    budget = (
        int(ns.memory_gib * GIB)
        if ns.memory_gib is not None
        else default_budget_bytes(model, pool_args, impl.name, num_ranks)
    )
    if ns.prefill == 0:
        check_colocated_flags(ns)
    # Colocated, decode keeps finished requests' states (for a next turn) wherever the prefix cache is on.
    local_prefill = ns.prefix_cache if ns.prefill == 0 else conditional_disagg_from(ns)
    conditional = ConditionalOptions(
        max_tokens=_whole_tokens(ns.local_prefill_max_tokens, "--local-prefill-max-tokens"),
    )
    chunk = _whole_tokens(ns.local_prefill_chunk, "--local-prefill-chunk")
    worker = WorkerConfig(
        spec=model,
        local_prefill=local_prefill,
        local_prefill_chunk=DEFAULT_LOCAL_PREFILL_CHUNK if chunk is None else chunk,
        pool_args=pool_args,
        budget_bytes=budget,
        transfer=transfer,
        device=ns.device,
        seed=ns.seed,
        model_impl=impl.name,
        hf=impl.hf,
        eos_token_ids=eos_token_ids(config_path, model.vocab_size),
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
    return DeploymentPlan(spec, address, config_path, model_folder, conditional)


def cmd_run(ns: argparse.Namespace) -> int:
    # Imported here so that `distpool check` does not pay for importing Ray.
    from distpool.serving.job import run

    flags = RequestFlags(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RequestFlags)})
    plan = plan_deployment(ns, {"--json": ns.json, "--outputs": ns.outputs})
    config_path, worker = plan.config_path, plan.spec.worker
    tokenizer = find_tokenizer(config_path) if ns.prompts is not None or ns.outputs is not None else None
    requests = flags.requests_for(
        vocab_size=worker.spec.vocab_size, context_len=worker.pool_args.context_len, tokenizer=tokenizer
    )
    return run(
        plan.spec,
        requests,
        address=plan.address,
        num_cpus=ns.num_cpus,
        faults={SENDER_ABORT: ns.fault_rate},  # --fault-rate: transfers aborted mid-stream
        overlap_reservation=not ns.reserve_first,
        conditional=plan.conditional,
        seed=ns.seed,
        parity_sample=ns.parity_sample,
        json_path=ns.json,
        outputs_path=ns.outputs,
        detokenize=tokenizer.decode if tokenizer is not None else None,
        metrics_port=ns.metrics_port,
    )


def check_colocated_flags(ns: argparse.Namespace) -> None:
    """`--prefill 0` (colocated: each decode worker prefills its own requests) refuses the flags that
    steer prefill workers or transfers, which it has none of, rather than ignoring them."""
    given = {
        "--conditional-disagg": ns.conditional_disagg is True,
        "--no-conditional-disagg": ns.conditional_disagg is False,
        "--local-prefill-max-tokens": ns.local_prefill_max_tokens is not None,
        "--reserve-first": ns.reserve_first,
        "--fault-rate": ns.fault_rate > 0,
    }
    for flag, present in given.items():
        if present:
            raise ValueError(
                f"{flag} steers prefill workers or the transfers to decode, and --prefill 0 has neither: "
                "every request is prefilled on its decode worker. Fix: drop "
                f"{flag}, or run prefill workers (--prefill 1)"
            )


def conditional_disagg_from(ns: argparse.Namespace) -> bool:
    """`--conditional-disagg` as given, else on when the prefix cache is (only it keeps the states a
    local prefill extends); the flags that tune it are refused where it is off rather than ignored."""
    if ns.conditional_disagg and not ns.prefix_cache:
        raise ValueError(
            "--conditional-disagg prefills a later turn from the state its decode worker kept, and with "
            "--no-prefix-cache no state is kept: nothing would ever be prefilled there. Fix: drop one of them"
        )
    enabled = ns.conditional_disagg
    if enabled is None:
        enabled = ns.prefix_cache and WorkerConfig.local_prefill
    for flag, value in (
        ("--local-prefill-max-tokens", ns.local_prefill_max_tokens),
        ("--local-prefill-chunk", ns.local_prefill_chunk),
    ):
        if value is not None and not enabled:
            off = "--no-conditional-disagg" if ns.conditional_disagg is False else "--no-prefix-cache"
            raise ValueError(
                f"{flag} tunes conditional disaggregation, which {off} turns off. "
                f"Fix: drop {flag}, or drop {off}"
            )
    return enabled


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
