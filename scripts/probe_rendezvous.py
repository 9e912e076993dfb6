"""An outsider against one channel: what it can write into the rank-0 (prefill) process, and for how long.

Two spawned processes hold the two ends of one channel (rank 0 hosts the rendezvous); this process
plays the outsider, who can reach the rank-0 port but holds no secret, and reads rank 0's resident
memory (VmRSS) as it goes:

  formed    after the channel formed: connect to the rendezvous port, set `--keys` keys of
            `--value-kib` KiB each (what grew the worker by ~550 MB when the store stayed up), and
            pour random bytes down raw connections to it
  rebuilds  `--rebuilds` reconnects of the channel, rank 1 arriving `--late-s` late each time (the
            store is open that long): the outsider writes as fast as it can, throughout
  listeners every other port rank 0 listens on (Gloo's) gets `--junk-mib` MiB of random bytes

Each phase reports the keys the outsider got in (the most it saw at once: `num_keys`), rank 0's
RSS growth at its peak and once the phase ended, and whether the port still listens. It drives only
the `transfer.Channel` API, so the same script measures any revision side by side.

    python scripts/probe_rendezvous.py --json out/probe_rendezvous.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from transfer import Channel  # noqa: E402
from transfer.connect.rendezvous import hold_socket, reserve_socket  # noqa: E402

SECRET = b"probe-rendezvous-secret-0123456789"
LAYOUT = {"page_size": 16}


def end_main(rank: int, port: int, conn, listener=None) -> None:
    """One end of the channel: connects on each "connect" command, answers with its outcome. Rank 0
    is handed the port's bound socket (`listener`), which its channel listens on."""
    if listener is not None:
        hold_socket(listener)
    channel = Channel(
        rank=rank,
        host="127.0.0.1",
        port=port,
        device="cpu",
        fingerprint="probe",
        layout=LAYOUT,
        timeout_s=30,
        secret=SECRET,
        name="probe",
    )
    while (command := conn.recv()) != "exit":
        late_s = command[1]
        time.sleep(late_s)
        try:
            channel.connect()
            conn.send("ok")
        except Exception as exc:  # reported to the driver of the probe
            conn.send(f"{type(exc).__name__}: {exc}")
    channel.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


def listening_ports(pid: int) -> set[int]:
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return {
        int(line.split()[3].rsplit(":", 1)[1])
        for line in listing.splitlines()
        if str(pid) in re.findall(r"pid=(\d+)", line)
    }


class Outsider:
    """Until stopped: sets keys into whatever store answers on `port`, and pours `value_bytes` of
    random bytes down a raw connection to it; notes what it got in."""

    def __init__(self, port: int, keys: int, value_bytes: int) -> None:
        self.port, self.keys, self.value = port, keys, os.urandom(value_bytes)
        self.most_keys, self.connections, self.sets, self.raw_bytes = 0, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1) as raw:
                    raw.settimeout(1.0)
                    self.raw_bytes += raw.send(self.value)
                    self.raw_bytes += raw.send(self.value)
            except OSError:  # refused, or hung up on
                time.sleep(0.001)
                continue
            try:
                store = dist.TCPStore("127.0.0.1", self.port, None, False, datetime.timedelta(seconds=1))
                self.connections += 1
                for i in range(self.keys):
                    if self._stop.is_set():
                        return
                    store.set(f"outsider/{self.connections}/{i}", self.value)
                    self.sets += 1
                    if i % 16 == 15:
                        self.most_keys = max(self.most_keys, store.num_keys())
                self.most_keys = max(self.most_keys, store.num_keys())
            except Exception:  # not a store, or cut off when the store went
                time.sleep(0.001)

    def start(self) -> Outsider:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def connect_both(ends, late_s: float) -> list[str]:
    ends[0][1].send(("connect", 0.0))
    ends[1][1].send(("connect", late_s))
    return [conn.recv() for _, conn in ends]


def watch_rss(pid: int, stop: threading.Event, peak: list[float]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss_mb(pid))
        time.sleep(0.02)


def phase(pid: int, port: int, action, *, keys: int, value_bytes: int) -> dict:
    """Run `action` with the outsider writing throughout; RSS of rank 0 before, at peak, after."""
    before, peak, stop = rss_mb(pid), [0.0], threading.Event()
    watcher = threading.Thread(target=watch_rss, args=(pid, stop, peak), daemon=True)
    watcher.start()
    outsider = Outsider(port, keys, value_bytes).start()
    detail = action()
    outsider.stop()
    time.sleep(1.0)  # what the process frees once the outsider is gone
    stop.set()
    watcher.join()
    return {
        "outsider_connections": outsider.connections,
        "outsider_sets": outsider.sets,
        "outsider_raw_mb": round(outsider.raw_bytes / 1e6, 1),
        "outsider_most_keys": outsider.most_keys,
        "rss_growth_peak_mb": round(peak[0] - before, 1),
        "rss_growth_after_mb": round(rss_mb(pid) - before, 1),
        "port_listening_after": port in listening_ports(pid),
        **detail,
    }


def junk_listeners(pid: int, port: int, junk_mib: int) -> dict:
    """Random bytes at every other port rank 0 listens on (Gloo's listeners)."""
    ports = sorted(listening_ports(pid) - {port})
    before = rss_mb(pid)
    for p in ports:
        for _ in range(4):
            try:
                with socket.create_connection(("127.0.0.1", p), timeout=1) as raw:
                    raw.settimeout(1)
                    raw.sendall(os.urandom(junk_mib << 18))
            except OSError:  # the listener hung up on us: fine
                pass
    time.sleep(1.0)
    return {"ports": ports, "rss_growth_mb": round(rss_mb(pid) - before, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--value-kib", type=int, default=1024)
    parser.add_argument("--rebuilds", type=int, default=20)
    parser.add_argument("--late-s", type=float, default=0.5)
    parser.add_argument("--junk-mib", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    listener, ctx = reserve_socket(), mp.get_context("spawn")
    port, ends = listener.getsockname()[1], []
    with listener:  # rank 0 holds its own copy once started
        for rank in (0, 1):
            parent, child = ctx.Pipe()
            given = (listener,) if rank == 0 else ()
            process = ctx.Process(target=end_main, args=(rank, port, child, *given), daemon=True)
            process.start()
            ends.append((process, parent))
    pid, value_bytes = ends[0][0].pid, args.value_kib << 10
    try:
        first = connect_both(ends, 0.0)
        assert first == ["ok", "ok"], first
        report = {"keys": args.keys, "value_kib": args.value_kib, "rank0_rss_mb": round(rss_mb(pid), 1)}

        def wait_a_while() -> dict:
            time.sleep(max(3.0, args.keys * value_bytes / 150e6))  # ~150 MB/s got in before
            return {}

        report["formed"] = phase(pid, port, wait_a_while, keys=args.keys, value_bytes=value_bytes)

        def rebuild_late() -> dict:
            outcomes, started = [], time.monotonic()
            for _ in range(args.rebuilds):
                outcomes.append(connect_both(ends, args.late_s))
            return {
                "rebuilds": args.rebuilds,
                "late_s": args.late_s,
                "rebuilds_ok": sum(o == ["ok", "ok"] for o in outcomes),
                "seconds": round(time.monotonic() - started, 2),
            }

        report["rebuilds"] = phase(pid, port, rebuild_late, keys=args.keys, value_bytes=value_bytes)
        report["listeners"] = junk_listeners(pid, port, args.junk_mib)
        report["still_connects"] = connect_both(ends, 0.0) == ["ok", "ok"]
    finally:
        for process, conn in ends:
            try:
                conn.send("exit")
            except OSError:
                pass
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    print(
        f"rank 0 RSS at start: {report['rank0_rss_mb']} MB; outsider: {args.keys} keys x {args.value_kib} KiB"
    )
    for name in ("formed", "rebuilds"):
        r = report[name]
        print(
            f"{name:<9} keys in (most at once) {r['outsider_most_keys']:>5}  sets {r['outsider_sets']:>5}  "
            f"raw {r['outsider_raw_mb']:>6} MB sent  "
            f"RSS +{r['rss_growth_peak_mb']} MB at peak, +{r['rss_growth_after_mb']} MB after  "
            f"port listening after: {r['port_listening_after']}"
        )
    r = report["rebuilds"]
    late = f"rank 1 late {r['late_s']} s each"
    print(f"rebuilds  {r['rebuilds_ok']}/{r['rebuilds']} ok in {r['seconds']} s ({late})")
    junk = report["listeners"]
    print(
        f"listeners {junk['ports']}: RSS +{junk['rss_growth_mb']} MB after {args.junk_mib} MiB of junk each"
    )
    print(f"the channel still connects: {report['still_connects']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
