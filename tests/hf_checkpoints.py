"""transformers' own `generate` on the tiny checkpoints (`distpool.model_impl.hf.tiny`): the oracle
the runner's tokens are held against, written with transformers' API alone."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from distpool.model_impl.hf.tiny import TINY_CONFIGS as ARCHITECTURES
from distpool.model_impl.hf.tiny import VOCAB, save_checkpoint

__all__ = ["ARCHITECTURES", "VOCAB", "generate", "load_for_generate", "save_checkpoint"]


def load_for_generate(folder: Path, dtype: torch.dtype = torch.float64):
    """The checkpoint as `generate` runs it: transformers' SDPA attention, its own cache."""
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **experts)
    model.generation_config.eos_token_id = None  # every requested token, as a served request gets
    return model.eval()


def generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate`: the ids after `prompt`."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()
