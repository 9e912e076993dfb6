"""Files a run writes (`--json`, `--outputs`): checked before Ray starts, written whole at the end.

A run takes minutes; a path it cannot write must be refused before it starts, not after it
finished. And an output must never replace one of the run's own inputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path


def check_output_path(path: str, flag: str, inputs: Mapping[str, str | Path | None]) -> Path:
    """`path` as given to `flag`, once it is known that a file can be written there; ValueError
    naming the flag and the fix otherwise. `inputs` maps the input flags (`--prompts`, `--model`)
    to the files they read: the output may be none of them.

    Refused: an input's own file (also through another spelling or a link), a folder, anything that
    is not a regular file (a device such as /dev/full, a pipe), a path under a regular file, and a
    folder where no file can be created (read-only, /proc). Missing folders are fine: they are made
    when the file is written.
    """
    target = Path(path)
    for input_flag, input_path in inputs.items():
        if input_path is not None and _same_file(target, Path(input_path)):
            raise ValueError(
                f"{flag} {path} is the file {input_flag} reads: writing it would destroy the input. "
                f"Fix: give {flag} another path"
            )
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder. Fix: name a file in it, e.g. {target / 'run.json'}")
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):
        raise ValueError(
            f"{flag} {path} is not a regular file (a device, pipe or socket). "
            f"Fix: name a file, or drop {flag}"
        )
    folder = target.parent
    while not folder.exists():  # the nearest existing folder is where the missing ones will be made
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a folder. Fix: give {flag} another path")
    try:  # a probe tells more than permission bits (root, read-only mounts, /proc)
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".distpool-probe-")
        os.close(handle)
        os.unlink(probe)
        if target.exists():
            with open(target, "ab"):
                pass
    except OSError as exc:
        raise ValueError(
            f"{flag} {path} cannot be written ({exc.strerror or exc}). Fix: give {flag} a writable path"
        ) from None
    return target


def write_json(path: str | Path, data: object) -> None:
    """Write `data` as indented JSON (`write_text`). Raises OSError."""
    write_text(path, json.dumps(data, indent=2))


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to a new file beside `path`, renamed over it once complete, so a failed write (a
    full disk) leaves no half file behind. Makes missing folders. Raises OSError."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with open(temporary, "x") as f:  # "x": the usual permissions, and never someone else's file
            f.write(text)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
