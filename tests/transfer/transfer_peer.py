"""Helpers for transfer tests: arenas, fragmented envelopes, a ledger, and a peer process.

A `Peer` is a spawned process that holds channels and engines by name and runs commands from the
test process over a pipe, so one test process can talk to several peers, and a peer can be killed
mid-transfer. Spawning costs ~1-2 s (torch import), so tests reuse peers where they can.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any

import torch

from distpool.memory.envelope import Envelope
from transfer import (
    Channel,
    ChannelError,
    EnvelopeReceiver,
    EnvelopeSender,
    FingerprintMismatch,
    Transfer,
    TransferError,
    TransferOptions,
)
from transfer.connect.rendezvous import free_port
from transfer.wire.protocol import (
    HEADER,
    OFFER,
    PROTOCOL_VERSION,
    RETRACTED,
    decode_message,
    encode_message,
    offer_key,
    reply_key,
    table_bytes,
)

FINGERPRINT = "f00dfeedf00dfeed"
SECRET = b"transfer-tests-secret-0123456789"  # both ends of every test channel share it
LAYOUT = {"page_size": 16, "page_bytes": 4096, "slot_bytes": 12288, "kv_dtype": "bfloat16"}


def offer_kind(sender: EnvelopeSender, rid: str) -> str | None:
    """OFFER or RETRACTED, whichever the sender holds for `rid` (None: neither)."""
    blob = sender.channel.control.peek_offer(offer_key(rid))
    return (
        None if blob is None else decode_message(blob, expect=(OFFER, RETRACTED), max_bytes=1 << 20)["kind"]
    )


def wait_for_offer(sender: EnvelopeSender, rid: str, kind: str | None = OFFER) -> None:
    """Wait until the sender holds the receiver's `kind` (OFFER, RETRACTED, None) for `rid`."""
    deadline = time.monotonic() + 5
    while offer_kind(sender, rid) != kind:
        assert time.monotonic() < deadline, f"no {kind} for {rid} came"
        time.sleep(0.005)


def failure_of(transfer: Transfer, timeout_s: float | None = None) -> TransferError:
    """Wait for `transfer`, which must fail; its TransferError (read its `kind`)."""
    try:
        transfer.wait(timeout_s)
    except TransferError as exc:
        return exc
    raise AssertionError(f"{transfer!r} succeeded; it was to fail")


def make_arena(num_bytes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g).to(device)


def fragmented_ranges(
    *, num_pages: int, page_bytes: int, arena_pages: int, fragmentation: float, seed: int, slot_bytes: int = 0
) -> torch.Tensor:
    """(n, 2) ranges: an optional slot at offset 0, then `num_pages` pages from a page band after it.

    fragmentation 0.0 picks consecutive pages; 1.0 a random permutation; in between, that fraction
    of the positions is shuffled.
    """
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, arena_pages - num_pages + 1, (1,), generator=g))
    ids = torch.arange(start, start + num_pages)
    num_moved = round(fragmentation * num_pages)
    if num_moved:
        moved = torch.randperm(num_pages, generator=g)[:num_moved]
        pool = torch.randperm(arena_pages, generator=g)
        free = pool[~torch.isin(pool, ids)][:num_moved]
        moved = moved[: free.numel()]
        num_moved = moved.numel()
        ids = ids.clone()
        ids[moved] = free
        ids[moved] = ids[moved][torch.randperm(num_moved, generator=g)]
    band = slot_bytes  # pages live after the slot
    rows = [[band + int(i) * page_bytes, page_bytes] for i in ids]
    if slot_bytes:
        rows.insert(0, [0, slot_bytes])
    return torch.tensor(rows, dtype=torch.int64)


def envelope_for(
    rid: str, ranges: torch.Tensor, *, has_slot: bool, num_tokens: int | None = None
) -> Envelope:
    """The envelope of `ranges` (a slot row first if `has_slot`, then pages of 16 tokens)."""
    num_pages = ranges.shape[0] - int(has_slot)
    return Envelope(
        request_id=rid,
        num_tokens=num_tokens if num_tokens is not None else 16 * num_pages,
        ranges=ranges,
        has_slot=has_slot,
    )


def digest(arena: torch.Tensor, ranges: torch.Tensor) -> str:
    """sha256 of the envelope's bytes in canonical order."""
    h = hashlib.sha256()
    flat = arena.cpu().numpy()
    for off, n in ranges.tolist():
        h.update(flat[off : off + n].tobytes())
    return h.hexdigest()


def digest_outside(arena: torch.Tensor, ranges: torch.Tensor) -> str:
    """sha256 of every arena byte outside the envelope (to prove nothing else was written)."""
    keep = torch.ones(arena.shape[0], dtype=torch.bool)
    for off, n in ranges.tolist():
        keep[off : off + n] = False
    return hashlib.sha256(arena.cpu()[keep].numpy().tobytes()).hexdigest()


class Ledger:
    """A tiny stand-in for a pool's accounting: reserve, pin while transferring, release on every outcome."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.reserved: dict[str, int] = {}
        self.pinned: set[str] = set()

    def reserve(self, rid: str, ranges: torch.Tensor) -> None:
        assert rid not in self.reserved
        self.reserved[rid] = int(ranges[:, 1].sum())

    def pin(self, rid: str) -> None:
        self.pinned.add(rid)

    def unpin(self, rid: str) -> None:
        self.pinned.discard(rid)

    def release(self, rid: str) -> None:
        assert rid not in self.pinned, f"release of pinned {rid}"
        del self.reserved[rid]

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - sum(self.reserved.values())

    def check_invariants(self) -> None:
        assert self.free_bytes + sum(self.reserved.values()) == self.capacity_bytes
        assert 0 <= self.free_bytes <= self.capacity_bytes


# ---- the peer process ------------------------------------------------------------------------------
class Peer:
    """A spawned process running channel commands; `call` waits, `start` + `result` overlap."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child,), daemon=True)
        self.process.start()

    def start(self, op: str, **kwargs: Any) -> None:
        self._conn.send((op, kwargs))

    def result(self, timeout_s: float = 60.0) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer gave no answer within {timeout_s} s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"peer failed:\n{value}")
        return value

    def answered(self) -> bool:
        """Whether the operation started last has answered (a frozen peer cannot)."""
        return self._conn.poll(0)

    def call(self, op: str, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        self.start(op, **kwargs)
        return self.result(timeout_s)

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except Exception:
                pass
        self.kill()


def _peer_main(conn: Any) -> None:
    torch.set_num_threads(1)
    state: dict[str, Any] = {"engines": {}, "arenas": {}, "transfers": {}, "ranges": {}}
    while True:
        op, kwargs = conn.recv()
        try:
            value = _HANDLERS[op](state, **kwargs)
            conn.send((True, value))
        except Exception:
            conn.send((False, traceback.format_exc()))
        if op == "exit":
            return


def _hook(kill_after_chunk: int | None, abort_after_chunk: int | None, delay_s: float):
    def on_chunk(transfer: Any, index: int) -> None:
        if delay_s:
            time.sleep(delay_s)
        if kill_after_chunk is not None and index >= kill_after_chunk:
            os.kill(os.getpid(), signal.SIGKILL)
        if abort_after_chunk is not None and index >= abort_after_chunk:
            transfer.abort(f"peer aborted after chunk {index}")

    return on_chunk


def _open(
    state: dict,
    *,
    name: str,
    rank: int,
    port: int,
    layout: dict | None = None,
    timeout_s: float = 10.0,
    fingerprint: str = FINGERPRINT,
    options: dict | None = None,
    device: str = "cpu",
) -> dict:
    state.setdefault("devices", {})[name] = device
    engine = make_engine(
        rank,
        port,
        device,
        name=name,
        options=options,
        layout=layout,
        timeout_s=timeout_s,
        fingerprint=fingerprint,
        unexpected_wait_s=0.5,
    )
    state["engines"][name] = engine
    return _connect(state, name=name, timeout_s=timeout_s)


def _connect(state: dict, *, name: str, timeout_s: float | None = None) -> dict:
    try:
        state["engines"][name].connect(timeout_s)
        return {"ok": True, "generation": state["engines"][name].channel.generation}
    except FingerprintMismatch as exc:
        return {
            "ok": False,
            "error": "FingerprintMismatch",
            "fields": sorted(exc.fields),
            "message": str(exc),
        }
    except ChannelError as exc:
        return {"ok": False, "error": "ChannelError", "message": str(exc)}


def _arena(state: dict, *, name: str, num_bytes: int, seed: int) -> str:
    state["arenas"][name] = make_arena(num_bytes, seed, state["devices"][name])
    return str(state["arenas"][name].device)


def _begin(
    state: dict,
    *,
    name: str,
    rid: str,
    ranges: list,
    has_slot: bool,
    deadline_s: float = 10.0,
    kill_after_chunk: int | None = None,
    abort_after_chunk: int | None = None,
    delay_s: float = 0.0,
    num_tokens: int | None = None,
) -> None:
    table = torch.tensor(ranges, dtype=torch.int64)
    engine, arena = state["engines"][name], state["arenas"][name]
    envelope = envelope_for(rid, table, has_slot=has_slot, num_tokens=num_tokens)
    hook = _hook(kill_after_chunk, abort_after_chunk, delay_s)
    begin = engine.submit if isinstance(engine, EnvelopeSender) else engine.expect
    state["transfers"][rid] = begin(envelope, arena, deadline_s=deadline_s, on_chunk=hook)
    state["ranges"][rid] = table


def _wait(state: dict, *, name: str, rid: str) -> dict:
    transfer, table = state["transfers"].pop(rid), state["ranges"].pop(rid)
    started = time.monotonic()
    try:
        transfer.wait()
        error = None
    except TransferError as exc:
        error = {"kind": exc.kind, "reason": exc.reason, "channel_broken": exc.channel_broken}
    arena = state["arenas"][name]
    return {
        "state": transfer.state.value,
        "error": error,
        "waited_s": time.monotonic() - started,
        "digest": digest(arena, table),
        "outside": digest_outside(arena, table),
    }


def _wait_digest(state: dict, *, name: str, ranges: list) -> dict:
    """Digests of the named arena inside and outside `ranges`, as they are now."""
    table, arena = torch.tensor(ranges, dtype=torch.int64), state["arenas"][name]
    return {"digest": digest(arena, table), "outside": digest_outside(arena, table)}


def _corrupt_header(state: dict, *, name: str, rid: str, kind: str, ranges: list | None = None) -> str:
    """Act as a broken sender: ring the bell with a bad header; return the receiver's reply."""
    channel: Channel = state["engines"][name].channel
    seq = channel.transfer_seq
    if kind == "garbage":
        blob = bytes(
            torch.randint(0, 256, (300,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seq))
        )
    else:  # well-formed, but describing an envelope that cannot fill the reservation
        table = torch.tensor(ranges, dtype=torch.int64)
        num_tokens = envelope_for(rid, table, has_slot=True).num_tokens
        if kind == "wrong_tokens":
            num_tokens += 1
        elif kind == "wrong_row_bytes":
            table = table.clone()
            table[0, 1] += 1
            table[1, 1] -= 1
        else:
            raise ValueError(kind)
        blob = encode_message(
            HEADER,
            version=PROTOCOL_VERSION,
            seq=seq,
            request_id=rid,
            num_tokens=num_tokens,
            first_token=0,
            table=table_bytes(table),
            chunk_bytes=1 << 20,
            direct_min_bytes=1 << 20,
            checksum=False,
            offer=0,  # planned on no offer: the receiver answers it
        )
    seq = channel.ring_bell(blob)
    reply = channel.control.wait_value(reply_key(seq), 5.0)
    return "" if reply is None else reply.decode(errors="replace")


def _rebuild(state: dict, *, name: str, timeout_s: float | None = None) -> dict:
    return _connect(state, name=name, timeout_s=timeout_s)


def _close(state: dict, *, name: str) -> None:
    state["engines"].pop(name).close()


def _stop_for(state: dict, *, seconds: float) -> None:
    """Freeze this process (every thread) for `seconds`: a peer that goes silent, then comes back."""
    os.system(f"kill -STOP {os.getpid()}; sleep {seconds}; kill -CONT {os.getpid()}")


def _ready(state: dict) -> bool:
    """Answers once the peer has imported everything: a test's timeouts start after that."""
    return True


def _exit(state: dict) -> None:
    for engine in state["engines"].values():
        engine.close()


_HANDLERS = {
    "open": _open,
    "connect": _connect,
    "arena": _arena,
    "begin": _begin,
    "wait": _wait,
    "wait_digest": _wait_digest,
    "corrupt_header": _corrupt_header,
    "rebuild": _rebuild,
    "close": _close,
    "stop_for": _stop_for,
    "ready": _ready,
    "exit": _exit,
}


def devices(kind: str) -> tuple[str, str]:
    """(this process's device, the peer's device) for a test parameterised "cpu" | "cuda"."""
    return ("cpu", "cpu") if kind == "cpu" else ("cuda:0", "cuda:1")


def make_engine(
    rank: int,
    port: int,
    device: str = "cpu",
    *,
    name: str,
    options: dict | None = None,
    layout: dict | None = None,
    timeout_s: float = 10.0,
    fingerprint: str = FINGERPRINT,
    unexpected_wait_s: float = 1.0,
) -> EnvelopeSender | EnvelopeReceiver:
    """An unconnected engine on 127.0.0.1:`port`: the sender (options: TransferOptions fields) at
    rank 0, the receiver at rank 1."""
    channel = Channel(
        rank=rank,
        host="127.0.0.1",
        port=port,
        device=device,
        fingerprint=fingerprint,
        layout=LAYOUT if layout is None else layout,
        timeout_s=timeout_s,
        secret=SECRET,
        name=name,
    )
    if rank == 0:
        engine = EnvelopeSender(channel, TransferOptions(**(options or {})))
    else:
        engine = EnvelopeReceiver(channel, unexpected_wait_s=unexpected_wait_s)
    engine.start()
    return engine


def open_pair(peer: Peer, *, local_rank: int, device: str, name: str, options: dict | None = None):
    """Open channel `name` with the peer; return this process's connected engine (the sender if
    `local_rank` is 0). `options` go to whichever end sends."""
    local_device, peer_device = devices(device)
    port = free_port()
    peer.start("open", name=name, rank=1 - local_rank, port=port, device=peer_device, options=options)
    engine = make_engine(local_rank, port, local_device, name=name, options=options)
    engine.connect()
    assert peer.result()["ok"]
    return engine
