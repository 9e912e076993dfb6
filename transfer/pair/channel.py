"""A channel: the two-rank process group joining one prefill worker (rank 0) and one decode worker (rank 1).

Each channel forms through a rendezvous at `host:port` (rank 0 listens there only while it waits
for rank 1, and both prove the deployment's secret; see `transfer.connect.rendezvous`), and gets its own
process group (Gloo for CPU arenas, NCCL for CUDA arenas), never the global default group, so one
process may hold many channels. Every (re)connect is a new generation: a fresh rendezvous, whose
store (`transfer.connect.relay_store`) lasts only while the groups form, and fresh groups.

The handshake exchanges layout fingerprints before any group exists; a mismatch raises
`FingerprintMismatch` on both ends, naming the differing fields. A failed wait marks the channel
broken; `connect()` again tears it down and connects a new generation, touching no other channel.
Small control messages go over the pair's own Gloo link (`channel.control`, see
`transfer.pair.control`); this class owns the groups' lifecycle and the payload sends and receives.

Tensor parallelism: a channel joins one rank of the prefill group and one of the decode group,
each end built with its own `tp=TpEnd.of(sizes, shard)`. Destination rank d opens a channel to
each source rank `transfer.plans.reshard.source_ranks(src_layout, dst_layout, d)` names (one port per
pair); with equal TP sizes that is rank r to rank r. After `connect()`, `tp_pair` says which two
ranks of which layouts it joins across TP sizes (None at equal sizes), and the engines move that
pair's share of each envelope (`transfer.plans.tp_pair`); the caller does nothing different.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from distpool.memory.sizing import TpEnd
from transfer.connect import (
    ControlAuth,
    RelayStore,
    RendezvousPort,
    agree_generation,
    channel_groups,
    close_links,
    delta,
    destroy_group,
    is_loopback,
    join_peer,
)
from transfer.pair.control import ControlPlane
from transfer.pair.handshake import exchange_hello, make_hello
from transfer.plans import TpPair
from transfer.wire import TAG_DATA, ArgInvalid, ChannelError, FailureKind, bell_key

SENDER_RANK, RECEIVER_RANK = 0, 1
# Gloo payload connections a rank's channels share by default: a channel of an equal-TP pair has
# them all; across TP sizes a rank moving over k channels at once gives each max(1, 2 // k), since
# every connection brings its own I/O thread, and on a small machine more of them cost throughput.
GLOO_STREAMS_PER_RANK = 2
CONTROL_JOIN_S = 1.0  # a closed link wakes the control threads at once; this only bounds the wait


class Channel:
    """One (prefill, decode) pair's process group. Rank 0 sends envelopes, rank 1 receives them.

    `fingerprint` and `layout` (the fields the fingerprint covers) must match the peer's;
    `timeout_s` bounds connect and rebuild. `num_streams` Gloo connections carry payload messages
    in parallel (NCCL always uses one ordered stream); by default two a rank, shared across TP
    sizes by the rank's channels (`GLOO_STREAMS_PER_RANK`). Not thread-safe: one engine drives it.
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
            expected = f"{SENDER_RANK} (prefill, sender) or {RECEIVER_RANK} (decode, receiver)"
            raise ArgInvalid("rank", rank, expected)
        if timeout_s <= 0:
            raise ArgInvalid("timeout_s", timeout_s, "> 0")
        if not 0 < port < 65536:
            raise ArgInvalid("port", port, "in 1..65535")
        self.rank, self.peer_rank = rank, 1 - rank
        self.host, self.port, self.name = host, port, name
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        default_streams = GLOO_STREAMS_PER_RANK if self.backend == "gloo" else 1
        self._streams_asked, self._default_streams = num_streams, default_streams
        self.num_streams = default_streams if num_streams is None else num_streams
        if self.num_streams < 1 or (self.backend == "nccl" and self.num_streams != 1):
            raise ArgInvalid("num_streams", num_streams, ">= 1 (exactly 1 with NCCL)")
        self.fingerprint = fingerprint
        self.layout = dict(layout or {})
        self.tp = tp  # this end's TP layout (None: TP 1), checked against the peer's in the handshake
        self.auth = ControlAuth(secret, name)  # every key and control message under the deployment's secret
        self.timeout_s = timeout_s
        self.generation = 0
        self.transfer_seq = 0  # next transfer of this generation (sender rings it, receiver awaits it)
        self.peer_hello: dict[str, Any] | None = None
        # The two ranks this channel joins across TP sizes (None: equal sizes, row i to row i), known
        # once the handshake has checked the peer's TP layout.
        self.tp_pair: TpPair | None = None
        self._port: RendezvousPort | None = None  # rank 0 holds its port across rebuilds
        self._control: ControlPlane | None = None  # this generation's control messages
        self._pg: dist.ProcessGroup | None = None  # payload (and on Gloo also control)
        self._control_pg: dist.ProcessGroup | None = None  # NCCL only: the Gloo group control uses
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
        the caller has freed those pages and handed them to another request. Nothing here waits
        for the peer, which may be the one that hung. With NCCL the control link stays up until the
        next connect, so that the peer still hears why.
        """
        self.mark_broken(reason)
        if self._control_pg is None and self._control is not None:  # Gloo: control goes with the group
            self._control.close(reason)
        self._destroy_group()

    @property
    def rejected_messages(self) -> int:
        """Control messages of this generation that did not open (dropped)."""
        return 0 if self._control is None else self._control.rejected

    @property
    def control(self) -> ControlPlane:
        """This generation's control plane; ChannelError when the channel is not connected."""
        if self._control is None:
            raise ChannelError(f"channel {self.name} is not connected: {self._broken}")
        return self._control

    # ---- lifecycle ----------------------------------------------------------------------------
    def connect(self, timeout_s: float | None = None) -> None:
        """Rendezvous, handshake and build the groups; raise ChannelError / FingerprintMismatch.
        The rendezvous is over when this returns, whatever the outcome."""
        self._teardown()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        store = None
        try:
            if self.rank == SENDER_RANK:
                if self._port is None:
                    self._port = RendezvousPort(self.host, self.port)
                peer = self._port.accept_peer(self.auth, deadline)
            else:
                peer = join_peer(self.host, self.port, self.auth, deadline)
            store = RelayStore([peer], name=f"channel {self.name}", timeout_s=deadline - time.monotonic())
            generation = agree_generation(store, rank=self.rank, last=self.generation, name=self.name)
            gen_store = dist.PrefixStore(f"g{generation}/", store)
            self.peer_hello = self._handshake(gen_store, generation, deadline)
            self.tp_pair = TpPair.of(self.tp, self.peer_hello, sending=self.rank == SENDER_RANK)
            self.num_streams = self._payload_streams()  # both ends alike: from the pair's layouts
            timeout, loopback = delta(deadline - time.monotonic()), is_loopback(self.host)
            self._pg, self._control_pg = channel_groups(  # NCCL: control gets a Gloo link of its own
                gen_store, self.rank, self.device, self.num_streams, timeout=timeout, loopback=loopback
            )
            control_group = self._control_pg or self._pg
            self.generation, self.transfer_seq = generation, 0
            self._control = ControlPlane(
                control_group,
                rank=self.rank,
                name=self.name,
                auth=self.auth,
                generation=generation,
                on_gone=self.mark_broken,
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
        finally:
            if store is not None:  # the groups formed (or never will): the rendezvous is over
                store.close()

    def close(self) -> None:
        """Tear down the groups and give the port up; the channel cannot be used again."""
        self._teardown("closed")
        if self._port is not None:
            self._port.close()
            self._port = None
        self._broken = "closed"

    def _teardown(self, reason: str = "torn down") -> None:
        if self._control is not None:  # its waits fail from now on; the links' closing ends its threads
            self._control.close(reason)
        self._destroy_group()
        if self._control_pg is not None:
            close_links(self._control_pg, self.peer_rank, 1)
        if self._control is not None:
            self._control.join(CONTROL_JOIN_S)  # before the groups their waits use are dropped
        self._control, self._control_pg = None, None
        self._broken = self._broken or reason

    def _destroy_group(self) -> None:
        if self._pg is not None:
            destroy_group(self._pg, self.backend, self.peer_rank, self.num_streams)
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

    def _ping(self, deadline: float) -> None:
        """One round trip: proves both ranks hold the same generation (and inits NCCL eagerly)."""
        token = torch.tensor([self.generation], dtype=torch.int64, device=self.device)
        echo = torch.zeros_like(token)
        if self.rank == SENDER_RANK:
            self.wait(self.send(token, TAG_DATA), deadline, "ping")
            self.wait(self.recv(echo, TAG_DATA), deadline, "ping reply")
        else:
            self.wait(self.recv(echo, TAG_DATA), deadline, "ping")
            self.wait(self.send(echo, TAG_DATA), deadline, "ping reply")
        if int(echo.item()) != self.generation:
            raise ChannelError(
                f"channel {self.name}: peer is on generation {int(echo.item())}, "
                f"this rank on {self.generation}"
            )

    def _payload_streams(self) -> int:
        """This generation's payload connections: as asked; by default on Gloo, across TP sizes,
        `GLOO_STREAMS_PER_RANK` shared by the channels the busier of the pair's two ranks moves
        over at once (each at least one)."""
        if self._streams_asked is not None:
            return self._streams_asked
        if self.backend != "gloo" or self.tp_pair is None:
            return self._default_streams
        return max(1, GLOO_STREAMS_PER_RANK // self.tp_pair.channels_per_rank)

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
            raise ChannelError(reason, kind=FailureKind.TIMEOUT)
        try:
            work.wait(delta(remaining))
        except Exception as exc:
            # Gloo raises the same RuntimeError for a wait that timed out and for a peer that went
            # away; either way the group is unusable and the reason keeps torch's own words. A
            # deadline is what ended the wait: it counts as a timeout.
            reason = f"{what}: timed out after {remaining:.2f} s, or the peer or link failed: "
            reason += str(exc).splitlines()[0][:200]
            self.mark_broken(reason)
            raise ChannelError(reason, kind=FailureKind.TIMEOUT) from None

    # ---- bells: the sequence of transfers on this generation ------------------------------------
    def ring_bell(self, header: bytes) -> int:
        """Sender: announce the next transfer with its header; returns its sequence number."""
        seq = self.transfer_seq
        self.control.send(bell_key(seq), header)
        self.transfer_seq += 1
        return seq

    def wait_bell(self, timeout_s: float) -> tuple[int, bytes] | None:
        """Receiver: block until the sender rings (seq, header); None on timeout, ChannelError once
        the channel is torn down.

        Safe to call without the engine's lock: a reconnect meanwhile fails the wait, and then
        nothing of the new generation is touched.
        """
        control, generation, seq = self.control, self.generation, self.transfer_seq
        value = control.wait_value(bell_key(seq), timeout_s)
        if value is None or generation != self.generation:
            return None
        self.transfer_seq += 1
        return seq, value
