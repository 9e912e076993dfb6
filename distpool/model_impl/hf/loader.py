"""Building the transformers model of an `HFSource`: real weights from safetensors (offline), seeded
dummy weights, or an empty model on the meta device whose modules size the pools."""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from distpool.model.dtypes import torch_dtype
from distpool.model_impl.hf.checkpoint import CONFIG_REJECTED, CheckpointError
from distpool.model_impl.hf.source import HFSource


def load_config(path: str | Path) -> PretrainedConfig:
    """The transformers config of a model folder or a config file, never from the network;
    CheckpointError when transformers' validation rejects it."""
    path = Path(path)
    try:
        if path.is_dir():
            return AutoConfig.from_pretrained(path, local_files_only=True)
        config_dict, _ = PretrainedConfig.get_config_dict(str(path), local_files_only=True)
        return AutoConfig.for_model(**config_dict)
    except StrictDataclassError as exc:  # transformers' own validation of the config's fields
        what = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise CheckpointError(
            path / "config.json" if path.is_dir() else path,
            f"transformers rejects it: {what}",
            kind=CONFIG_REJECTED,
        ) from None


def _build_kwargs(dtype: torch.dtype, attention: str) -> dict:
    # The grouped-matmul experts refuse float64; the eager loop computes any dtype.
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return {"dtype": dtype, "attn_implementation": attention, **experts}


def load_model(source: HFSource, *, device: torch.device | str, seed: int, attention: str) -> PreTrainedModel:
    """The model `source` names, in its dtype, on `device`, in eval mode, with `attention` as every
    attention module's function. Dummy weights depend only on the config, `seed` and the dtype."""
    dtype = torch_dtype(source.dtype)
    kwargs = _build_kwargs(dtype, attention)
    hf_logging.disable_progress_bar()  # a worker's log and the run's summary, not a progress bar per load
    if source.load_format == "safetensors":
        model = AutoModelForCausalLM.from_pretrained(
            source.path, local_files_only=True, use_safetensors=True, **kwargs
        )
    else:
        config = load_config(source.path)
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.to(device).eval()


def empty_model(source: HFSource, attention: str = "sdpa") -> PreTrainedModel:
    """The model's modules on the meta device: shapes and attributes, no memory, no weights read."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            load_config(source.path), **_build_kwargs(torch_dtype(source.dtype), attention)
        )


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes of the model's parameters and buffers (tied weights once): what each copy costs."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
