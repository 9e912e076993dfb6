"""A checkpoint's end-of-sequence ids: `generation_config.json` beside its `config.json` first (what
`generate` reads), else `config.json`'s own `eos_token_id`; an id or a list of ids, or none."""

from __future__ import annotations

import json
from pathlib import Path

from distpool.model.hf_fields import CANNOT_READ, ConfigInvalid, ConfigUnreadable


def eos_token_ids(config_path: str | Path, vocab_size: int) -> tuple[int, ...]:
    """The EOS ids of the model whose config.json is `config_path` (none when neither file names
    one); ConfigInvalid naming the file for ids that are not token ids of the vocabulary,
    ConfigUnreadable for a file that cannot be read."""
    config = Path(config_path)
    candidates = [config.with_name("generation_config.json")] if config.name == "config.json" else []
    for path in [*candidates, config]:
        if not path.is_file():
            continue
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigUnreadable(str(path), CANNOT_READ, str(exc)) from None
        value = fields.get("eos_token_id") if isinstance(fields, dict) else None
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise ConfigInvalid(
                str(path), "eos_token_id", value, f"a token id or a list of them in [0, {vocab_size})"
            )
        return tuple(dict.fromkeys(ids))
    return ()
