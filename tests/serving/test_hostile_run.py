"""End to end: an outsider hits every port the workers listen on while `distpool run` serves.

The rendezvous stores exist only while the channels form, at startup: once requests flow, no worker
port answers as a store."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from transfer.wire.protocol import GENERATION_KEY, bell_key, reply_key

pytestmark = pytest.mark.ray


def worker_ports(run_pid: int) -> set[int]:
    """TCP ports that the prefill and decode workers of the run `run_pid` listen on now (not those
    of any other Ray cluster on this machine)."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    parent, workers = {}, set()
    for line in table.splitlines():
        pid, ppid, *args = line.split(None, 2)
        parent[pid] = ppid
        if re.search(r"ray::(Prefill|Decode)Worker", " ".join(args)):
            workers.add(pid)

    def in_run(pid: str) -> bool:
        while pid in parent and pid != "1":
            if pid == str(run_pid):
                return True
            pid = parent[pid]
        return False

    wanted = {pid for pid in workers if in_run(pid)}
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    ports = set()
    for line in listing.splitlines():
        if wanted & set(re.findall(r"pid=(\d+)", line)):
            ports.add(int(line.split()[3].rsplit(":", 1)[1]))
    return ports


def attack(port: int) -> bool:
    """Junk for whatever listens on `port`: store writes under the protocol's plain key names, then
    raw random bytes. Returns whether the port spoke the store's protocol."""
    spoke_store = False
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=1))
        for key in [bell_key(s) for s in range(8)] + [reply_key(s) for s in range(8)]:
            store.set(key, b"\x81\xa4kind\xa6header" + os.urandom(32))
        store.set(GENERATION_KEY, b"99")
        spoke_store = True
    except Exception:  # not a store (Ray's own servers), or it hung up on us: fine
        pass
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
            raw.sendall(os.urandom(2048))
    except OSError:
        pass
    return spoke_store


def test_hostile_outsider_on_every_worker_port_during_a_run(tmp_path):
    out = tmp_path / "run.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "distpool", "run", "--requests", "160", "--max-new-tokens", "24"]
    run = subprocess.Popen(
        [*cmd, "--json", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    attacked, stores, late_stores = set(), set(), set()
    serving, stop, lines = threading.Event(), threading.Event(), []

    def attack_and_note(port: int, late: bool) -> None:
        if attack(port):
            (late_stores if late else stores).add(port)

    def attacker() -> None:  # every port at once, round after round, until the run ends
        while not stop.is_set():
            late = serving.is_set()  # the channels formed before the first request was served
            ports = worker_ports(run.pid)
            attacked.update(ports)
            threads = [threading.Thread(target=attack_and_note, args=(p, late), daemon=True) for p in ports]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=10)
            time.sleep(0.05)

    def read_output() -> None:
        for line in iter(run.stdout.readline, b""):
            lines.append(line)
            if b"progress:" in line:
                serving.set()

    thread = threading.Thread(target=attacker, daemon=True)
    reader = threading.Thread(target=read_output, daemon=True)
    thread.start()
    reader.start()
    try:
        run.wait(timeout=240)
    finally:
        stop.set()
        run.kill()
    thread.join(timeout=30)
    reader.join(timeout=30)
    output = b"".join(lines).decode()
    report = json.loads(out.read_text())
    assert run.returncode == 0, output[-3000:]
    assert (report["completed"], report["failed"]) == (160, 0)
    assert (report["leaked_pages"], report["leaked_slots"], report["parity_mismatches"]) == (0, 0, 0)
    assert serving.is_set() and attacked, f"no worker port was attacked while serving:\n{output[-2000:]}"
    # Regression: the stores stayed up all run long, and any local process could fill a worker's
    # memory through them.
    assert not late_stores, f"stores answered while serving: {sorted(late_stores)}\n{output[-3000:]}"
