"""The runner's oracle: transformers' own `generate` (greedy, one prompt at a time, its own
`DynamicCache`, transformers' SDPA attention) on the same weights; none of our code computes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel

from distpool.model_impl.hf.loader import load_model
from distpool.model_impl.hf.source import HFSource


@dataclass(frozen=True)
class OracleTokens:
    """What `generate` produced for one prompt, and how sure it was at each step."""

    tokens: list[int]
    margins: list[float]  # per step: the gap between its two largest logits


def load_oracle(source: HFSource, *, seed: int) -> PreTrainedModel:
    """The checkpoint `source` names as `generate` runs it (dummy weights: the same seeded draw)."""
    model = load_model(source, device="cpu", seed=seed, attention="sdpa")
    # Every generated token counts: a model's end-of-sequence token does not stop the oracle early,
    # as it does not stop a served request.
    model.generation_config.eos_token_id = None
    return model


def greedy_generate(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int) -> OracleTokens:
    """`max_new_tokens` greedy tokens after `prompt`, with the top-2 logit margin of every step."""
    ids = torch.tensor([list(prompt)], device=model.device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.generation_config.pad_token_id,
    )
    with torch.no_grad():
        # The mask says every prompt token is real: left alone, generate takes a prompt token equal
        # to the pad id for padding.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, len(prompt) :].tolist()
    margins = [float(top[0] - top[1]) for top in (step[0].float().topk(2).values for step in out.logits)]
    if not len(tokens) == max_new_tokens == len(margins):
        raise RuntimeError(
            f"generate returned {len(tokens)} tokens and {len(margins)} logits "
            f"for max_new_tokens={max_new_tokens}"
        )
    return OracleTokens(tokens=tokens, margins=margins)
