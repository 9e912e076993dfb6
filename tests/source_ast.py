"""Reading the project's source as ASTs, for the tests that check its shape (imports, cycles,
`assert` statements)."""

import ast
from pathlib import Path


def parse_source(source: str, filename: str = "<unknown>", attempts: int = 3) -> ast.Module:
    """`ast.parse`, again when CPython 3.11 reports "AST constructor recursion depth mismatch": its
    AST conversion keeps one depth counter per interpreter, and another thread converting an AST
    at the same time (3.11's traceback module parses each frame's line to place its carets, so any
    thread formatting a traceback does) corrupts it. The source was fine; a second parse is too."""
    for attempt in range(attempts):
        try:
            return ast.parse(source, filename=filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def parse(path: Path) -> ast.Module:
    """The AST of the file at `path` (`parse_source`)."""
    return parse_source(path.read_text(), filename=str(path))
