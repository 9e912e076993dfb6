"""Files a run writes (`--json`, `--outputs`): checked before Ray starts, written whole at the end.

A run takes minutes; a path it cannot write must be refused before it starts, not after it
finished. And an output must never replace one of the run's own inputs, a file of the model's
folder, the other output, or anything of the system's own folders (/dev, /proc, /sys).

How a path is written (`write_text`): a character device or a pipe (`/dev/stdout`, `/dev/null`, a
fifo) and a file reached through /dev or /proc (`/dev/stdout` of a run whose output goes to a file)
are written to directly, appended to and never replaced; any other path through its links to the
file they name, as a new file renamed over it once complete (the link stays a link).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

SYSTEM_FOLDERS = (Path("/dev"), Path("/proc"), Path("/sys"))  # nothing is created or replaced there


def check_output_path(
    path: str,
    flag: str,
    inputs: Mapping[str, str | Path | None],
    input_folders: Mapping[str, Path | None] | None = None,
) -> Path:
    """`path` as given to `flag`, once it is known that a file can be written there; ValueError
    naming the flag and the fix otherwise. `inputs` maps the input flags (`--prompts`, `--model`)
    to the files they read, `input_folders` to the folders they read (a checkpoint's): the output
    may be none of those files and lie in none of those folders (through any spelling or link).

    Refused: an input's own file, a path inside an input's folder, a folder, a socket or block
    device, a path under a regular file, a folder where no file can be created (read-only), and
    under /dev, /proc and /sys anything but an existing character device, pipe, or a file elsewhere
    that a link there names. Missing folders are fine: they are made when the file is written.
    """
    target = Path(path)
    for input_flag, input_path in inputs.items():
        if input_path is not None and _same_file(target, Path(input_path)):
            raise ValueError(
                f"{flag} {path} is the file {input_flag} reads: writing it would destroy the input. "
                f"Fix: give {flag} another path"
            )
    for input_flag, folder in (input_folders or {}).items():
        if folder is not None and _inside(target, folder):
            raise ValueError(
                f"{flag} {path} lies in {folder}, the model folder {input_flag} reads: writing there could "
                f"replace the checkpoint's files. Fix: give {flag} a path outside it"
            )
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder. Fix: name a file in it, e.g. {target / 'run.json'}")
    if is_stream(target):  # written as it is (the probe below would block on a pipe without a reader)
        if not os.access(target, os.W_OK):
            raise ValueError(
                f"{flag} {path} cannot be written (permission denied). Fix: give {flag} another path"
            )
        return target
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):
        raise ValueError(
            f"{flag} {path} is neither a regular file nor a character device or pipe (a socket or a "
            f"block device). Fix: name a file, or drop {flag}"
        )
    real = Path(os.path.realpath(target))
    if _in_system_folder(real) or (_in_system_folder(_absolute(target)) and not target.exists()):
        raise ValueError(
            f"{flag} {path}: under /dev, /proc and /sys only an existing device or pipe is written "
            f"(nothing is created or replaced there). Fix: give {flag} a path elsewhere"
        )
    folder = real.parent
    while not folder.exists():  # the nearest existing folder is where the missing ones will be made
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a folder. Fix: give {flag} another path")
    try:  # a probe tells more than permission bits (root, read-only mounts)
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


def check_distinct_outputs(paths: Mapping[str, str | None]) -> None:
    """Two output flags (`--json`, `--outputs`) may not name one file (through any spelling or
    link): the second would replace the first. A device or pipe takes both."""
    given = [(flag, Path(path)) for flag, path in paths.items() if path is not None]
    for i, (flag_a, a) in enumerate(given):
        for flag_b, b in given[i + 1 :]:
            if is_stream(a) or is_stream(b):
                continue
            if os.path.realpath(a) == os.path.realpath(b) or _same_file(a, b):
                raise ValueError(
                    f"{flag_a} {a} and {flag_b} {b} are the same file: one would replace the other. "
                    f"Fix: give {flag_b} another path"
                )


def is_stream(path: Path) -> bool:
    """Whether `path` (through its links) is a character device or a pipe: written as it is."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def write_json(path: str | Path, data: object) -> None:
    """Write `data` as indented JSON (`write_text`). Raises OSError."""
    write_text(path, json.dumps(data, indent=2))


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path`. A device, a pipe or a file reached through /dev or /proc is appended
    to as it is; any other path is written through its links, to a new file beside the file they
    name, renamed over it once complete, so a failed write (a full disk) leaves no half file
    behind. Makes missing folders. Never creates or replaces anything under /dev, /proc or /sys.
    Raises OSError."""
    given = Path(path)
    if is_stream(given) or _in_system_folder(_absolute(given)):
        # no O_CREAT: a missing device is an error, never a new file
        with open(os.open(given, os.O_WRONLY | os.O_APPEND), "w", closefd=True) as f:
            f.write(text)
        return
    target = Path(os.path.realpath(given))  # a link stays a link: its target gets the text
    if _in_system_folder(target):
        raise PermissionError(f"{path} names {target}: nothing under /dev, /proc or /sys is replaced")
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


def _absolute(path: Path) -> Path:
    """`path` absolute, `..` taken as written (links not followed)."""
    return Path(os.path.abspath(path))


def _in_system_folder(path: Path) -> bool:
    return any(path.is_relative_to(folder) for folder in SYSTEM_FOLDERS)


def _inside(target: Path, folder: Path) -> bool:
    """Whether `target`, as written or through its links, lies in `folder` (also as written or
    through its links), or is one of the files the folder's entries link to (a Hugging Face cache's
    snapshot links its files to blobs elsewhere)."""
    folders = {_absolute(folder), Path(os.path.realpath(folder))}
    spellings = {_absolute(target), Path(os.path.realpath(target))}
    if any(s.is_relative_to(f) for s in spellings for f in folders):
        return True
    real = Path(os.path.realpath(target))
    with contextlib.suppress(OSError):
        return any(Path(os.path.realpath(entry)) == real for entry in Path(folder).iterdir())
    return False


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
