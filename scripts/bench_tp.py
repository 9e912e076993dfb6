"""Heterogeneous-TP transfers for `bench_transfer.py --tp A:B`: a prefill group of TP A sends N
requests to a decode group of TP B, every rank moving at once, against equal TP B:B moving the same
bytes into the same destination layouts (each destination rank receives its shard once either way).

Two processes hold the groups (a rank's pool, and one channel end per pair it belongs to; each
channel has its own Gloo group and threads, so all pairs move together); this one drives them.
A run: both groups reserve the N requests on every rank and the decode ranks expect them on every
channel (`transfer.parts.expect_parts`); then the prefill ranks submit them on every channel
(`submit_parts`), and the clock runs until every destination rank has landed every request. The
first run of each case (not timed) carries checksums, which every channel compares. The A:B case and
its equal B:B case are both up at once and run alternately, so that other load on the machine
weighs on both alike; each also reports its processes' CPU time per run.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from distpool.memory.arena_pool import build_pool
from distpool.memory.sizing import PoolArgs, TpEnd, layout_description, size_pools
from distpool.model.hf_config import spec_from_hf
from distpool.model.shard import shard
from transfer import Channel, EnvelopeReceiver, EnvelopeSender, TransferOptions
from transfer.connect.rendezvous import hold_socket, reserve_socket
from transfer.parts import expect_parts, submit_parts
from transfer.plans.reshard import source_ranks

SECRET = b"bench-transfer-tp-loopback-secret"
PAGE_SIZE = 16
BUDGET_SLACK = 1.25  # each rank's arena over what its N requests hold: room for unified placement


def parse_tp(values: list[str]) -> list[tuple[int, int]]:
    """`--tp` values ("2:1", "2:1,1:2", repeatable) as (prefill TP, decode TP) pairs, in order."""
    pairs = []
    for value in values:
        for item in value.split(","):
            try:
                a, b = (int(x) for x in item.split(":"))
            except ValueError:
                raise ValueError(f"--tp takes A:B pairs of TP sizes (e.g. 2:1,1:2), got {item!r}") from None
            if a < 1 or b < 1:
                raise ValueError(f"--tp sizes must be >= 1, got {item!r}")
            pairs.append((a, b))
    return pairs


def channel_pairs(spec, src_tp: int, dst_tp: int) -> list[tuple[int, int]]:
    """(source rank, destination rank) of every channel the plan needs."""
    src = [shard(spec, src_tp, r) for r in range(src_tp)]
    dst = [shard(spec, dst_tp, r) for r in range(dst_tp)]
    return [(s, d) for d in range(dst_tp) for s in source_ranks(src, dst, d)]


def group_main(
    conn, role: int, config: str, tp: int, peer_tp: int, ports: list, case: dict, listeners: list
) -> None:
    """One group (role 0: prefill, 1: decode): its ranks' pools and channel ends, driven by `conn`.
    Role 0 holds the channels' ports, handed to it bound (`listeners`)."""
    for listener in listeners:
        hold_socket(listener)
    torch.set_num_threads(1)
    spec = spec_from_hf(config)
    args = PoolArgs(enable_unified_memory=True, page_size=PAGE_SIZE, context_len=case["tokens"])
    pairs = channel_pairs(spec, tp, peer_tp) if role == 0 else channel_pairs(spec, peer_tp, tp)
    pools, ends = [], {}
    for rank in range(tp):
        rank_shard = shard(spec, tp, rank)
        probe = size_pools(rank_shard.spec, args, 1 << 30)
        per_request = probe.slot_stride_bytes + -(-case["tokens"] // PAGE_SIZE) * probe.page_stride_bytes
        sizes = size_pools(
            rank_shard.spec, args, int(case["requests"] * per_request * BUDGET_SLACK) + (1 << 20)
        )
        pool = build_pool(sizes, "cpu")
        words = pool.buffer.view(torch.int64)  # distinct content per rank: counters
        torch.arange(rank << 40, (rank << 40) + words.numel(), out=words)
        pools.append(pool)
        for port, (s, d) in zip(ports, pairs, strict=True):
            if (s if role == 0 else d) == rank:
                channel = Channel(
                    rank=role,
                    host="127.0.0.1",
                    port=port,
                    device="cpu",
                    fingerprint=pool.fingerprint,
                    layout=layout_description(sizes),
                    timeout_s=120,
                    secret=SECRET,
                    name=f"tp-{s}-{d}",
                    num_streams=case["streams"],
                    tp=TpEnd.of(sizes, rank_shard),
                )
                options = TransferOptions(
                    chunk_bytes=case["chunk_bytes"], direct_min_bytes=case["direct_min_bytes"], timeout_s=300
                )
                end = EnvelopeSender(channel, options) if role == 0 else EnvelopeReceiver(channel)
                end.start()
                ends.setdefault(rank, []).append(end)
    connecting = [threading.Thread(target=e.connect) for rank_ends in ends.values() for e in rank_ends]
    for thread in connecting:
        thread.start()
    for thread in connecting:
        thread.join()
    conn.send("connected")
    while (command := conn.recv())[0] != "exit":
        _, rids, checked = command
        for rank_ends in ends.values():
            for end in rank_ends:
                if role == 0:
                    end.options = dataclasses.replace(end.options, checksum=checked)
        for pool in pools:
            for rid in rids:
                pool.reserve(rid, case["tokens"])
        envelopes = [[pool.envelope(rid) for rid in rids] for pool in pools]
        parts = []
        if role == 1:
            parts = [
                expect_parts(ends[r], env, pools[r].buffer, deadline_s=300)
                for r in range(tp)
                for env in envelopes[r]
            ]
        conn.send("ready")
        cpu_started = time.process_time()  # every thread of the process: engines, Gloo, copies
        if role == 0:
            assert conn.recv() == "go"
            parts = [submit_parts(ends[r], env, pools[r].buffer) for r in range(tp) for env in envelopes[r]]
        for part in parts:
            part.wait()  # a failure ends the process: the driver reports it
        cpu = time.process_time() - cpu_started
        moved = sum(p.num_bytes for p in parts)
        for pool in pools:
            for rid in rids:
                pool.release(rid)
        conn.send(("done", moved, cpu))
    for rank_ends in ends.values():
        for end in rank_ends:
            end.close()


class Case:
    """One A:B case's two group processes, connected and waiting for runs."""

    def __init__(self, config: Path, src_tp: int, dst_tp: int, case: dict) -> None:
        self.src_tp, self.dst_tp, self.requests = src_tp, dst_tp, case["requests"]
        self.pairs = channel_pairs(spec_from_hf(config), src_tp, dst_tp)
        listeners = [reserve_socket() for _ in self.pairs]  # bound until role 0's channels listen on them
        ports = [listener.getsockname()[1] for listener in listeners]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for role, (tp, peer_tp) in enumerate(((src_tp, dst_tp), (dst_tp, src_tp))):
            conn, child = ctx.Pipe()
            given = listeners if role == 0 else []
            proc = ctx.Process(
                target=group_main,
                args=(child, role, str(config), tp, peer_tp, ports, case, given),
                daemon=True,
            )
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)
        for listener in listeners:  # role 0 holds its own copies
            listener.close()
        self.runs = 0

    def receive(self, conn):
        if not conn.poll(600):
            raise SystemExit(f"a group of the {self.src_tp}:{self.dst_tp} case stopped answering")
        return conn.recv()

    def wait_connected(self) -> None:
        for conn in self.conns:
            if self.receive(conn) != "connected":
                raise SystemExit("a group could not connect its channels")

    def run(self, checked: bool) -> tuple[float, int, float, float]:
        """One run of the N requests: (seconds, bytes received, sender and receiver CPU seconds)."""
        rids = [f"r{self.runs}-{i}" for i in range(self.requests)]
        self.runs += 1
        for conn in self.conns:
            conn.send(("run", rids, checked))
        for conn in self.conns:
            assert self.receive(conn) == "ready"
        started = time.perf_counter()
        self.conns[0].send("go")
        _, received, receiver_cpu = self.receive(self.conns[1])
        seconds = time.perf_counter() - started
        _, sent, sender_cpu = self.receive(self.conns[0])
        assert sent == received, (sent, received)
        return seconds, received, sender_cpu, receiver_cpu

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                conn.send(("exit",))
            proc.join(timeout=60)


def measure_pair(config: Path, src_tp: int, dst_tp: int, case: dict, repeats: int) -> dict:
    """A:B beside B:B, run after run (alternating, so that a machine's load weighs on both alike):
    the median seconds, bytes and CPU seconds of each."""
    cases = {"het": Case(config, src_tp, dst_tp, case), "equal": Case(config, dst_tp, dst_tp, case)}
    try:
        for each in cases.values():
            each.wait_connected()
        runs: dict[str, list[tuple[float, int, float, float]]] = {name: [] for name in cases}
        for run in range(repeats + 1):  # the first run, checked, warms buffers and is not timed
            for name, each in cases.items():
                result = each.run(checked=run == 0)
                if run:
                    runs[name].append(result)
    finally:
        for each in cases.values():
            each.close()
    out = {}
    for name, results in runs.items():
        seconds, moved, sender_cpu, receiver_cpu = (list(column) for column in zip(*results, strict=True))
        out[name] = {
            "seconds": statistics.median(seconds),
            "bytes": moved[-1],
            "cpu_s": (statistics.median(sender_cpu), statistics.median(receiver_cpu)),
            "channels": len(cases[name].pairs),
        }
    return out


def measure_tp(config: Path, tp_pairs: list[tuple[int, int]], case: dict, repeats: int) -> list[dict]:
    """One row per A:B: its GB/s beside equal TP B:B's (same bytes, same destination layouts), the
    two run alternately."""
    rows = []
    for i, (src_tp, dst_tp) in enumerate(tp_pairs, 1):
        got = measure_pair(config, src_tp, dst_tp, case, repeats)
        het, eq = got["het"], got["equal"]
        assert eq["bytes"] == het["bytes"], "equal TP moves the destination ranks' shards: the same bytes"
        nbytes = het["bytes"]
        het_gbps, eq_gbps = nbytes / het["seconds"] / 1e9, nbytes / eq["seconds"] / 1e9
        rows.append(
            {
                "method": "tp_envelope",
                "tp": f"{src_tp}:{dst_tp}",
                "equal_tp": f"{dst_tp}:{dst_tp}",
                "requests": case["requests"],
                "tokens": case["tokens"],
                "bytes": nbytes,
                "channels": het["channels"],
                "equal_channels": eq["channels"],
                "gbps": round(het_gbps, 4),
                "equal_gbps": round(eq_gbps, 4),
                "ratio": round(het_gbps / eq_gbps, 4),
                "cpu_ms": [round(c * 1e3, 1) for c in het["cpu_s"]],
                "equal_cpu_ms": [round(c * 1e3, 1) for c in eq["cpu_s"]],
            }
        )
        print(
            f"[tp {i}/{len(tp_pairs)}] {src_tp}:{dst_tp} {het_gbps:.2f} GB/s vs {dst_tp}:{dst_tp} "
            f"{eq_gbps:.2f} GB/s",
            file=sys.stderr,
            flush=True,
        )
    return rows


def print_tp_table(rows: list[dict], config: Path) -> None:
    print(f"heterogeneous TP vs equal TP at the same bytes ({config.name}, all ranks moving at once)")
    columns = ("tp", "equal", "requests", "MiB", "channels", "het GB/s", "equal GB/s", "het/equal", "cpu ms")
    widths = (5, 6, 8, 9, 9, 9, 10, 9, 19)
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print(
            f"{r['tp']:>5} {r['equal_tp']:>6} {r['requests']:8d} {r['bytes'] / 2**20:9.1f} "
            f"{r['channels']:>4}/{r['equal_channels']:<4} {r['gbps']:9.3f} {r['equal_gbps']:10.3f} "
            f"{r['ratio']:9.2f} {'/'.join(f'{c:.0f}' for c in r['cpu_ms'] + r['equal_cpu_ms']):>19}"
        )
    print("(cpu ms: CPU time per run of the prefill and the decode group's process, het then equal)")
