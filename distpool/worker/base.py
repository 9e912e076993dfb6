"""What prefill and decode workers share: one pool, the model implementation, channels to peers, stats.

Workers touch memory only through the `Pool` interface (`distpool.memory.pool`).
"""

from __future__ import annotations

import os
import sys
import threading
import uuid

import torch

from distpool.memory.arena_pool import build_pool
from distpool.memory.pool import BandUsage, Pool
from distpool.memory.sizing import TpEnd, layout_description, size_tp_pools
from distpool.model.shard import shard
from distpool.model_impl.select import build_model_impl
from distpool.worker.config import WorkerConfig
from distpool.worker.lockstep import Lockstep
from distpool.worker.metrics import WorkerMetrics
from distpool.worker.stats import PoolHeld, WorkerStats
from distpool.worker.tp_pairing import rank_name
from transfer.connect import form_rank_group, reserve_port
from transfer.peers import RECEIVER_RANK, SENDER_RANK, PeerChannels
from transfer.plans import plan_runs

BANDS = ("pages", "slots")  # the bands whose peak a worker tracks
NO_BAND = BandUsage(capacity=0, free=0, held=0, pinned=0)  # a pool without that band


def byte_runs(ranges: torch.Tensor) -> int:
    """The runs of consecutive bytes an envelope's `ranges` sit in: what the transfer plan copies
    as one piece on this side."""
    return len(plan_runs(ranges, ranges))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class WorkerBase:
    role: str  # "prefill" | "decode": the disaggregation mode this worker's pool is planned for

    def __init__(self, *, name: str, config: WorkerConfig, rank: int = 0) -> None:
        """Rank `rank` of worker `name` (a TP group of `config.tp_of(role)` ranks, each a process
        with its own pool shard; at TP 1 the worker is its one rank)."""
        tp = config.tp_of(self.role)
        self.group, self.rank, self.name = name, rank, rank_name(name, rank, tp)
        self.config = config
        self.pairing = config.pairing
        self.device = resolve_device(config.device)
        self.shard = shard(config.spec, tp, rank)
        # Past TP 1 the ranks step as one (lockstep.py) over the group they form once all have started.
        self.lockstep = Lockstep(tp=tp, rank=rank, device=self.device) if tp > 1 else None
        # What computes in the pool: transformers' modeling code, the reference model or the synthetic
        # cache (the deployment refuses, before any worker starts, what cannot run at this TP).
        self.model = build_model_impl(
            config.spec,
            model_impl=config.model_impl,
            seed=config.seed,
            device=self.device,
            hf=config.hf,
            tp=tp,
            rank=rank,
            group=self.lockstep,
        )
        # One rank's pool, sized for the shapes it stores (at TP 1: the whole model's).
        self.sizes = size_tp_pools(config.spec, config.for_role(self.role), config.budget_bytes, tp).rank
        # Decode receives each request's state whole from prefill, so it keeps no checkpoints; past
        # TP 1 it prefills nothing itself (serving.path.local_path): no final state would be read.
        receives = self.role == "decode"
        built = build_pool(
            self.sizes,
            self.device,
            checkpoints=not receives,
            final_states=receives and config.local_prefill and tp == 1,
        )
        self.pool: Pool = built
        self.lock = threading.RLock()  # guards the pool and the model; never held across a transfer wait
        self.channels = PeerChannels(
            own_name=self.name,
            rank=SENDER_RANK if self.role == "prefill" else RECEIVER_RANK,
            fingerprint=built.fingerprint,
            layout=layout_description(self.sizes),
            device=self.device,
            options=config.transfer,
            secret=config.secret,
            # Past TP 1 on either side every rank presents its TP layout: the handshake checks that
            # the two ranks' shards pair, and a channel across TP sizes moves its pair's share.
            tp=None if config.prefill_tp == config.decode_tp == 1 else TpEnd.of(self.sizes, self.shard),
        )
        self._peak = dict.fromkeys(BANDS, 0)
        self.metrics = WorkerMetrics(self.name, self.role)  # Prometheus, through Ray (no-op without Ray)
        self._compactions_seen = (0, 0)  # what the metrics were told so far: count, bytes
        self._life = uuid.uuid4().hex

    # ---- identity and wiring ------------------------------------------------------------------
    def ping(self) -> str:
        return self.name

    def life(self) -> str:
        """This instance's own id: a rank Ray restarted answers with a new one."""
        return self._life

    def pid(self) -> int:
        """The worker's process id (what an operator kills, and what Ray restarts)."""
        return os.getpid()

    def node_id(self) -> str | None:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def rendezvous_address(self, peer: str | None = None) -> tuple[str, int]:
        """Where the channel to `peer` meets (prefill ends hold the port): the channel's own address
        when it exists (a rebuild keeps the port and forms a new generation), else a port of this
        node, bound and held here until this process's end of the channel (or of the TP group)
        listens on it (`reserve_port`): nothing else can take it in between."""
        import ray

        if peer is not None and (address := self.channels.address_of(peer)) is not None:
            return address
        host = "127.0.0.1"  # one node: the rendezvous listens on loopback only
        if ray.is_initialized() and sum(node["Alive"] for node in ray.nodes()) > 1:
            host = ray.util.get_node_ip_address()  # the address peers on other nodes reach
        return host, reserve_port(host)

    def open_channel(self, peer: str, host: str, port: int, peer_life: int = 0) -> None:
        """Open (or rebuild) the channel to `peer` in its `peer_life` (restarts so far); the peer must
        do the same concurrently. The prefill end holds the rendezvous port `host:port`."""
        self.channels.open(peer, host=host, port=port, peer_life=peer_life)

    def join_tp_group(self, host: str, port: int) -> str:
        """Form the process group of this worker's TP group with its other ranks, which call this at
        the same time (rank 0 holds the rendezvous port `host:port`); the ranks step as one from then
        on. Collectives on it time out after the transfer timeout. Returns this rank's `life`: the
        driver takes the group down by the lives it formed in (`Deployment.take_down`)."""
        if self.lockstep is None:
            raise ValueError(f"{self.name} is a TP group of one: it has no group to join")
        group = form_rank_group(
            name=f"{self.group}/tp",
            rank=self.rank,
            size=self.lockstep.size(),
            host=host,
            port=port,
            secret=self.config.secret,
            device=self.device,
            timeout_s=self.config.transfer.timeout_s,
        )
        with self.lock:
            self.lockstep.bind(group)
            self._group_formed()
        return self._life

    def _group_formed(self) -> None:
        """Under the lock: the TP group's process group is bound (a role starts stepping)."""

    def group_broken(self, exc: BaseException) -> None:
        """The TP group's collectives are out of step for good (`GroupBroken`): under Ray this rank
        exits, so Ray restarts it and the driver takes its group down and back as one; outside Ray
        (unit tests) the error is raised."""
        import ray

        print(f"distpool: {self.name}: the TP group broke: {exc}", file=sys.stderr, flush=True)
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            os._exit(1)
        raise exc

    def peer_ranks(self, peer: str) -> list[str]:
        """The ranks of worker `peer` (the other role) this rank holds a channel with."""
        return self.pairing.peer_names(self.role, self.rank, peer)

    def channel_broken(self, peer: str) -> bool:
        """Whether a channel to a rank of worker `peer` is broken."""
        return any(self.channels.broken(name) for name in self.peer_ranks(peer))

    def measure_link(self, peer: str, nbytes: int, repeats: int) -> float | None:
        """Raw messages of `nbytes` on the channel to `peer`, who calls this at the same time; the
        decode end returns the median seconds per message (see `transfer.ends.link`)."""
        return self.channels.measure_link(peer, nbytes, repeats)

    def plan_fault(self, request_id: str, kind: str | None) -> bool:
        """Inject `kind` (a fault of `transfer.faults`) into the next transfer of `request_id` here,
        on purpose (tests, `--fault-rate`); None forgets a plan not taken. Returns whether a plan
        not taken was dropped. See `FaultInjector`."""
        return self.channels.faults.plan(request_id, kind)

    def peer_lost(self, peer: str, peer_life: int) -> None:
        """Worker `peer` died in life `peer_life` (a TP group goes down as one): fail every transfer
        with its ranks now and drop their channels (its restart opens new ones; a late notice
        about an earlier life changes nothing)."""
        for name in self.peer_ranks(peer):
            self.channels.drop(name, peer_life)

    # ---- requests this worker owns ------------------------------------------------------------
    def _free(self, owned: dict, request_id: str, *, pinned: bool = False) -> bool:
        """Forget an owned request and give its memory back. Returns whether it was owned."""
        with self.lock:
            if owned.pop(request_id, None) is None:
                return False
            self.model.forget(request_id)
            if pinned:
                self.pool.unpin(request_id)
            self.pool.release(request_id)
            return True

    # ---- accounting ---------------------------------------------------------------------------
    def _note_peak(self) -> None:
        """Called after every reserve and decode step: reads only the allocator's cheap counts, and
        hands them (and new compactions) to the metrics."""
        usage = self.pool.usage()
        for name, band in usage.items():
            if name in self._peak:
                self._peak[name] = max(self._peak[name], band.held)
        pages, slots = usage.get("pages", NO_BAND), usage.get("slots", NO_BAND)
        self.metrics.set_usage(pages.held, pages.capacity, slots.held, slots.capacity)
        count, moved, _ = self.pool.compactions()
        seen_count, seen_moved = self._compactions_seen
        if count > seen_count:
            self.metrics.add_compactions(count - seen_count, moved - seen_moved)
            self._compactions_seen = (count, moved)

    def stats(self) -> WorkerStats:
        """The pool's occupancy and this worker's counters (a role adds its own: `PrefillStats`,
        `DecodeStats`); checks the pool's invariants."""
        with self.lock:
            self._note_peak()
            usage = self.pool.usage()
            self.pool.check_invariants()
            pages, slots = usage.get("pages", NO_BAND), usage.get("slots", NO_BAND)
            cache = self.pool.prefix_cache
            evicted_pages, evicted_checkpoints = cache.evicted if cache is not None else (0, 0)
            return WorkerStats(
                name=self.name,
                role=self.role,
                node_id=self.node_id(),
                rejected_control_messages=self.channels.rejected_messages(),
                pages_used=pages.held - pages.cached,  # held by requests
                pages_peak=self._peak["pages"],
                pages_capacity=pages.capacity,
                slots_used=slots.held - slots.cached,
                slots_peak=self._peak["slots"],
                slots_capacity=slots.capacity,
                cached_pages=pages.cached,
                checkpoints=slots.cached,
                evicted_pages=evicted_pages,
                evicted_checkpoints=evicted_checkpoints,
            )

    def drop_prefix_cache(self) -> PoolHeld:
        """Give back everything the prefix cache holds (the run is over); returns what the pool
        still holds then: with nothing in flight, anything left is a leak."""
        with self.lock:
            if self.pool.prefix_cache is not None:
                self.pool.prefix_cache.drop_all()
            self.pool.check_invariants()
            usage = self.pool.usage()
        return PoolHeld(
            pages_used=usage.get("pages", NO_BAND).held, slots_used=usage.get("slots", NO_BAND).held
        )

    def shutdown(self) -> None:
        self.channels.close_all()
