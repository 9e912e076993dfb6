"""The import graph is a DAG with the layers the README names, counting imports inside functions."""

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

PACKAGES = ("distpool", "prefill", "decode", "transfer")
ROOT = Path(__file__).resolve().parents[1]


def test_the_layers_contract_holds():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    done = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    edges = {m: graph.find_modules_directly_imported_by(m) & set(modules) for m in modules}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if _is_package_of(target, module):
                continue  # a module importing its own package's __init__ is not a cycle of modules
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in modules:
        if module not in state:
            visit(module, [module])
    assert cycles == []


def _is_package_of(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def test_the_decode_loop_never_imports_its_worker_even_for_types():
    """The loop reaches its worker through `LoopWorker` (a Protocol): no import chain leads from
    `decode.loop` back to `decode.worker`, `TYPE_CHECKING` imports counted."""
    # No cache: a cached graph built without type-only imports would be read back here.
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    assert graph.find_modules_that_directly_import("decode.loop") == {"decode.worker"}
    assert not graph.chain_exists(importer="decode.loop", imported="decode.worker")
