"""`--json` and `--outputs` (issue 34): never over a checkpoint's files or each other, written through
a link to its target, to a device or pipe as it is, and nothing under /dev, /proc or /sys replaced."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from distpool.serving.job.output import check_distinct_outputs, check_output_path, write_text
from tests.test_run_validation import no_ray, prompts_file, run_refused  # noqa: F401 (a fixture)


@pytest.mark.parametrize("file", ["model.safetensors", "tokenizer.json", "new.jsonl", "sub/new.json"])
@pytest.mark.parametrize("flag", ["--outputs", "--json"])
@pytest.mark.usefixtures("no_ray")
def test_no_output_goes_into_the_model_folder(capsys, tmp_path, hf_checkpoints, flag, file):
    """Regression: --outputs CKPT/model.safetensors replaced the weights, --json CKPT/tokenizer.json
    the tokenizer; only config.json was protected."""
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["bamba"], folder)
    (folder / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    link = tmp_path / "link.json"  # a link into the folder is the folder too
    link.symlink_to(folder / "tokenizer.json")
    for path in (folder / file, link):
        err = run_refused(
            capsys, "--model", str(folder), flag, str(path), "--prompts", str(prompts_file(tmp_path))
        )
        assert f"{flag} {path} lies in {folder}, the model folder --model reads" in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_hugging_face_cache_snapshots_linked_blobs_are_its_folder_too(tmp_path):
    blob, snapshot = tmp_path / "blobs" / "abc", tmp_path / "snapshots" / "1"
    blob.parent.mkdir()
    snapshot.mkdir(parents=True)
    blob.write_text("weights")
    (snapshot / "model.safetensors").symlink_to(blob)
    with pytest.raises(ValueError, match="lies in"):
        check_output_path(str(blob), "--json", {}, {"--model": snapshot})


@pytest.mark.parametrize("spelling", ["same", "dotdot", "link"])
@pytest.mark.usefixtures("no_ray")
def test_json_and_outputs_may_not_name_one_file(capsys, tmp_path, spelling):
    """Regression: --json P --outputs P was accepted; P held the outputs and the summary was lost."""
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "p.json"
    other = {
        "same": path,
        "dotdot": tmp_path / "d" / ".." / "d" / "p.json",
        "link": tmp_path / "link.json",
    }[spelling]
    if spelling == "link":
        other.symlink_to(path)  # a link to a file not made yet
    err = run_refused(capsys, "--json", str(path), "--outputs", str(other))
    assert f"--json {path} and --outputs {other} are the same file" in err


def test_a_device_takes_both_outputs():
    check_distinct_outputs({"--json": "/dev/null", "--outputs": "/dev/null"})


def test_a_link_is_written_through_to_its_target(tmp_path):
    """Regression: --json link.json turned the link into a file and left its target unchanged."""
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    assert check_output_path(str(link), "--json", {}) == link
    write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]  # no partial left


def test_a_pipe_and_a_character_device_are_written_as_they_are(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert check_output_path(str(fifo), "--outputs", {}) == fifo  # no probe: it would block without a reader
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    write_text(fifo, "through the pipe\n")
    assert reader.communicate(timeout=10)[0] == b"through the pipe\n"
    assert fifo.is_fifo()
    check_output_path("/dev/null", "--json", {})
    write_text("/dev/null", "gone")
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_dev_stdout_redirected_to_a_file_is_appended_to_and_never_replaced(tmp_path, monkeypatch):
    """Regression: --outputs /dev/stdout, run as root with stdout redirected to a file, replaced the
    machine's /dev/stdout link with a regular file. Checked in a child whose stdout is that file,
    on a stand-in for /dev (a test must not risk the machine's own): a folder counted as a system
    folder, holding `stdout` -> /proc/self/fd/1."""
    dev, log = tmp_path / "dev", tmp_path / "log.txt"
    dev.mkdir()
    (dev / "stdout").symlink_to("/proc/self/fd/1")
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from distpool.serving.job import output\n"
        "dev = Path(sys.argv[1])\n"
        "output.SYSTEM_FOLDERS = (*output.SYSTEM_FOLDERS, dev)\n"
        "print('summary', flush=True)\n"
        "output.check_output_path('/proc/self/fd/1', '--outputs', {})\n"
        "output.write_text(dev / 'stdout', 'outputs\\n')\n"
        "output.write_text('/proc/self/fd/1', 'more\\n')\n"
        "sys.stderr.write(str(os.path.islink(dev / 'stdout')))\n"
    )
    with open(log, "w") as out:
        child = subprocess.run(
            [sys.executable, "-c", code, str(dev)], stdout=out, stderr=subprocess.PIPE, timeout=60
        )
    assert child.returncode == 0, child.stderr.decode()
    assert child.stderr.decode().endswith("True")  # the link is still a link
    assert log.read_text() == "summary\noutputs\nmore\n"
    assert sorted(p.name for p in dev.iterdir()) == ["stdout"]


@pytest.mark.parametrize("path", ["/dev/x.json", "/proc/self/x.json", "/sys/x.json", "/proc/self/status"])
def test_nothing_is_created_or_replaced_under_dev_proc_or_sys(path):
    with pytest.raises(ValueError, match="under /dev, /proc and /sys only an existing device or pipe"):
        check_output_path(path, "--json", {})
    with pytest.raises(OSError):
        write_text(path, "x")
    assert not os.path.exists(path) or path == "/proc/self/status"


def test_a_link_to_a_system_file_is_refused(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to("/proc/self/status")
    with pytest.raises(ValueError, match="under /dev, /proc and /sys"):
        check_output_path(str(link), "--json", {})
    with pytest.raises(PermissionError):
        write_text(link, "x")
