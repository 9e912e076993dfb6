"""The import graph is a DAG with the layers the README names, counting imports inside functions and
under `TYPE_CHECKING`: a type-only import that closes a loop is still a loop."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

from tests.source_ast import parse_source

PACKAGES = ("distpool", "prefill", "decode", "transfer")
ROOT = Path(__file__).resolve().parents[1]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    return subprocess.run([lint, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_layers_contract_holds():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_subpackage_contracts_refuse_an_import_upwards_and_an_unlisted_module(tmp_path):
    for name in (*PACKAGES, "pyproject.toml"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, tmp_path / name)
    with open(tmp_path / "transfer" / "wire" / "failure.py", "a") as f:
        f.write("import transfer.ends.handle  # noqa: E402\n")
    with open(tmp_path / "distpool" / "serving" / "routing" / "router.py", "a") as f:
        f.write("import distpool.serving.path.driver  # noqa: E402\n")
    (tmp_path / "distpool" / "memory" / "unlisted.py").write_text("")
    out = lint_imports(tmp_path).stdout
    assert out.count(" BROKEN") == 3, out[-3000:]
    assert "transfer.wire.failure -> transfer.ends.handle" in out
    assert "distpool.serving.routing.router -> distpool.serving.path.driver" in out
    assert "- distpool.memory.unlisted" in out


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(sources: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    """module -> the modules it imports anywhere in its source (`TYPE_CHECKING` blocks and functions
    included), given each module's source; `packages` are the modules that are packages."""
    edges: dict[str, set[str]] = {}
    for module, source in sources.items():
        here = module if module in packages else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(parse_source(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else base
                    for alias in node.names
                ]
            else:
                continue
            for name in names:
                while name and name not in sources:  # `import a.b.c` of a name inside a module
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    targets.add(name)  # a module importing its own package's __init__ is no loop
        edges[module] = targets
    return edges


def cycles_of(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return found


def test_a_type_only_import_that_closes_a_loop_is_a_cycle():
    sources = {
        "pkg": "",
        "pkg.a": "from pkg.b import B\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "pkg.c": "from . import a\n",
    }
    assert cycles_of(import_edges(sources, {"pkg"})) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_no_module_imports_itself_through_others():
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    sources = {module_name(p, ROOT): p.read_text() for p in paths}
    packages = {module_name(p, ROOT) for p in paths if p.name == "__init__.py"}
    assert cycles_of(import_edges(sources, packages)) == []


def test_the_decode_loop_never_imports_its_worker_even_for_types():
    """The loop reaches its worker through `LoopWorker` (a Protocol): no import chain leads from
    `decode.loop` back to `decode.worker`, `TYPE_CHECKING` imports counted."""
    # No cache: a cached graph built without type-only imports would be read back here.
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    assert graph.find_modules_that_directly_import("decode.loop") == {"decode.worker"}
    assert not graph.chain_exists(importer="decode.loop", imported="decode.worker")
