"""Typed reads from a Hugging Face config dict, and loading one from disk.

Every failure is a `ConfigInvalid` (a ValueError) naming the file (or "<dict>"), the field and its
value, or a `ConfigUnreadable` naming the file and what kept it from being read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distpool.facts import Facts

_MISSING = object()
NUM_LAYERS = ("num_hidden_layers", "num_layers", "n_layer")
# Every per-layer list is built only after its length is checked against this: the deepest public
# models have a few hundred layers, and 10**7 layers would cost minutes and gigabytes before any
# budget check could refuse them.
MAX_LAYERS = 10_000

# Why a config could not be read at all (`ConfigUnreadable.problem`).
NOT_A_CONFIG = "not_a_config"  # neither a dict nor a path
NO_SUCH_FILE = "no_such_file"
INVALID_JSON = "invalid_json"
NESTS_TOO_DEEPLY = "nests_too_deeply"
CANNOT_READ = "cannot_read"  # an OS or decoding error
NOT_AN_OBJECT = "not_an_object"  # the top level is not a JSON object


class ConfigInvalid(Facts, ValueError):
    """A config whose `field` (dotted inside a nested config, "layer_types[3]" for an entry; None: no
    one field) holds `value` where it must be `expected`, in the config at `source`. `message` says
    it in the config's own terms; by default "field F must be EXPECTED, got VALUE"."""

    def __init__(
        self, source: str, field: str | None, value: object, expected: str, message: str | None = None
    ) -> None:
        self.source, self.field, self.value, self.expected = source, field, value, expected
        self.message = message or f"field {field!r} must be {expected}, got {value!r}"
        super().__init__(f"{source}: {self.message}")


class ConfigFieldMissing(ConfigInvalid):
    """No spelling of a field the classifier needs is set: `field` and its other spellings
    (`alternatives`)."""

    def __init__(self, source: str, field: str, alternatives: tuple[str, ...] = ()) -> None:
        also = f" (nor {', '.join(alternatives)})" if alternatives else ""
        super().__init__(source, field, None, "set", f"missing field {field!r}{also}")
        self.alternatives = alternatives


class ConfigUnreadable(Facts, ValueError):
    """The config at `source` could not be read: `problem` (one of the names above); `detail` what
    the reader said (the JSON error, the OS error, the type found), or ""."""

    def __init__(self, source: str, problem: str, detail: str = "") -> None:
        texts = {
            NOT_A_CONFIG: "not a dict, a config.json path or a directory holding one",
            NO_SUCH_FILE: "no such file",
            INVALID_JSON: f"invalid JSON ({detail})",
            NESTS_TOO_DEEPLY: "the JSON nests too deeply to be a model config",
            CANNOT_READ: f"cannot read the config ({detail})",
            NOT_AN_OBJECT: f"the top level must be a JSON object, got {detail}",
        }
        super().__init__(f"{source}: {texts.get(problem, problem)}")
        self.source, self.problem, self.detail = source, problem, detail


class ConfigFields:
    """Typed reads from one config dict; every failure is a `ConfigInvalid` naming the file and the field.

    Reads take alternative spellings in order. `defaults` (the family's transformers defaults) are
    used only when none of the spellings is set in the config.
    """

    def __init__(
        self, data: Mapping[str, Any], source: str, prefix: str = "", defaults: Mapping | None = None
    ):
        self.data, self.source, self.prefix, self.defaults = data, source, prefix, defaults or {}

    def error(
        self, field: str | None, value: object, expected: str, message: str | None = None
    ) -> ConfigInvalid:
        """`field` (unprefixed; None: no one field) of this config holds `value`, not `expected`."""
        return ConfigInvalid(
            self.source, None if field is None else self.name(field), value, expected, message
        )

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
            raise self.error(field, value, "an integer")
        if value < minimum:
            raise self.error(field, value, f"at least {minimum}")
        if maximum is not None and value > maximum:
            raise self.error(field, value, f"at most {maximum}")
        return value

    def int(self, *names: str, minimum: int = 1, maximum: int | None = None, default: Any = _MISSING) -> Any:
        found = self.find(*names)
        if found is not None:
            return self._int(found[0], found[1], minimum, maximum)
        if default is _MISSING:
            raise ConfigFieldMissing(self.source, self.name(names[0]), tuple(map(self.name, names[1:])))
        return default

    def num_layers(self, default: Any = _MISSING) -> Any:
        """The decoder layer count (`NUM_LAYERS` spellings), at most MAX_LAYERS."""
        return self.int(*NUM_LAYERS, maximum=MAX_LAYERS, default=default)

    def text(self, *names: str) -> str | None:
        found = self.find(*names)
        if found is not None and not isinstance(found[1], str):
            raise self.error(found[0], found[1], "a string")
        return None if found is None else found[1]

    def flag(self, name: str, default: bool) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, value, "true or false")
        return value

    def seq(self, name: str) -> list[Any]:
        """A list of at most MAX_LAYERS entries (config lists are per layer, or shorter)."""
        value = self.data.get(name)
        if not isinstance(value, list):
            raise self.error(name, value, "a list")
        if len(value) > MAX_LAYERS:
            message = f"field {self.name(name)!r} has {len(value)} entries; at most {MAX_LAYERS}"
            raise self.error(name, len(value), f"at most {MAX_LAYERS} entries", message)
        return value

    def int_list(self, name: str, minimum: int = 0) -> list[int]:
        return [self._int(f"{name}[{i}]", v, minimum) for i, v in enumerate(self.seq(name))]

    def sub(self, name: str) -> ConfigFields:
        value = self.data.get(name)
        if not isinstance(value, dict):
            raise self.error(name, value, "an object")
        return ConfigFields(value, self.source, f"{self.name(name)}.")


def load_config(config: Mapping[str, Any] | str | Path) -> tuple[Mapping[str, Any], str]:
    if isinstance(config, Mapping):
        return config, "<dict>"
    if not isinstance(config, (str, Path)):
        raise ConfigUnreadable(f"<{type(config).__name__}>", NOT_A_CONFIG)
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigUnreadable(str(path), NO_SUCH_FILE) from None
    except json.JSONDecodeError as exc:
        detail = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        raise ConfigUnreadable(str(path), INVALID_JSON, detail) from None
    except RecursionError:
        raise ConfigUnreadable(str(path), NESTS_TOO_DEEPLY) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigUnreadable(str(path), CANNOT_READ, str(exc)) from None
    if not isinstance(data, dict):
        raise ConfigUnreadable(str(path), NOT_AN_OBJECT, type(data).__name__)
    return data, str(path)
