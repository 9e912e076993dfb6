"""What pyproject.toml declares of a dependency's versions, and the range a set of checked releases spans:
the version tests of the modules that use a dependency's private API hold the two equal."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def declared_range(distribution: str) -> str:
    """The specifier pyproject.toml's dependencies give `distribution`, as written (">=5.23,<5.25")."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(rf'^\s*"{re.escape(distribution)}([<>=!~][^"]*)",', text, re.MULTILINE)
    assert found is not None, f"pyproject.toml declares no version range of {distribution}"
    return found[1]


def range_of(releases: tuple[tuple[int, int], ...]) -> str:
    """The specifier that admits exactly `releases`, consecutive (major, minor) pairs of one major:
    ((5, 23), (5, 24)) -> ">=5.23,<5.25"."""
    first, last = min(releases), max(releases)
    assert sorted(releases) == [(first[0], minor) for minor in range(first[1], last[1] + 1)], releases
    return f">={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}"


def release_of(version: str) -> tuple[int, int]:
    """(major, minor) of an installed version ("2.13.0+cpu" -> (2, 13))."""
    found = re.match(r"(\d+)\.(\d+)", version)
    assert found is not None, version
    return int(found[1]), int(found[2])
