"""End to end: an outsider hits every port the workers listen on while `distpool run` serves."""

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

from transfer.protocol import bell_key, generation_counter_key, reply_key

pytestmark = pytest.mark.ray


def worker_ports() -> set[int]:
    """TCP ports that prefill and decode worker processes listen on now."""
    pids = subprocess.run(["pgrep", "-f", "ray::(Prefill|Decode)Worker"], capture_output=True, text=True)
    wanted = set(pids.stdout.split())
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
        store.add(generation_counter_key("prefill-0->decode-0"), 1)
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
    attacked, stores = set(), set()
    stop = threading.Event()

    def attack_and_note(port: int) -> None:
        if attack(port):
            stores.add(port)

    def attacker() -> None:  # every port at once, round after round, until the run ends
        while not stop.is_set():
            ports = worker_ports()
            attacked.update(ports)
            threads = [threading.Thread(target=attack_and_note, args=(p,), daemon=True) for p in ports]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=10)
            time.sleep(0.05)

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    try:
        output, _ = run.communicate(timeout=240)
    finally:
        stop.set()
        run.kill()
    thread.join(timeout=30)
    report = json.loads(out.read_text())
    assert run.returncode == 0, output.decode()[-3000:]
    assert (report["completed"], report["failed"]) == (160, 0)
    assert (report["leaked_pages"], report["leaked_slots"], report["parity_mismatches"]) == (0, 0, 0)
    assert stores, f"the attack never reached a rendezvous store (ports tried: {sorted(attacked)})"
