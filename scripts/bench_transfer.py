"""Whole-envelope transfer vs the link's ceiling vs a naive per-layer loop, over one channel.

Two processes (this one sends, a spawned one receives) hold one channel. For each envelope size
and fragmentation it measures, on the same channel:
  envelope  the engine: plan, gather, chunked sends, scatter, header / status round trips
  raw       one contiguous buffer of the same byte count, no protocol: the better of one message
            and the engine's own chunked, striped sends (the link's ceiling)
  raw msgs  the same bytes as plain messages of the sizes the engine's plan sends them in, on the
            streams it puts them on, every receive posted at once: what the link does with as many
            messages (a scattered envelope's pages go one message each), without the engine
  naive     one blocking send per layer of each page, as a per-layer loop would do
Each timing runs from the sender's start until the receiver has everything (it acknowledges).
Then the per-transfer overhead: a one-page envelope against the page as one raw message.

Fragmentation 0.0 / 0.5 / 1.0: that share of the envelope's pages moved to random places (on the
sides `--fragmented` names). Fragmentation "churn": real placements. A short seeded churn trace
(scripts/churn.py: Poisson arrivals, long-tailed lengths, 80-95% occupancy, extent placement) runs
on a `meta` pool laid out like the arena here (Qwen3-Next, 384 KiB pages, a ~49 MiB state slot), once
for the source (seed SEED) and once for the destination (SEED + 1); in each, one request of the
envelope's length arrives part-way, grows with the others and is live when the trace stops. Its
`envelope_ranges` (slot, then pages in token order) are the envelope's ranges on that side, so a
churn envelope is the slot plus as many pages as bring it to at least the size asked for.
`--fragmented churn` runs only the churn cases.

`--tp A:B` (repeatable, or comma-separated: `--tp 2:1,1:2,2:4`) adds one row per pair: N requests
(`--tp-requests`, of `--tp-tokens` tokens) of a public config (`--tp-config`, default Bamba's)
moved from a prefill group of TP A to a decode group of TP B, every rank at once, beside equal TP
B:B moving the same bytes (the two run alternately, both up at once), the ratio, and each case's
CPU time per run (scripts/bench_tp.py). `--tp-only` skips the other cases.

    python scripts/bench_transfer.py --tp-only --tp 2:1,1:2,2:4 --json out/bench_transfer_tp.json

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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tp import measure_tp, parse_tp, print_tp_table  # noqa: E402
from churn import TARGET_ID, TRACE_CONTEXT_LEN, envelope_runs, run_churn, trace_pool, trace_spec  # noqa: E402

from distpool.memory.envelope import Envelope  # noqa: E402
from transfer import Channel, EnvelopeReceiver, EnvelopeSender, TransferOptions  # noqa: E402
from transfer.connect.rendezvous import reserve_port  # noqa: E402
from transfer.ends.link import message_pieces  # noqa: E402
from transfer.plans import MessagePlan, plan_runs  # noqa: E402
from transfer.wire import offer_key  # noqa: E402

# ---- parameters ---------------------------------------------------------------------------------
# A Qwen3-Next-like page: 16 tokens x 12 full-attention layers x 2 KV heads x 256 dims x (K, V) x bf16.
NUM_LAYERS = 12
LAYER_BYTES = 16 * 2 * 256 * 2 * 2  # one layer of one page: 32 KiB
PAGE_BYTES = NUM_LAYERS * LAYER_BYTES  # 384 KiB
SIZES_MIB = (1, 4, 16, 64, 256, 384, 1024)
QUICK_SIZES_MIB = (1, 16, 64, 384)
FRAGMENTATIONS = (0.0, 0.5, 1.0, "churn")
# churn: bench_pool's slot_50mb spec (Qwen3-Next, 21 SSM heads: a ~49 MiB slot, PAGE_BYTES pages)
CHURN_SSM_HEADS = 21
CHURN_REQUESTS = 600  # per trace; the envelope's request arrives with request CHURN_TARGET_AT
CHURN_TARGET_AT = 360
CHURN_ARENA_FACTOR = 4  # the arena holds this many of the largest churn envelope: room to churn
REPEATS, QUICK_REPEATS = 3, 4  # --quick: four, so that one stalled run moves no median
OVERHEAD_REPEATS = 40  # one-page envelopes against one-page raw messages, interleaved
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


def contiguous(ranges: torch.Tensor, arena_bytes: int, seed: int) -> torch.Tensor:
    """`ranges`' row sizes laid out back to back from a random page-aligned start."""
    total = int(ranges[:, 1].sum())
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, (arena_bytes - total) // PAGE_BYTES + 1, (1,), generator=g)) * PAGE_BYTES
    offsets = start + torch.cumsum(ranges[:, 1], 0) - ranges[:, 1]
    return torch.stack([offsets, ranges[:, 1]], dim=1)


def churn_pages(size_mib: int, slot_bytes: int) -> int:
    """Pages of a churn envelope of at least `size_mib` (one page at least, besides the slot)."""
    return max(1, -(-((size_mib << 20) - slot_bytes) // PAGE_BYTES))


def churn_slot_bytes() -> int:
    return trace_pool(trace_spec(CHURN_SSM_HEADS), 1 << 30, "extent", 1024).arena.low.stride_bytes


def churn_envelopes(sizes_mib: tuple[int, ...], arena_bytes: int) -> dict[int, dict]:
    """Per size: the source and destination ranges of a churn envelope (see the module docstring),
    the byte runs of each and the trace's figures. Both sides have the same rows: slot, pages."""
    spec = trace_spec(CHURN_SSM_HEADS)
    slot_bytes = churn_slot_bytes()
    context_len = min(TRACE_CONTEXT_LEN, (arena_bytes - slot_bytes) // PAGE_BYTES * 16)
    out: dict[int, dict] = {}
    by_pages: dict[int, dict] = {}
    for size_mib in sizes_mib:
        num_pages = churn_pages(size_mib, slot_bytes)
        if num_pages in by_pages:  # sizes under the slot's share the one-page envelope
            out[size_mib] = by_pages[num_pages]
            continue
        case: dict = {"ranges": [], "runs": [], "occupancy": [], "preempted": []}
        for seed in (SEED, SEED + 1):
            pool = trace_pool(spec, arena_bytes, "extent", context_len)
            if pool.arena.high.stride_bytes != PAGE_BYTES or pool.sizes.arena_bytes > arena_bytes:
                raise SystemExit("the churn pool's layout does not match the benchmark's arena")
            target = (16 * num_pages, CHURN_TARGET_AT)
            stats = run_churn(pool, CHURN_REQUESTS, seed, context_len=context_len, target=target)
            ranges = pool.envelope_ranges(TARGET_ID)
            assert ranges.shape[0] == 1 + num_pages and int(ranges[0, 1]) == slot_bytes
            case["ranges"].append(ranges)
            case["runs"].append(envelope_runs(pool, TARGET_ID))
            case["occupancy"].append(round(float(stats["occupancy"][-1]), 3))
            case["preempted"].append(stats["target_preempted"])
        assert torch.equal(case["ranges"][0][:, 1], case["ranges"][1][:, 1])
        out[size_mib] = by_pages[num_pages] = case
    return out


def crc(arena: torch.Tensor, ranges: torch.Tensor) -> int:
    value, flat = 0, arena.numpy()
    for offset, nbytes in ranges.tolist():
        value = zlib.crc32(flat[offset : offset + nbytes], value)
    return value


def envelope_of(rid: str, ranges: torch.Tensor) -> Envelope:
    return Envelope(request_id=rid, num_tokens=16 * ranges.shape[0], ranges=ranges, has_slot=False)


def await_offer(sender: EnvelopeSender, rid: str, timeout_s: float = 1.0) -> bool:
    """Wait until the receiver's offer for `rid` reached the sender (whether it did in time): in
    serving the destination is reserved, and offered, while prefill computes, long before the
    transfer begins, so a transfer timed from `submit` starts with its offer at hand."""
    deadline = time.monotonic() + timeout_s
    while sender.channel.control.peek_offer(offer_key(rid)) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0002)
    return True


def make_channel(rank: int, port: int, streams: int | None) -> Channel:
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


def back_to_back(sizes: list[int]) -> list[tuple[int, int]]:
    """(offset, nbytes) of messages of `sizes` laid one after another from offset 0."""
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    return list(zip(offsets, sizes, strict=True))


def naive_pieces(ranges: torch.Tensor) -> list[tuple[int, int]]:
    """One piece per layer of each row: a page's layers, or a slot cut in NUM_LAYERS parts."""
    pieces = []
    for o, n in ranges.tolist():
        cuts = [n * layer // NUM_LAYERS for layer in range(NUM_LAYERS + 1)]
        pieces += [(o + a, b - a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    return pieces


# ---- the receiving process -------------------------------------------------------------------------
def receiver_main(conn, port: int, arena_bytes: int, streams: int | None) -> None:
    torch.set_num_threads(1)
    channel = make_channel(1, port, streams)
    receiver = EnvelopeReceiver(channel)
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
        _, method, rid, rows, raw_chunk = command  # this side's ranges
        ranges = torch.tensor(rows, dtype=torch.int64).view(-1, 2)
        if method == "envelope":
            transfer = receiver.expect(envelope_of(rid, ranges), arena)
            conn.send("ready")
            cpu_started = time.process_time()
            transfer.wait()
            cpu = time.process_time() - cpu_started
            # Checked once the sender's clock stopped: a CRC of the envelope, run while the sender
            # still waited for STATUS, took CPU from its last steps (and stretched them).
            if conn.recv() != "check":
                raise SystemExit("the bench's sender did not ask for the check")
            conn.send((crc(arena, ranges), cpu))
            continue
        nbytes = int(ranges[:, 1].sum())
        if method == "raw_msgs":  # raw_chunk: the messages, (nbytes, stream) each
            pieces, streams = back_to_back([n for n, _ in raw_chunk]), [s for _, s in raw_chunk]
        elif method == "raw":
            pieces = message_pieces(nbytes, raw_chunk)
            streams = [i % channel.num_streams for i in range(len(pieces))]
        else:
            pieces = naive_pieces(ranges)
        conn.send("ready")
        cpu_started = time.process_time()
        deadline = time.monotonic() + 300
        if method != "naive":  # all receives posted at once
            works = [
                channel.recv(arena[o : o + n], TAG_RAW + stream)
                for (o, n), stream in zip(pieces, streams, strict=True)
            ]
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
        self.port = reserve_port()  # held until this process's rank-0 end listens on it
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

    def ranges(self, num_pages: int, fragmentation: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Source and destination ranges of a case with `fragmentation` on the sides asked for."""
        sides = self.args.fragmented
        src_frag = fragmentation if sides in ("both", "source") else 0.0
        dst_frag = fragmentation if sides in ("both", "destination") else 0.0
        arena_pages = self.arena_bytes // PAGE_BYTES
        src = page_table(num_pages, src_frag, arena_pages, SEED)
        return src, page_table(num_pages, dst_frag, arena_pages, SEED + 1)

    def churn_ranges(self, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A churn case's ranges: churned on the sides asked for, back to back on the others."""
        src, dst = case["ranges"]
        sides = self.args.fragmented
        if sides == "destination":
            src = contiguous(src, self.arena_bytes, SEED)
        if sides == "source":
            dst = contiguous(dst, self.arena_bytes, SEED + 1)
        return src, dst

    def run(
        self,
        method: str,
        src: torch.Tensor,
        dst: torch.Tensor,
        *,
        chunked: bool = True,
        messages: list[tuple[int, int]] | None = None,
    ) -> float:
        """Seconds for one transfer by `method` from `src` to `dst` ranges (checked byte-identical
        for envelopes)."""
        self.count += 1
        rid = f"bench-{self.count}"
        ranges, nbytes = src, int(src[:, 1].sum())
        raw_chunk = self.chunk_bytes if chunked else None
        if method == "raw_msgs" and not messages:
            raise ValueError("raw_msgs sends the engine's messages: pass them (engine_messages)")
        self.conn.send(("run", method, rid, dst.flatten().tolist(), messages or raw_chunk))
        assert self.conn.recv() == "ready"
        if method == "envelope":
            await_offer(self.sender, rid)
        deadline = time.monotonic() + 300
        started, cpu_started, busy_started = time.perf_counter(), time.process_time(), machine_busy_s()
        if method == "envelope":
            self.sender.submit(envelope_of(rid, ranges), self.arena, deadline_s=120).wait()
            seconds = time.perf_counter() - started
            cpu, busy = time.process_time() - cpu_started, machine_busy_s() - busy_started
            self.conn.send("check")
            value, peer_cpu = self.conn.recv()
            if value != crc(self.arena, ranges):
                raise SystemExit(f"envelope {rid} arrived corrupted")
            self._note_cpu(method, nbytes, seconds, (cpu, peer_cpu, busy))
            return seconds
        channel, streams = self.channel, self.channel.num_streams
        if method in ("raw", "raw_msgs"):
            if method == "raw_msgs":
                pieces, tags = back_to_back([n for n, _ in messages]), [s for _, s in messages]
            else:
                pieces = message_pieces(nbytes, raw_chunk)
                tags = [i % streams for i in range(len(pieces))]
            works = [
                channel.send(self.arena[o : o + n], TAG_RAW + tag)
                for (o, n), tag in zip(pieces, tags, strict=True)
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
        self._note_cpu(method, nbytes, seconds, (cpu, peer_cpu, busy))
        return seconds

    def engine_messages(self, src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int]]:
        """(nbytes, stream) of every message the engine's plan sends between these ranges."""
        direct_min = bench_direct_min(self.args)
        plan = MessagePlan(
            plan_runs(src, dst),
            chunk_bytes=self.chunk_bytes,
            direct_min_bytes=direct_min,
            num_streams=self.channel.num_streams,
        )
        return [
            (m.nbytes, stream)
            for chunk in plan
            for m, stream in zip(chunk.messages, plan.streams(chunk.index), strict=True)
        ]

    def _note_cpu(self, method: str, nbytes: int, seconds: float, cpu: tuple[float, float, float]) -> None:
        """CPU seconds (sender process, receiver process, whole machine) over wall seconds, summed
        over the runs of envelopes of 64 MiB and more (the machine's counter ticks every 10 ms)."""
        if nbytes >= 64 << 20:
            totals = self.cpu_seconds.setdefault(method, [0.0, 0.0, 0.0, 0.0])
            for i, value in enumerate((*cpu, seconds)):
                totals[i] += value

    def close(self) -> None:
        self.conn.send(("exit",))
        self.peer.join(timeout=30)
        self.sender.close()


def frag_text(fragmentation: float | str) -> str:
    return fragmentation if isinstance(fragmentation, str) else f"{fragmentation:.2f}"


def byte_runs(ranges: torch.Tensor) -> int:
    """Maximal stretches of the rows, in order, that continue where the previous row ended."""
    ends = ranges[:-1, 0] + ranges[:-1, 1]
    return 1 + int((ranges[1:, 0] != ends).sum())


def measure(
    bench: Bench,
    sizes_mib: tuple[int, ...],
    repeats: int,
    naive_max_mib: int,
    fragmentations: tuple[float | str, ...],
    churn: dict[int, dict],
) -> list[dict]:
    rows, cases, churn_rows = [], [], set()
    for size_mib in sizes_mib:
        for fragmentation in fragmentations:
            if fragmentation == "churn":
                case = churn[size_mib]
                if case["ranges"][0].shape[0] in churn_rows:  # a smaller size gave this envelope already
                    continue
                churn_rows.add(case["ranges"][0].shape[0])
                src, dst = bench.churn_ranges(case)
                num_pages = src.shape[0] - 1  # the slot, then pages
            else:
                num_pages = max(1, round((size_mib << 20) / PAGE_BYTES))
                src, dst = bench.ranges(num_pages, fragmentation)
            cases.append((size_mib, fragmentation, num_pages, src, dst))
    for i, (size_mib, fragmentation, num_pages, src, dst) in enumerate(cases, 1):
        nbytes = int(src[:, 1].sum())
        times: dict[str, list[float]] = {"envelope": [], "raw": [], "raw1": [], "raw_msgs": []}
        messages = bench.engine_messages(src, dst)  # (nbytes, stream) of each, planned once
        bench.run("envelope", src, dst)  # warm-up: buffers, page faults
        for _ in range(repeats):  # interleaved, so load on the machine hits all alike
            times["raw"].append(bench.run("raw", src, dst, chunked=True))
            times["envelope"].append(bench.run("envelope", src, dst))
            times["raw1"].append(bench.run("raw", src, dst, chunked=False))
            times["raw_msgs"].append(bench.run("raw_msgs", src, dst, messages=messages))
        gbps = {m: nbytes / statistics.median(t) / 1e9 for m, t in times.items()}
        results = {
            "envelope": gbps["envelope"],
            "raw": max(gbps["raw"], gbps["raw1"]),
            "raw_msgs": gbps["raw_msgs"],
        }
        if size_mib <= naive_max_mib:
            results["naive"] = nbytes / bench.run("naive", src, dst) / 1e9
        extra = {"runs": [byte_runs(src), byte_runs(dst)]} if fragmentation == "churn" else {}
        for method, value in results.items():
            rows.append(
                {
                    "method": method,
                    "bytes": nbytes,
                    "pages": num_pages,
                    "fragmentation": fragmentation,
                    "gbps": round(value, 4),
                    **extra,
                    **({"messages": len(messages)} if method == "raw_msgs" else {}),
                }
            )
        naive = f"  naive {results['naive']:.3f}" if "naive" in results else ""
        runs = f"  runs {extra['runs'][0]}/{extra['runs'][1]}" if extra else ""
        print(
            f"[{i}/{len(cases)}] {nbytes / 2**20:7.1f} MiB frag {frag_text(fragmentation)}: envelope "
            f"{results['envelope']:.2f}  raw {results['raw']:.2f}  raw msgs {results['raw_msgs']:.2f} "
            f"GB/s{naive}{runs}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def measure_overhead(bench: Bench, repeats: int = OVERHEAD_REPEATS) -> dict:
    """What a transfer costs beyond its bytes: the median time of a one-page envelope less that of
    the same page as one raw message (both timed to the receiver's acknowledgement)."""
    src, dst = bench.ranges(1, 0.0)
    for _ in range(3):  # warm-up
        bench.run("envelope", src, dst)
    times: dict[str, list[float]] = {"envelope": [], "raw": []}
    for _ in range(repeats):
        times["raw"].append(bench.run("raw", src, dst, chunked=False))
        times["envelope"].append(bench.run("envelope", src, dst))
    envelope_us, raw_us = (round(statistics.median(times[m]) * 1e6) for m in ("envelope", "raw"))
    return {
        "method": "overhead",
        "bytes": PAGE_BYTES,
        "envelope_us": envelope_us,
        "raw_us": raw_us,
        "overhead_us": envelope_us - raw_us,
    }


def print_table(rows: list[dict]) -> None:
    by_case: dict[tuple[int, float | str], dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault((row["bytes"], row["fragmentation"]), {})[row["method"]] = row
    columns = ("MiB", "pages", "frag", "msgs", "envelope", "raw", "raw msgs", "naive", "env/raw", "env/msgs")
    columns += ("env/naive", "runs")
    widths = (8, 6, 5, 5, 9, 7, 9, 7, 8, 9, 9, 9)
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for (nbytes, fragmentation), methods in sorted(by_case.items(), key=lambda c: (c[0][0], str(c[0][1]))):
        env, raw, msgs = methods["envelope"]["gbps"], methods["raw"]["gbps"], methods["raw_msgs"]
        naive = methods.get("naive", {}).get("gbps")
        naive_text = f"{naive:7.3f}" if naive else f"{'-':>7}"
        ratio = f"{env / naive:9.1f}" if naive else f"{'-':>9}"
        runs = methods["envelope"].get("runs")
        runs_text = f"{runs[0]}/{runs[1]}" if runs else "-"
        pages, frag = methods["envelope"]["pages"], frag_text(fragmentation)
        print(
            f"{nbytes / 2**20:8.1f} {pages:6d} {frag:>5} {msgs['messages']:5d} {env:9.2f} {raw:7.2f} "
            f"{msgs['gbps']:9.2f} {naive_text} {env / raw:8.2f} {env / msgs['gbps']:9.2f} {ratio} "
            f"{runs_text:>9}"
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
        if not points:
            continue
        churned = fragmentation == "churn"
        ax.plot(
            [b / 2**20 for b, _ in points],
            [g for _, g in points],
            "-D" if churned else "-o",
            label="envelope, churn-trace placements"
            if churned
            else f"envelope, fragmentation {fragmentation:.1f}",
        )
    # raw and naive hardly depend on fragmentation: one line each, the median over the cases of a size.
    # Churn envelopes (slot + pages) have sizes of their own: their raw is drawn as points.
    paged = [r for r in rows if r["fragmentation"] != "churn"]
    for method, style in (("raw", "--s"), ("naive", ":^")):
        sizes = sorted({r["bytes"] for r in paged if r["method"] == method})
        medians = [
            statistics.median(r["gbps"] for r in paged if r["method"] == method and r["bytes"] == b)
            for b in sizes
        ]
        ax.plot(
            [b / 2**20 for b in sizes],
            medians,
            style,
            color="gray" if method == "raw" else "black",
            label=method,
        )
    churn_raw = sorted(
        (r["bytes"], r["gbps"]) for r in rows if r["fragmentation"] == "churn" and r["method"] == "raw"
    )
    if churn_raw:
        ax.plot(
            [b / 2**20 for b, _ in churn_raw],
            [g for _, g in churn_raw],
            "D",
            color="gray",
            fillstyle="none",
            label="raw, churn envelope sizes",
        )
    ax.set_xscale("log")
    ax.set_xlabel("envelope size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"whole-envelope transfer over Gloo ({PAGE_BYTES >> 10} KiB pages, {NUM_LAYERS} layers)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def streams_text(args: argparse.Namespace) -> str:
    return "the engine's streams" if args.streams is None else f"{args.streams} streams"


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
    parser.add_argument(
        "--streams",
        type=int,
        help="Gloo connections carrying payload, per channel (default: the engine's, 2 a rank, "
        "shared by a rank's channels across TP sizes)",
    )
    parser.add_argument("--chunk-mib", type=int, default=CHUNK_MIB, help="the engine's chunk size (MiB)")
    parser.add_argument(
        "--direct-min-kib", type=int, help="runs this long go zero-copy (default: the engine's)"
    )
    parser.add_argument(
        "--fragmented",
        choices=("both", "source", "destination", "churn"),
        default="both",
        help="which side's pages are scattered (churn cases: which side keeps its churn-trace placement); "
        "the other side's are contiguous (default: both); churn: only the churn cases, both sides churned",
    )
    parser.add_argument(
        "--tp",
        action="append",
        default=[],
        metavar="A:B",
        help="add heterogeneous-TP rows: prefill TP A -> decode TP B beside B:B "
        "(repeatable, or comma-separated)",
    )
    parser.add_argument("--tp-only", action="store_true", help="run only the --tp rows")
    parser.add_argument("--tp-requests", type=int, default=4, help="requests per --tp run (default 4)")
    parser.add_argument("--tp-tokens", type=int, default=2048, help="tokens per --tp request (default 2048)")
    parser.add_argument(
        "--tp-config",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "bamba.json",
        help="the Hugging Face config.json the --tp rows shard (default: tests/fixtures/bamba.json)",
    )
    args = parser.parse_args(argv)
    try:
        tp_pairs = parse_tp(args.tp)
    except ValueError as exc:
        parser.error(str(exc))
    if args.tp_only and not tp_pairs:
        parser.error("--tp-only needs at least one --tp A:B")
    if args.tp_requests < 1 or args.tp_tokens < 1:
        parser.error("--tp-requests and --tp-tokens must be >= 1")
    sizes = tuple(args.sizes_mib or (QUICK_SIZES_MIB if args.quick else SIZES_MIB))
    repeats = args.repeats or (QUICK_REPEATS if args.quick else REPEATS)
    torch.set_num_threads(1)  # torch's intra-op threads would compete with Gloo's I/O threads
    arena_bytes = (2 * max(sizes) << 20) + 64 * PAGE_BYTES  # room to scatter the largest envelope
    fragmentations = ("churn",) if args.fragmented == "churn" else FRAGMENTATIONS
    started = time.monotonic()
    churn: dict[int, dict] = {}
    if (
        "churn" in fragmentations and not args.tp_only
    ):  # room for the churn traces to churn around the largest envelope
        largest = churn_slot_bytes() + churn_pages(max(sizes), churn_slot_bytes()) * PAGE_BYTES
        arena_bytes = max(arena_bytes, CHURN_ARENA_FACTOR * largest)
        churn = churn_envelopes(sizes, arena_bytes)
        print(
            f"churn traces: {time.monotonic() - started:.1f} s, {arena_bytes / 2**20:.0f} MiB arena, "
            f"{CHURN_REQUESTS} requests each; runs per envelope (source/destination), occupancy at the end: "
            + ", ".join(
                f"{size} MiB {c['runs'][0]}/{c['runs'][1]} {c['occupancy'][0]:.0%}/{c['occupancy'][1]:.0%}"
                for size, c in churn.items()
            ),
            file=sys.stderr,
            flush=True,
        )
    rows: list[dict] = []
    if not args.tp_only:
        rows = run_cases(args, arena_bytes, sizes, repeats, fragmentations, churn, started)
    if tp_pairs:
        case = {
            "requests": args.tp_requests,
            "tokens": args.tp_tokens,
            "streams": args.streams,
            "chunk_bytes": args.chunk_mib << 20,
            "direct_min_bytes": None if args.direct_min_kib is None else args.direct_min_kib << 10,
        }
        tp_rows = measure_tp(args.tp_config, tp_pairs, case, repeats)
        print_tp_table(tp_rows, args.tp_config)
        print(
            f"({time.monotonic() - started:.0f} s; chunk {args.chunk_mib} MiB, {streams_text(args)}, "
            f"direct >= {bench_direct_min(args) >> 10} KiB, median of {repeats} runs per case)"
        )
        rows += tp_rows
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def run_cases(args, arena_bytes, sizes, repeats, fragmentations, churn, started) -> list[dict]:
    """The envelope / raw / naive cases over one channel: rows, printed and plotted."""
    bench = Bench(args, arena_bytes)
    try:
        naive_max = QUICK_NAIVE_MAX_MIB if args.quick else NAIVE_MAX_MIB
        rows = measure(bench, sizes, repeats, naive_max, fragmentations, churn)
        overhead = measure_overhead(bench)
    finally:
        bench.close()
    print_table(rows)
    print(
        f"per-transfer overhead: a one-page envelope {overhead['envelope_us']} us, the page as one raw "
        f"message {overhead['raw_us']} us: {overhead['overhead_us']} us (median of {OVERHEAD_REPEATS})"
    )
    direct_min = bench_direct_min(args)
    print(
        f"({time.monotonic() - started:.0f} s; chunk {args.chunk_mib} MiB, {streams_text(args)}, "
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
    return [*rows, overhead]


if __name__ == "__main__":
    sys.exit(main())
