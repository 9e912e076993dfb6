"""The command-line flags of the model implementations (`--model-impl`, `--load-format`, `--dtype`),
shared by `distpool check` and `distpool run`, and their resolution into an `Implementation`."""

from __future__ import annotations

import argparse

from distpool.model.presets import resolve_model
from distpool.model_impl.errors import CacheDtypesUnused
from distpool.model_impl.hf.source import DTYPES, LOAD_FORMATS
from distpool.model_impl.select import MODEL_IMPLS, Implementation, resolve_implementation


def add_model_impl_arguments(parser: argparse.ArgumentParser) -> None:
    """What computes in the pools, shared by `check` (its sizes) and `run`."""
    parser.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default="auto",
        help="transformers (Hugging Face's modeling code, real or dummy weights), reference (the bundled "
        "reference model), synthetic (any config at its true sizes, every byte verified), or auto: "
        "transformers for a folder of safetensors weights of a supported architecture, else reference "
        "when it can run the config, else synthetic (check: never transformers unless asked)",
    )
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="transformers runner: safetensors from the model folder, or dummy (seeded random weights)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="transformers runner: compute, KV and state dtype (auto: the checkpoint's; float32 for "
        "bfloat16 on a CPU)",
    )


def implementation_from(ns: argparse.Namespace, config: str, *, auto_transformers: bool) -> Implementation:
    """`--model-impl`, `--load-format` and `--dtype` resolved for `config` (a preset, file or folder).
    Refusals are typed (`CheckpointError`, `CacheDtypesUnused`, those of `resolve_implementation`);
    `distpool.cli.errors` words them."""
    on_cpu = ns.device == "cpu" or (ns.device == "auto" and not _cuda_available())
    impl = resolve_implementation(
        resolve_model(config),
        ns.model_impl,
        load_format=ns.load_format,
        dtype=ns.dtype,
        on_cpu=on_cpu,
        auto_transformers=auto_transformers,
    )
    if impl.hf is not None and (ns.kv_dtype or ns.ssm_dtype):
        raise CacheDtypesUnused(impl.hf.dtype, ns.kv_dtype, ns.ssm_dtype)
    return impl


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
