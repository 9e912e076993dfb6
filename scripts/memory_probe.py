"""Peak memory of every process of one `distpool run`: the driver and each Ray worker it starts.

Runs `python -m distpool run ARGS...` and, every 0.2 s until it exits, reads the kernel's peak
resident set (VmHWM) of the driver and of every process descending from it (the embedded cluster's
Ray processes, the prefill and decode workers among them). Prints one line per process (peak RSS in
MB, its name) and the sum over the driver and the workers, next to what `distpool run` counted for
them before starting (`--memory-gib` and the rest; README, "Memory a run takes").

    .venv/bin/python scripts/memory_probe.py --json out/memory.json -- --model nemotron-h-56b --memory-gib 2

Only the embedded cluster is measured (a cluster's workers run elsewhere).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

POLL_S = 0.2
NAMES = ("ray::PrefillWorker", "ray::DecodeWorker")


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone meanwhile
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"


def probe(argv: list[str]) -> tuple[int, dict[int, tuple[str, int]], str]:
    """(exit status, pid -> (name, peak RSS bytes), the run's output)."""
    command = [sys.executable, "-m", "distpool", "run", *argv]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, tuple[str, int]] = {}
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        stack = [proc.pid]
        while stack:
            pid = stack.pop()
            stack += _children(pid)
            status = _status(pid)
            if "VmHWM" in status:
                name = "driver" if pid == proc.pid else _name(pid)
                peak = int(status["VmHWM"].split()[0]) * 1024
                peaks[pid] = (name, max(peak, peaks.get(pid, (name, 0))[1]))
        time.sleep(POLL_S)
    reader.join(timeout=10)
    return proc.returncode, peaks, "".join(output)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, help="after --: the arguments of distpool run")
    args = parser.parse_args()
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    status, peaks, output = probe(run_args)
    print(output[-3000:])
    rows = sorted(peaks.values(), key=lambda row: -row[1])
    counted = [(name, peak) for name, peak in rows if name == "driver" or name.startswith(NAMES)]
    for name, peak in counted:
        print(f"{peak / 1e6:>10.0f} MB  {name}")
    total = sum(peak for _, peak in counted)
    others = sum(peak for name, peak in rows if (name, peak) not in counted)
    print(f"{total / 1e6:>10.0f} MB  driver and workers (peak RSS each, summed)")
    print(f"{others / 1e6:>10.0f} MB  Ray's own processes")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        result = {"run_args": run_args, "exit_status": status, "processes": [list(r) for r in rows]}
        path.write_text(json.dumps(result | {"driver_and_workers_bytes": total}, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
