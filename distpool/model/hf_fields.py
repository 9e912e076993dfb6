"""Typed reads from a Hugging Face config dict, and loading one from disk.

Every failure is a ValueError naming the file (or "<dict>") and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_MISSING = object()
NUM_LAYERS = ("num_hidden_layers", "num_layers", "n_layer")
# Every per-layer list is built only after its length is checked against this: the deepest public
# models have a few hundred layers, and 10**7 layers would cost minutes and gigabytes before any
# budget check could refuse them.
MAX_LAYERS = 10_000


class ConfigValueOutOfRange(ValueError):
    """Config `source`'s integer field `field` holds `value`, below `minimum` or above `maximum`
    (None: no upper bound)."""

    def __init__(self, source: str, field: str, value: int, minimum: int, maximum: int | None) -> None:
        if value < minimum:
            super().__init__(f"{source}: field {field!r} must be at least {minimum}, got {value}")
        else:
            super().__init__(f"{source}: field {field!r} must be at most {maximum}, got {value}")
        self.source, self.field, self.value, self.minimum, self.maximum = (
            source,
            field,
            value,
            minimum,
            maximum,
        )

    def __reduce__(self):
        return type(self), (self.source, self.field, self.value, self.minimum, self.maximum)


class ConfigListTooLong(ValueError):
    """Config `source`'s per-layer field `field` has `length` `unit` ("entries" of a list, "layers"
    of a pattern string), more than `limit` (MAX_LAYERS)."""

    def __init__(self, source: str, field: str, length: int, limit: int, unit: str) -> None:
        super().__init__(f"{source}: field {field!r} has {length} {unit}; at most {limit}")
        self.source, self.field, self.length, self.limit, self.unit = source, field, length, limit, unit

    def __reduce__(self):
        return type(self), (self.source, self.field, self.length, self.limit, self.unit)


class ConfigFields:
    """Typed reads from one config dict; every failure is a ValueError naming the file and the field.

    Reads take alternative spellings in order. `defaults` (the family's transformers defaults) are
    used only when none of the spellings is set in the config.
    """

    def __init__(
        self, data: Mapping[str, Any], source: str, prefix: str = "", defaults: Mapping | None = None
    ):
        self.data, self.source, self.prefix, self.defaults = data, source, prefix, defaults or {}

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def name(self, field: str) -> str:
        return f"{self.prefix}{field}"

    def has(self, *names: str) -> bool:
        """Whether the config itself sets (not null) one of `names`."""
        return any(self.data.get(n) is not None for n in names)

    def find(self, *names: str) -> tuple[str, Any] | None:
        """The first of `names` set in the config; the family default only when none is even listed
        (an explicit null, as in transformers, turns the field off)."""
        for n in names:
            if self.data.get(n) is not None:
                return n, self.data[n]
        if any(n in self.data for n in names):
            return None
        return next(((n, self.defaults[n]) for n in names if self.defaults.get(n) is not None), None)

    def _int(self, field: str, value: Any, minimum: int, maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"field {self.name(field)!r} must be an integer, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise ConfigValueOutOfRange(self.source, self.name(field), value, minimum, maximum)
        return value

    def int(self, *names: str, minimum: int = 1, maximum: int | None = None, default: Any = _MISSING) -> Any:
        found = self.find(*names)
        if found is not None:
            return self._int(found[0], found[1], minimum, maximum)
        if default is _MISSING:
            also = f" (nor {', '.join(self.name(n) for n in names[1:])})" if names[1:] else ""
            raise self.error(f"missing field {self.name(names[0])!r}{also}")
        return default

    def num_layers(self, default: Any = _MISSING) -> Any:
        """The decoder layer count (`NUM_LAYERS` spellings), at most MAX_LAYERS."""
        return self.int(*NUM_LAYERS, maximum=MAX_LAYERS, default=default)

    def text(self, *names: str) -> str | None:
        found = self.find(*names)
        if found is not None and not isinstance(found[1], str):
            raise self.error(f"field {self.name(found[0])!r} must be a string, got {found[1]!r}")
        return None if found is None else found[1]

    def flag(self, name: str, default: bool) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field {self.name(name)!r} must be true or false, got {value!r}")
        return value

    def seq(self, name: str) -> list[Any]:
        """A list of at most MAX_LAYERS entries (config lists are per layer, or shorter)."""
        value = self.data.get(name)
        if not isinstance(value, list):
            raise self.error(f"field {self.name(name)!r} must be a list, got {value!r}")
        if len(value) > MAX_LAYERS:
            raise ConfigListTooLong(self.source, self.name(name), len(value), MAX_LAYERS, "entries")
        return value

    def int_list(self, name: str, minimum: int = 0) -> list[int]:
        return [self._int(f"{name}[{i}]", v, minimum) for i, v in enumerate(self.seq(name))]

    def sub(self, name: str) -> ConfigFields:
        value = self.data.get(name)
        if not isinstance(value, dict):
            raise self.error(f"field {self.name(name)!r} must be an object, got {value!r}")
        return ConfigFields(value, self.source, f"{self.name(name)}.")


def load_config(config: Mapping[str, Any] | str | Path) -> tuple[Mapping[str, Any], str]:
    if isinstance(config, Mapping):
        return config, "<dict>"
    if not isinstance(config, (str, Path)):
        raise ValueError(
            f"<{type(config).__name__}>: pass a dict, a config.json path or a directory holding one"
        )
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; pass a config.json or the directory holding one") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:
        raise ValueError(f"{path}: the JSON nests too deeply to be a model config") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the config ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a JSON object, got {type(data).__name__}")
    return data, str(path)
