"""A channel: the two-rank process group joining one prefill worker (rank 0) and one decode worker (rank 1).

Each channel makes its own rendezvous through a TCPStore at `host:port` (rank 0 hosts it; see
`transfer.rendezvous`) and its own process group (Gloo for CPU arenas, NCCL for CUDA arenas), never
the global default group, so one process may hold many channels. Every (re)connect is a new
generation: a fresh store prefix, so keys of a dead group never leak into the next one.

The handshake exchanges layout fingerprints before any group exists; a mismatch raises
`FingerprintMismatch` on both ends, naming the differing fields. A failed wait marks the channel
broken; `connect()` again tears it down and connects a new generation, touching no other channel.
Small control messages go through the generation's store (`channel.control`, see
`transfer.control`); this class owns the group's lifecycle and the payload sends and receives.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from distpool.memory.tp_layout import TpEnd
from transfer.auth import ControlAuth
from transfer.control import ControlPlane
from transfer.errors import ChannelError
from transfer.handshake import exchange_hello, make_hello
from transfer.protocol import TEARDOWN_MARK, bell_key
from transfer.rendezvous import delta, generation_store, host_store, is_loopback, join_store, next_generation

SENDER_RANK, RECEIVER_RANK = 0, 1


class Channel:
    """One (prefill, decode) pair's process group. Rank 0 sends envelopes, rank 1 receives them.

    `fingerprint` and `layout` (the fields the fingerprint covers) must match the peer's;
    `timeout_s` bounds connect and rebuild. `num_streams` Gloo connections carry payload messages
    in parallel (NCCL always uses one ordered stream). Not thread-safe: one engine drives it.
    """

    def __init__(
        self,
        *,
        rank: int,
        host: str,
        port: int,
        device: torch.device | str,
        fingerprint: str,
        layout: dict[str, Any] | None = None,
        timeout_s: float,
        secret: bytes,
        name: str = "distpool",
        num_streams: int | None = None,
        tp: TpEnd | None = None,
    ) -> None:
        if rank not in (SENDER_RANK, RECEIVER_RANK):
            raise ValueError(
                f"rank must be {SENDER_RANK} (prefill, sender) or {RECEIVER_RANK} (decode, receiver), "
                f"got {rank}"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self.rank, self.peer_rank = rank, 1 - rank
        self.host, self.port, self.name = host, port, name
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        default_streams = 2 if self.backend == "gloo" else 1
        self.num_streams = default_streams if num_streams is None else num_streams
        if self.num_streams < 1 or (self.backend == "nccl" and self.num_streams != 1):
            raise ValueError(f"num_streams must be >= 1 (exactly 1 with NCCL), got {num_streams}")
        self.fingerprint = fingerprint
        self.layout = dict(layout or {})
        self.tp = tp  # this end's TP layout (None: TP 1), checked against the peer's in the handshake
        self.auth = ControlAuth(secret, name)  # every key and control message under the deployment's secret
        self.timeout_s = timeout_s
        self.generation = 0
        self.transfer_seq = 0  # next transfer of this generation (sender rings it, receiver awaits it)
        self.peer_hello: dict[str, Any] | None = None
        self._store: dist.Store | None = None  # rank 0 keeps its store (the server) across rebuilds
        self._control: ControlPlane | None = None  # this generation's store keys
        self._pg: dist.ProcessGroup | None = None
        self._broken: str | None = "not connected"

    # ---- state --------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._broken is None

    @property
    def broken_reason(self) -> str | None:
        return self._broken

    def mark_broken(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason

    def tear_down(self, reason: str) -> None:
        """Mark the channel broken and destroy its group now (a rebuild makes a new one).

        A transfer that fails mid-stream calls this before it concludes: an NCCL receive still
        posted into the arena would otherwise land whenever the peer's bytes come, possibly after
        the caller has freed those pages and handed them to another request. No store traffic:
        the store's host may be the peer that hung, and this must not wait for it.
        """
        self.mark_broken(reason)
        self._destroy_group()

    @property
    def rejected_messages(self) -> int:
        """Control messages of this generation that were forged, replayed or garbage (dropped)."""
        return 0 if self._control is None else self._control.rejected

    @property
    def control(self) -> ControlPlane:
        """This generation's control plane; ChannelError when the channel is not connected."""
        if self._control is None:
            raise ChannelError(f"channel {self.name} is not connected: {self._broken}")
        return self._control

    # ---- lifecycle ----------------------------------------------------------------------------
    def connect(self, timeout_s: float | None = None) -> None:
        """Rendezvous, handshake and build the group; raise ChannelError / FingerprintMismatch."""
        self._teardown()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        try:
            if self.rank == SENDER_RANK and self._store is None:
                self._store = host_store(self.host, self.port, deadline)
            elif self.rank == RECEIVER_RANK:
                self._store = join_store(self.host, self.port, deadline)
            generation = next_generation(self._store, auth=self.auth, rank=self.rank, deadline=deadline)
            gen_store = generation_store(self._store, auth=self.auth, generation=generation)
            self.peer_hello = self._handshake(gen_store, generation, deadline)
            self._pg = self._make_group(gen_store, deadline)
            self.generation, self.transfer_seq = generation, 0
            bell_store = None
            if self.rank == RECEIVER_RANK:
                waiter = join_store(self.host, self.port, deadline)
                bell_store = generation_store(waiter, auth=self.auth, generation=generation)
            self._control = ControlPlane(
                gen_store,
                name=self.name,
                auth=self.auth,
                generation=generation,
                on_gone=self.mark_broken,
                bell_store=bell_store,
            )
            self._broken = None
            self._ping(deadline)
        except ChannelError:
            self._teardown()
            raise
        except Exception as exc:  # store / Gloo / NCCL errors arrive as RuntimeError subclasses
            self._teardown()
            raise ChannelError(
                f"channel {self.name} rank {self.rank} could not connect to "
                f"{self.host}:{self.port}: {type(exc).__name__}: {exc}"
            ) from None

    def close(self) -> None:
        """Tear down the group and drop the store; the channel cannot be used again."""
        self._teardown("closed")
        self._store = None
        self._broken = "closed"

    def _teardown(self, reason: str = "torn down") -> None:
        if self._control is not None:  # wake a receiver blocked on the next bell (ours or the peer's)
            self._control.wake(self.transfer_seq, reason)
        self._destroy_group()
        self._control = None
        if self.rank != SENDER_RANK:
            self._store = None  # a client reconnects each time: the server may have restarted
        self._broken = self._broken or reason

    def _destroy_group(self) -> None:
        if self._pg is not None:
            try:
                self._pg.abort() if self.backend == "nccl" else self._pg.shutdown()
            except Exception:  # a group already poisoned by its peer may refuse to shut down cleanly
                pass
        self._pg = None

    # ---- connect steps ------------------------------------------------------------------------
    def _handshake(self, gen_store: dist.Store, generation: int, deadline: float) -> dict[str, Any]:
        hello = make_hello(backend=self.backend, fingerprint=self.fingerprint, layout=self.layout, tp=self.tp)
        timeout = delta(deadline - time.monotonic())
        return exchange_hello(
            gen_store,
            auth=self.auth,
            generation=generation,
            rank=self.rank,
            hello=hello,
            timeout=timeout,
            tp=self.tp,
        )

    def _make_group(self, gen_store: dist.Store, deadline: float) -> dist.ProcessGroup:
        remaining = delta(deadline - time.monotonic())
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            # Our waits carry the deadlines (work.wait(timeout)); NCCL's watchdog would tear the
            # whole process down when its own timeout fires, so it gets one far beyond any deadline.
            options._timeout = datetime.timedelta(days=1)
            torch.cuda.set_device(self.device)
            return dist.ProcessGroupNCCL(gen_store, self.rank, 2, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = remaining
        gloo = dist.ProcessGroupGloo
        make_device = (
            (lambda: gloo.create_device(hostname="127.0.0.1"))
            if is_loopback(self.host)
            else (gloo.create_default_device)
        )
        # One device per stream: Gloo picks the connection for a message by tag % number of devices.
        options._devices = [make_device() for _ in range(self.num_streams)]
        return gloo(gen_store, self.rank, 2, options)

    def _ping(self, deadline: float) -> None:
        """One round trip: proves both ranks hold the same generation (and inits NCCL eagerly)."""
        token = torch.tensor([self.generation], dtype=torch.int64, device=self.device)
        echo = torch.zeros_like(token)
        if self.rank == SENDER_RANK:
            self.wait(self.send(token, 0), deadline, "ping")
            self.wait(self.recv(echo, 1), deadline, "ping reply")
        else:
            self.wait(self.recv(echo, 0), deadline, "ping")
            self.wait(self.send(echo, 1), deadline, "ping reply")
        if int(echo.item()) != self.generation:
            raise ChannelError(
                f"channel {self.name}: peer is on generation {int(echo.item())}, "
                f"this rank on {self.generation}"
            )

    # ---- messaging ----------------------------------------------------------------------------
    def _group(self) -> dist.ProcessGroup:
        if self._pg is None or self._broken is not None:
            raise ChannelError(f"channel {self.name} is not usable: {self._broken}")
        return self._pg

    def send(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        group = self._group()
        try:
            return group.send([tensor], self.peer_rank, tag)
        except Exception as exc:  # Gloo may write at once, and fail at once on a closed link
            raise self._link_failed("sending", exc) from None

    def recv(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        group = self._group()
        try:
            return group.recv([tensor], self.peer_rank, tag)
        except Exception as exc:
            raise self._link_failed("receiving", exc) from None

    def _link_failed(self, what: str, exc: Exception) -> ChannelError:
        reason = f"{what}: peer or link failed: {str(exc).splitlines()[0][:200]}"
        self.mark_broken(reason)
        return ChannelError(reason)

    def wait(self, work: dist.Work, deadline: float, what: str) -> None:
        """Wait for `work` until the monotonic `deadline`; on failure mark broken, raise ChannelError."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = f"{what}: the deadline passed before the wait began"
            self.mark_broken(reason)
            raise ChannelError(reason)
        try:
            work.wait(delta(remaining))
        except Exception as exc:
            # Gloo raises the same RuntimeError for a wait that timed out and for a peer that went
            # away; either way the group is unusable and the reason keeps torch's own words.
            reason = f"{what}: timed out after {remaining:.2f} s, or the peer or link failed: "
            reason += str(exc).splitlines()[0][:200]
            self.mark_broken(reason)
            raise ChannelError(reason) from None

    # ---- bells: the sequence of transfers on this generation ------------------------------------
    def ring_bell(self, header: bytes) -> int:
        """Sender: announce the next transfer with its header; returns its sequence number."""
        seq = self.transfer_seq
        if self.control.put_once(bell_key(seq), header) != header:
            self.mark_broken("the peer is tearing the channel down")
            raise ChannelError(f"channel {self.name}: {self._broken}")
        self.transfer_seq += 1
        return seq

    def wait_bell(self, timeout_s: float) -> tuple[int, bytes] | None:
        """Receiver: block until the sender rings (seq, header); None on timeout or teardown.

        Safe to call without the engine's lock: a reconnect meanwhile wakes it, and then nothing
        of the new generation is touched.
        """
        control, generation, seq = self.control, self.generation, self.transfer_seq
        value = control.wait_bell(seq, timeout_s)
        if value is None or generation != self.generation:
            return None
        if value.startswith(TEARDOWN_MARK):
            self.mark_broken(value[len(TEARDOWN_MARK) :].decode(errors="replace") or "torn down")
            return None
        self.transfer_seq += 1
        return seq, value
