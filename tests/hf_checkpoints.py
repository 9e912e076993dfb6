"""transformers' own `generate` on the tiny checkpoints (`distpool.model_impl.hf.tiny`): the oracle
the runner's tokens are held against, written with transformers' API alone."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from distpool.model_impl.hf.tiny import TINY_CONFIGS as ARCHITECTURES
from distpool.model_impl.hf.tiny import VOCAB, save_checkpoint

__all__ = ["ARCHITECTURES", "VOCAB", "generate", "load_for_generate", "save_checkpoint", "save_tokenizer"]
# A word-level vocabulary inside the tiny models' VOCAB ids: <unk> 0, <s> 1 (added before every
# prompt, as a BOS token), then these words.
WORDS = (
    "the a cat dog sat on mat and ran to big small red blue house tree sun moon star sky sea fish "
    "bird runs jumps sleeps under over near far old new green white black"
).split()


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


def save_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer of `WORDS` (ids below VOCAB), built here and saved into `folder` as
    transformers saves one (tokenizer.json, tokenizer_config.json): nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
    assert len(vocab) <= VOCAB
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>")
    fast.save_pretrained(folder)
    return folder
