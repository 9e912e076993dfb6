"""Memory's subpackages are used through their `__init__`: code outside a subpackage imports only
the names its `__all__` lists, never one of its modules (tests may reach inside)."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("sizing", "arena", "alloc", "prefix")
CODE_DIRS = ("distpool", "decode", "prefill", "transfer", "scripts")


def memory_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of each `distpool.memory...` import in `path`, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return [(module, names) for module, names in found if module.startswith("distpool.memory.")]


def subpackage_of(path: Path) -> str | None:
    parts = path.relative_to(ROOT).parts
    return parts[2] if parts[:2] == ("distpool", "memory") and len(parts) > 3 else None


def test_code_outside_a_subpackage_imports_only_what_its_init_names():
    exported = {sub: set(importlib.import_module(f"distpool.memory.{sub}").__all__) for sub in SUBPACKAGES}
    wrong = []
    for path in sorted(p for folder in CODE_DIRS for p in (ROOT / folder).rglob("*.py")):
        home = subpackage_of(path)
        for module, names in memory_imports(path):
            parts = module.split(".")
            sub = parts[2]
            if sub not in SUBPACKAGES or sub == home:
                continue
            if len(parts) > 3:
                wrong.append(f"{path.relative_to(ROOT)}: imports {module} (use distpool.memory.{sub})")
            wrong.extend(
                f"{path.relative_to(ROOT)}: {name} is not in distpool.memory.{sub}.__all__"
                for name in names
                if name not in exported[sub]
            )
    assert wrong == []


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_each_name_an_init_lists_is_there(sub):
    package = importlib.import_module(f"distpool.memory.{sub}")
    assert package.__all__ == sorted(package.__all__)
    assert [name for name in package.__all__ if not hasattr(package, name)] == []
