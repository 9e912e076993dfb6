"""Whole-envelope transfer vs the link's ceiling vs a naive per-layer loop, over one channel.

Two processes (this one sends, a spawned one receives) hold one channel. For each envelope size
and fragmentation it measures, on the same channel:
  envelope  the engine: plan, gather, chunked sends, scatter, header / status round trips
  raw       one contiguous buffer of the same byte count, no protocol: the better of one message
            and the engine's own chunked, striped sends (the link's ceiling)
  naive     one blocking send per layer of each page, as a per-layer loop would do
Each timing runs from the sender's start until the receiver has everything (it acknowledges).

    python scripts/bench_transfer.py --quick --json out/bench_transfer.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distpool.memory.envelope import Envelope  # noqa: E402
from transfer import Channel, EnvelopeReceiver, EnvelopeSender, TransferOptions  # noqa: E402
from transfer.rendezvous import free_port  # noqa: E402

# ---- parameters ---------------------------------------------------------------------------------
# A Qwen3-Next-like page: 16 tokens x 12 full-attention layers x 2 KV heads x 256 dims x (K, V) x bf16.
NUM_LAYERS = 12
LAYER_BYTES = 16 * 2 * 256 * 2 * 2  # one layer of one page: 32 KiB
PAGE_BYTES = NUM_LAYERS * LAYER_BYTES  # 384 KiB
SIZES_MIB = (1, 4, 16, 64, 256, 384, 1024)
QUICK_SIZES_MIB = (1, 16, 64, 384)
FRAGMENTATIONS = (0.0, 0.5, 1.0)
REPEATS, QUICK_REPEATS = 3, 2
NAIVE_MAX_MIB, QUICK_NAIVE_MAX_MIB = 1024, 384  # the naive loop is slow; skip it above this
CHUNK_MIB = 32
SEED = 0
TAG_RAW, TAG_ACK = 5, 6
FINGERPRINT = "bench-layout"
SECRET = b"bench-transfer-loopback-secret-0"  # both processes of the benchmark share it


def page_table(num_pages: int, fragmentation: float, arena_pages: int, seed: int) -> torch.Tensor:
    """(num_pages, 2) ranges: consecutive pages, with `fragmentation` of them moved to random free pages."""
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, arena_pages - num_pages + 1, (1,), generator=g))
    ids = torch.arange(start, start + num_pages)
    num_moved = round(fragmentation * num_pages)
    if num_moved:
        free = torch.randperm(arena_pages, generator=g)
        free = free[(free < start) | (free >= start + num_pages)][:num_moved]
        positions = torch.randperm(num_pages, generator=g)[: free.numel()]
        ids[positions] = free
    return torch.stack([ids * PAGE_BYTES, torch.full_like(ids, PAGE_BYTES)], dim=1)


def crc(arena: torch.Tensor, ranges: torch.Tensor) -> int:
    value, flat = 0, arena.numpy()
    for offset, nbytes in ranges.tolist():
        value = zlib.crc32(flat[offset : offset + nbytes], value)
    return value


def envelope_of(rid: str, ranges: torch.Tensor) -> Envelope:
    return Envelope(
        request_id=rid,
        fingerprint=FINGERPRINT,
        page_ids=tuple(range(ranges.shape[0])),
        slot_id=None,
        num_tokens=16 * ranges.shape[0],
        num_bytes=int(ranges[:, 1].sum()),
    )


def make_channel(rank: int, port: int, streams: int) -> Channel:
    return Channel(
        rank=rank,
        host="127.0.0.1",
        port=port,
        device="cpu",
        fingerprint=FINGERPRINT,
        layout={"page_bytes": PAGE_BYTES},
        timeout_s=60,
        secret=SECRET,
        name="bench",
        num_streams=streams,
    )


def machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (softirq and kernel time included), or NaN
    where /proc/stat is missing."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def raw_pieces(num_bytes: int, chunk_bytes: int | None) -> list[tuple[int, int]]:
    if chunk_bytes is None:
        return [(0, num_bytes)]
    return [(o, min(chunk_bytes, num_bytes - o)) for o in range(0, num_bytes, chunk_bytes)]


def naive_pieces(ranges: torch.Tensor) -> list[tuple[int, int]]:
    return [(o + layer * LAYER_BYTES, LAYER_BYTES) for o, _ in ranges.tolist() for layer in range(NUM_LAYERS)]


# ---- the receiving process -------------------------------------------------------------------------
def receiver_main(conn, port: int, arena_bytes: int, streams: int) -> None:
    torch.set_num_threads(1)
    channel = make_channel(1, port, streams)
    receiver = EnvelopeReceiver(channel, max_chunk_bytes=1 << 30)
    receiver.start()
    receiver.connect()
    arena = torch.zeros(arena_bytes, dtype=torch.uint8)
    arena.fill_(1)  # touch every page now, not during the first transfer
    ack = torch.zeros(1, dtype=torch.uint8)
    while True:
        command = conn.recv()
        if command[0] == "exit":
            receiver.close()
            return
        _, method, rid, num_pages, fragmentation, raw_chunk = command  # fragmentation of this side
        ranges = page_table(num_pages, fragmentation, arena_bytes // PAGE_BYTES, SEED + 1)
        if method == "envelope":
            transfer = receiver.expect(envelope_of(rid, ranges), arena, ranges, deadline_s=120)
            conn.send("ready")
            cpu_started = time.process_time()
            transfer.wait()
            cpu = time.process_time() - cpu_started
            conn.send((crc(arena, ranges), cpu))
            continue
        pieces = raw_pieces(num_pages * PAGE_BYTES, raw_chunk) if method == "raw" else naive_pieces(ranges)
        conn.send("ready")
        cpu_started = time.process_time()
        deadline = time.monotonic() + 300
        if method == "raw":  # all receives posted at once
            works = [channel.recv(arena[o : o + n], TAG_RAW + i % streams) for i, (o, n) in enumerate(pieces)]
            for work in works:
                channel.wait(work, deadline, "raw")
        else:  # one blocking receive per piece
            for o, n in pieces:
                channel.wait(channel.recv(arena[o : o + n], TAG_RAW), deadline, "naive")
        channel.wait(channel.send(ack, TAG_ACK), deadline, "ack")
        conn.send(("done", time.process_time() - cpu_started))


# ---- the sending side ---------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, arena_bytes: int) -> None:
        self.args, self.arena_bytes = args, arena_bytes
        self.port = free_port()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.peer = ctx.Process(
            target=receiver_main, args=(child, self.port, arena_bytes, args.streams), daemon=True
        )
        self.peer.start()
        self.channel = make_channel(0, self.port, args.streams)
        direct_min = None if args.direct_min_kib is None else args.direct_min_kib << 10
        self.chunk_bytes = args.chunk_mib << 20
        options = TransferOptions(chunk_bytes=self.chunk_bytes, direct_min_bytes=direct_min)
        self.sender = EnvelopeSender(self.channel, options)
        self.sender.start()
        self.sender.connect()
        # Distinct, cheap-to-make content: int64 counters.
        self.arena = torch.arange(arena_bytes // 8, dtype=torch.int64).view(torch.uint8)
        self.ack = torch.zeros(1, dtype=torch.uint8)
        self.count = 0
        self.cpu_seconds: dict[str, list[float]] = {}  # method -> [sender, receiver, machine, wall]

    def run(self, method: str, num_pages: int, fragmentation: float, *, chunked: bool = True) -> float:
        """Seconds for one transfer by `method` (checked byte-identical for envelopes)."""
        self.count += 1
        rid = f"bench-{self.count}"
        sides = self.args.fragmented
        src_frag = fragmentation if sides in ("both", "source") else 0.0
        dst_frag = fragmentation if sides in ("both", "destination") else 0.0
        ranges = page_table(num_pages, src_frag, self.arena_bytes // PAGE_BYTES, SEED)
        raw_chunk = self.chunk_bytes if chunked else None
        self.conn.send(("run", method, rid, num_pages, dst_frag, raw_chunk))
        assert self.conn.recv() == "ready"
        deadline = time.monotonic() + 300
        started, cpu_started, busy_started = time.perf_counter(), time.process_time(), machine_busy_s()
        if method == "envelope":
            self.sender.submit(envelope_of(rid, ranges), self.arena, ranges, deadline_s=120).wait()
            seconds = time.perf_counter() - started
            cpu, busy = time.process_time() - cpu_started, machine_busy_s() - busy_started
            value, peer_cpu = self.conn.recv()
            if value != crc(self.arena, ranges):
                raise SystemExit(f"envelope {rid} arrived corrupted")
            self._note_cpu(method, num_pages, seconds, (cpu, peer_cpu, busy))
            return seconds
        channel, streams = self.channel, self.args.streams
        if method == "raw":
            pieces = raw_pieces(num_pages * PAGE_BYTES, raw_chunk)
            works = [
                channel.send(self.arena[o : o + n], TAG_RAW + i % streams) for i, (o, n) in enumerate(pieces)
            ]
            for work in works:
                channel.wait(work, deadline, "raw")
        else:
            for o, n in naive_pieces(ranges):
                channel.wait(channel.send(self.arena[o : o + n], TAG_RAW), deadline, "naive")
        channel.wait(channel.recv(self.ack, TAG_ACK), deadline, "ack")
        seconds = time.perf_counter() - started
        cpu, busy = time.process_time() - cpu_started, machine_busy_s() - busy_started
        done, peer_cpu = self.conn.recv()
        assert done == "done"
        self._note_cpu(method, num_pages, seconds, (cpu, peer_cpu, busy))
        return seconds

    def _note_cpu(self, method: str, num_pages: int, seconds: float, cpu: tuple[float, float, float]) -> None:
        """CPU seconds (sender process, receiver process, whole machine) over wall seconds, summed
        over the runs of envelopes of 64 MiB and more (the machine's counter ticks every 10 ms)."""
        if num_pages * PAGE_BYTES >= 64 << 20:
            totals = self.cpu_seconds.setdefault(method, [0.0, 0.0, 0.0, 0.0])
            for i, value in enumerate((*cpu, seconds)):
                totals[i] += value

    def close(self) -> None:
        self.conn.send(("exit",))
        self.peer.join(timeout=30)
        self.sender.close()


def measure(bench: Bench, sizes_mib: tuple[int, ...], repeats: int, naive_max_mib: int) -> list[dict]:
    rows = []
    cases = [(s, f) for s in sizes_mib for f in FRAGMENTATIONS]
    for i, (size_mib, fragmentation) in enumerate(cases, 1):
        num_pages = max(1, round((size_mib << 20) / PAGE_BYTES))
        nbytes = num_pages * PAGE_BYTES
        times: dict[str, list[float]] = {"envelope": [], "raw": [], "raw1": []}
        bench.run("envelope", num_pages, fragmentation)  # warm-up: buffers, page faults
        for _ in range(repeats):  # interleaved, so load on the machine hits all alike
            times["raw"].append(bench.run("raw", num_pages, fragmentation, chunked=True))
            times["envelope"].append(bench.run("envelope", num_pages, fragmentation))
            times["raw1"].append(bench.run("raw", num_pages, fragmentation, chunked=False))
        gbps = {m: nbytes / statistics.median(t) / 1e9 for m, t in times.items()}
        results = {"envelope": gbps["envelope"], "raw": max(gbps["raw"], gbps["raw1"])}
        if size_mib <= naive_max_mib:
            results["naive"] = nbytes / bench.run("naive", num_pages, fragmentation) / 1e9
        for method, value in results.items():
            rows.append(
                {
                    "method": method,
                    "bytes": nbytes,
                    "pages": num_pages,
                    "fragmentation": fragmentation,
                    "gbps": round(value, 4),
                }
            )
        naive = f"  naive {results['naive']:.3f}" if "naive" in results else ""
        print(
            f"[{i}/{len(cases)}] {nbytes / 2**20:7.1f} MiB frag {fragmentation:.2f}: envelope "
            f"{results['envelope']:.2f}  raw {results['raw']:.2f} GB/s{naive}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def print_table(rows: list[dict]) -> None:
    by_case: dict[tuple[int, float], dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault((row["bytes"], row["fragmentation"]), {})[row["method"]] = row
    columns = ("MiB", "pages", "frag", "envelope", "raw", "naive", "env/raw", "env/naive")
    widths = (8, 6, 5, 9, 7, 7, 8, 9)
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for (nbytes, fragmentation), methods in sorted(by_case.items()):
        env, raw = methods["envelope"]["gbps"], methods["raw"]["gbps"]
        naive = methods.get("naive", {}).get("gbps")
        naive_text = f"{naive:7.3f}" if naive else f"{'-':>7}"
        ratio = f"{env / naive:9.1f}" if naive else f"{'-':>9}"
        print(
            f"{nbytes / 2**20:8.1f} {methods['envelope']['pages']:6d} {fragmentation:5.2f} {env:9.2f} "
            f"{raw:7.2f} {naive_text} {env / raw:8.2f} {ratio}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for fragmentation in FRAGMENTATIONS:
        points = sorted(
            (r["bytes"], r["gbps"])
            for r in rows
            if r["method"] == "envelope" and r["fragmentation"] == fragmentation
        )
        ax.plot(
            [b / 2**20 for b, _ in points],
            [g for _, g in points],
            "-o",
            label=f"envelope, fragmentation {fragmentation:.1f}",
        )
    # raw and naive hardly depend on fragmentation: one line each, the median over the cases of a size.
    for method, style in (("raw", "--s"), ("naive", ":^")):
        sizes = sorted({r["bytes"] for r in rows if r["method"] == method})
        medians = [
            statistics.median(r["gbps"] for r in rows if r["method"] == method and r["bytes"] == b)
            for b in sizes
        ]
        ax.plot(
            [b / 2**20 for b in sizes],
            medians,
            style,
            color="gray" if method == "raw" else "black",
            label=method,
        )
    ax.set_xscale("log")
    ax.set_xlabel("envelope size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"whole-envelope transfer over Gloo ({PAGE_BYTES >> 10} KiB pages, {NUM_LAYERS} layers)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def bench_direct_min(args: argparse.Namespace) -> int:
    options = TransferOptions(
        direct_min_bytes=None if args.direct_min_kib is None else args.direct_min_kib << 10
    )
    return options.direct_min_bytes_for(torch.device("cpu"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (under two minutes)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot", type=Path, default=Path("out/bench_transfer.png"), help="PNG plot path")
    parser.add_argument("--sizes-mib", type=int, nargs="+", help="envelope sizes to run (MiB)")
    parser.add_argument("--repeats", type=int, help="timed repeats per method and case (median is reported)")
    parser.add_argument("--streams", type=int, default=2, help="Gloo connections carrying payload")
    parser.add_argument("--chunk-mib", type=int, default=CHUNK_MIB, help="the engine's chunk size (MiB)")
    parser.add_argument(
        "--direct-min-kib", type=int, help="runs this long go zero-copy (default: the engine's)"
    )
    parser.add_argument(
        "--fragmented",
        choices=("both", "source", "destination"),
        default="both",
        help="which side's pages are scattered; the other side's are contiguous (default: both)",
    )
    args = parser.parse_args(argv)
    sizes = tuple(args.sizes_mib or (QUICK_SIZES_MIB if args.quick else SIZES_MIB))
    repeats = args.repeats or (QUICK_REPEATS if args.quick else REPEATS)
    torch.set_num_threads(1)  # torch's intra-op threads would compete with Gloo's I/O threads
    arena_bytes = (2 * max(sizes) << 20) + 64 * PAGE_BYTES  # room to scatter the largest envelope
    started = time.monotonic()
    bench = Bench(args, arena_bytes)
    try:
        rows = measure(bench, sizes, repeats, QUICK_NAIVE_MAX_MIB if args.quick else NAIVE_MAX_MIB)
    finally:
        bench.close()
    print_table(rows)
    direct_min = bench_direct_min(args)
    print(
        f"({time.monotonic() - started:.0f} s; chunk {args.chunk_mib} MiB, {args.streams} streams, "
        f"direct >= {direct_min >> 10} KiB, fragmented: {args.fragmented}, "
        f"median of {repeats} interleaved runs)"
    )
    if bench.cpu_seconds:  # where the machine is already full with raw sends, copies cost throughput
        busy = ", ".join(
            f"{m} {snd / wall:.2f} + {rcv / wall:.2f} (machine {mach / wall:.2f})"
            for m, (snd, rcv, mach, wall) in sorted(bench.cpu_seconds.items())
        )
        print(f"cores busy, sender + receiver, envelopes >= 64 MiB, of {os.cpu_count()}: {busy}")
    plot(rows, args.plot)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
