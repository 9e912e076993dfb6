"""The subpackages of memory, transfer and serving are used through their `__init__`: code outside a
subpackage imports only the names its `__all__` lists, never one of its modules (tests and scripts,
which test and measure the parts, may reach inside)."""

import ast
import importlib
from pathlib import Path

import pytest

from tests.source_ast import parse

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = ("distpool.memory", "transfer", "distpool.serving")
CODE_DIRS = ("distpool", "decode", "prefill", "transfer")


def subpackages_of(container: str) -> list[str]:
    folder = ROOT.joinpath(*container.split("."))
    return sorted(f"{container}.{p.parent.name}" for p in folder.glob("*/__init__.py"))


SUBPACKAGES = [sub for container in CONTAINERS for sub in subpackages_of(container)]


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of each absolute import in `path`, inside functions too."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_each_container_has_subpackages():
    assert {container: len(subpackages_of(container)) >= 4 for container in CONTAINERS} == dict.fromkeys(
        CONTAINERS, True
    )


def test_code_outside_a_subpackage_imports_only_what_its_init_names():
    exported = {sub: set(importlib.import_module(sub).__all__) for sub in SUBPACKAGES}
    wrong = []
    for path in sorted(p for folder in CODE_DIRS for p in (ROOT / folder).rglob("*.py")):
        home = module_of(path)
        for module, names in imports_of(path):
            for sub in SUBPACKAGES:
                if not (module == sub or module.startswith(sub + ".")) or home.startswith(sub + "."):
                    continue
                if module != sub:
                    wrong.append(f"{path.relative_to(ROOT)}: imports {module} (use {sub})")
                wrong.extend(
                    f"{path.relative_to(ROOT)}: {name} is not in {sub}.__all__"
                    for name in names
                    if name not in exported[sub]
                )
    assert wrong == []


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_each_name_an_init_lists_is_there(sub):
    package = importlib.import_module(sub)
    assert package.__all__ == sorted(package.__all__)
    assert [name for name in package.__all__ if not hasattr(package, name)] == []
    modules = {p.stem for p in Path(package.__file__).parent.glob("*.py")}
    assert sorted(modules & set(package.__all__)) == []  # a name that would hide a module of it
