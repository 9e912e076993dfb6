"""Where a small transfer's time goes: the steps of one-page envelope transfers on both ends, each
as the median time since `submit` (time.perf_counter is CLOCK_MONOTONIC: one clock for both
processes of the machine).

Two processes hold one channel (the receiver is spawned). The engine's steps are timed by wrapping
its methods in each process: the control plane's send (`ctl.send:<name>>` when it starts, `<` when
it returns), a control message filed by the reader thread (`ctl.filed`, the first of a transfer)
and taken by a waiting worker (`ctl.got:<name>`), the sender's and the receiver's worker steps,
and the waits that return to the caller (`waited`). The first 10 transfers warm up and are left
out. Each is submitted once the receiver's offer of its destination has reached the sender
(`bench_transfer.await_offer`), as in serving, where decode reserves while prefill computes: its
steps before `submit` have negative times.

    python scripts/transfer_timeline.py --transfers 150
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_transfer import PAGE_BYTES, await_offer, envelope_of, make_channel  # noqa: E402

WARMUP = 10
ARENA_PAGES = 8


def instrument(log: list) -> None:
    """Wrap the engine's steps so that each appends (step, time) to `log`."""
    import transfer.ends.handle as handle
    import transfer.ends.receive_pipeline as receive_pipeline
    import transfer.ends.receiver as receiver
    import transfer.ends.send_pipeline as send_pipeline
    import transfer.ends.sender as sender
    import transfer.pair.control as control

    def wrap(owner, name: str, label: str, *, before: bool = False, name_arg: int | None = None) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            step = label if name_arg is None else f"{label}:{str(args[name_arg]).split('/')[0]}"
            if before:
                log.append((step + ">", time.perf_counter()))
            result = method(*args, **kwargs)
            log.append((step + "<", time.perf_counter()))
            return result

        setattr(owner, name, timed)

    wrap(control.ControlPlane, "send", "ctl.send", before=True, name_arg=1)
    wrap(control.ControlPlane, "_file", "ctl.filed")
    wrap(control.ControlPlane, "wait_value", "ctl.got", name_arg=1)
    wrap(sender.EnvelopeSender, "_send_one", "send_one", before=True)
    wrap(sender.EnvelopeSender, "_send_chunks", "send_chunks", before=True)
    wrap(send_pipeline.SendPipeline, "send", "payload_sends", before=True)
    wrap(receiver.EnvelopeReceiver, "_receive_one", "receive_one", before=True)
    wrap(receiver, "check_header", "header_checked")  # as the receiver calls it
    wrap(receive_pipeline.ReceivePipeline, "receive", "payload_landed", before=True)
    wrap(handle.Transfer, "conclude", "concluded")


def receiver_main(conn, port: int, transfers: int) -> None:
    from transfer import EnvelopeReceiver

    log: list = []
    instrument(log)
    torch.set_num_threads(1)
    channel = make_channel(1, port, None)
    receiver = EnvelopeReceiver(channel)
    receiver.start()
    receiver.connect()
    arena = torch.zeros(ARENA_PAGES * PAGE_BYTES, dtype=torch.uint8)
    ranges = torch.tensor([[PAGE_BYTES * 3, PAGE_BYTES]])
    for i in range(transfers):
        transfer = receiver.expect(envelope_of(f"t{i}", ranges), arena)
        conn.send("ready")
        transfer.wait()
        log.append(("waited", time.perf_counter()))
        conn.send(log[:])
        log.clear()
    receiver.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--transfers", type=int, default=150, help=f"one-page transfers (the first {WARMUP} warm up)"
    )
    args = parser.parse_args(argv)
    if args.transfers <= WARMUP:
        parser.error(f"--transfers must be more than {WARMUP}")
    from transfer import EnvelopeSender
    from transfer.connect.rendezvous import reserve_port

    port = reserve_port()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    peer = ctx.Process(target=receiver_main, args=(child, port, args.transfers), daemon=True)
    peer.start()
    log: list = []
    instrument(log)
    torch.set_num_threads(1)
    sender = EnvelopeSender(make_channel(0, port, None))
    sender.start()
    sender.connect()
    arena = torch.arange(ARENA_PAGES * PAGE_BYTES // 8, dtype=torch.int64).view(torch.uint8)
    ranges = torch.tensor([[PAGE_BYTES * 5, PAGE_BYTES]])
    steps: dict[str, list[float]] = {}
    totals, offered = [], 0
    for i in range(args.transfers):
        assert conn.recv() == "ready"
        offered += await_offer(sender, f"t{i}") and i >= WARMUP
        started = time.perf_counter()
        sender.submit(envelope_of(f"t{i}", ranges), arena).wait()
        log.append(("waited", time.perf_counter()))
        events = [("S " + k, t) for k, t in log] + [("R " + k, t) for k, t in conn.recv()]
        log.clear()
        if i < WARMUP:
            continue
        totals.append(max(t for _, t in events) - started)
        seen: set[str] = set()
        for step, at in sorted(events, key=lambda e: e[1]):
            if step not in seen:  # a step's first occurrence in the transfer
                seen.add(step)
                steps.setdefault(step, []).append((at - started) * 1e6)
    sender.close()
    peer.join(timeout=30)
    print(
        f"one-page transfers: {len(totals)} ({offered} with the receiver's offer at hand), "
        f"median {statistics.median(totals) * 1e6:.0f} us to the last step"
    )
    print("step (S: sender process, R: receiver process)      median us since submit")
    for step, times in sorted(steps.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"  {step:48s} {statistics.median(times):8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
