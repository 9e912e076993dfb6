"""Builds a PD deployment on Ray: prefill and decode actors, placement, channels between them. With no
prefill workers (`--prefill 0`) it is colocated: each decode worker prefills its own requests, and no
channel is built.

A `DeploymentSpec` is validated once, when it is made: configurator refusals and models the workers
cannot run surface there, before Ray or any actor starts. With GPUs each worker gets its own GPU
through a placement group (spread across nodes when asked); without GPUs workers are CPU processes.
A worker of TP > 1 is a group of rank actors (one GPU or CPU process each) in a placement group of
its own whose bundles are packed on one node (STRICT_PACK); the driver calls it through a
`TpGroup`. Each pair of workers has one channel per pair of ranks that moves bytes
(`TpPairing.channels`): rank r to rank r at equal TP.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from decode.worker import DecodeWorker
from distpool.model.spec import HYBRID_MAMBA
from distpool.model_impl.select import choose_model_impl
from distpool.serving.deploy.deployment_checks import (
    TooFewNodes,
    check_colocated,
    check_rank_pools,
    check_tensor_parallel,
)
from distpool.serving.deploy.tp_group import TpGroup
from distpool.worker.config import WorkerConfig
from distpool.worker.tp_pairing import rank_name
from prefill.worker import PrefillWorker

ACTOR_CONCURRENCY = 16  # transfers, result waits and stats run beside the decode loop
MAX_RESTARTS = 3  # per worker and run: a worker that keeps dying is left dead
PLACEMENT_TIMEOUT_S = 60  # a placement group not ready by then never will be: say what it needed
LIFE_TIMEOUT_S = 5.0  # a rank that does not say which life it is in within this is taken as down
Handle = ray.actor.ActorHandle | TpGroup  # the driver's view of one worker


@dataclass(frozen=True)
class DeploymentSpec:
    """What to start: worker counts, placement, and the one `WorkerConfig` every worker gets.

    `unified=None` resolves to unified memory for hybrid Mamba models and static pools otherwise.
    Construction validates everything (ValueError with the fix), so an instance is always runnable.
    """

    worker: WorkerConfig
    num_prefill: int = 1
    num_decode: int = 1
    spread: bool = False  # place every worker on a different node

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(
                f"need at least 1 decode worker and no negative count of prefill workers (0: colocated); "
                f"got {self.num_prefill}P{self.num_decode}D. Fix: --decode 1 or more, --prefill 0 or more"
            )
        worker = self.worker
        # the reference model and the transformers runner refuse what they cannot run (first: a
        # transformers run at TP > 1 is refused for that, not for how its tensors would shard)
        name = choose_model_impl(worker.spec, worker.model_impl, has_weights=worker.hf is not None)
        if self.colocated:
            check_colocated(worker)
        check_tensor_parallel(worker, name, spread=self.spread)
        check_rank_pools(worker, ("decode",) if self.colocated else ("prefill", "decode"))

    @classmethod
    def build(cls, worker: WorkerConfig, *, unified: bool | None = None, **counts) -> DeploymentSpec:
        """A spec whose workers use unified memory as `unified` says (None: for hybrid Mamba only)."""
        unified = worker.spec.kind == HYBRID_MAMBA if unified is None else unified
        args = dataclasses.replace(worker.pool_args, enable_unified_memory=unified)
        return cls(worker=dataclasses.replace(worker, pool_args=args), **counts)

    @property
    def colocated(self) -> bool:
        """No prefill workers: each decode worker prefills its own requests (`LocalPrefills`)."""
        return self.num_prefill == 0

    @property
    def num_ranks(self) -> int:
        """Rank processes in all: one per worker at TP 1."""
        worker = self.worker
        return self.num_prefill * worker.prefill_tp + self.num_decode * worker.decode_tp


class Deployment:
    """Live actors of one deployment. `prefill` / `decode` map worker names to the driver's handle of
    each (an actor at TP 1, a `TpGroup` past it); `ranks` maps them to their rank actors."""

    def __init__(self, spec: DeploymentSpec) -> None:
        self.spec = spec
        self.pairing = spec.worker.pairing
        self.prefill: dict[str, Handle] = {}
        self.decode: dict[str, Handle] = {}
        self.ranks: dict[str, list[ray.actor.ActorHandle]] = {}
        self.placement = None
        self.group_placements: list = []  # one per worker of TP > 1
        self.lives: dict[str, int] = {}  # worker -> how often it was restarted (and rejoined) so far
        # worker of TP > 1 -> the lives (`WorkerBase.life`) its ranks last formed their group in
        self.formed_lives: dict[str, set[str]] = {}

    @classmethod
    def start(cls, spec: DeploymentSpec) -> Deployment:
        dep = cls(spec)
        try:
            dep._start_actors()
            ray.get([ref for p in dep.prefill for d in dep.decode for ref in dep.connect(p, d)])
        except BaseException:
            dep.shutdown()
            raise
        return dep

    def _start_actors(self) -> None:
        spec, worker = self.spec, self.spec.worker
        names = [f"prefill-{i}" for i in range(spec.num_prefill)] + [
            f"decode-{i}" for i in range(spec.num_decode)
        ]
        single = [n for n in names if worker.tp_of(_role(n)) == 1]  # share the deployment's placement
        gpus = ray.cluster_resources().get("GPU", 0) >= spec.num_ranks and worker.device in ("auto", "cuda")
        bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
        if (gpus or spec.spread) and single:
            nodes = sum(1 for node in ray.nodes() if node["Alive"])
            if spec.spread and nodes < len(single):
                raise TooFewNodes(len(single), nodes)
            self.placement = _placed(len(single), bundle, "STRICT_SPREAD" if spec.spread else "PACK")
        device = "cuda" if gpus else ("cpu" if worker.device == "auto" else worker.device)
        config = dataclasses.replace(worker, device=device)
        for name in names:
            tp, cls = worker.tp_of(_role(name)), PrefillWorker if _role(name) == "prefill" else DecodeWorker
            placement, first = (self.placement, single.index(name)) if tp == 1 else (None, 0)
            if tp > 1:  # the group's ranks together on one node
                placement = _placed(tp, bundle, "STRICT_PACK")
                self.group_placements.append(placement)
            ranks = []
            for rank in range(tp):
                options: dict = {"num_cpus": 1, "max_concurrency": ACTOR_CONCURRENCY}
                if placement is not None:
                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        placement_group=placement, placement_group_bundle_index=first + rank
                    )
                    if gpus:
                        options["num_gpus"] = 1
                # Ray restarts a dead rank (a fresh instance of the same class and arguments); the
                # driver takes its group down with it and rebuilds the channels when every rank
                # answers again (serving.deploy.recovery).
                options |= {"max_restarts": MAX_RESTARTS, "max_task_retries": 0}
                ranks.append(ray.remote(cls).options(**options).remote(name=name, config=config, rank=rank))
            self.ranks[name] = ranks
            (self.prefill if cls is PrefillWorker else self.decode)[name] = (
                ranks[0] if tp == 1 else TpGroup(name, ranks)
            )
        ray.get([h.ping.remote() for h in self.rank_handles().values()])
        forming = {name: self._form_tp_group(name) for name in self.ranks}
        for name, refs in forming.items():
            if refs:
                self.formed_lives[name] = set(ray.get(refs))

    def _form_tp_group(self, name: str) -> list[ray.ObjectRef]:
        """Past TP 1, the ranks of worker `name` form their process group (every rank has started:
        rank 0 holds the rendezvous port); refs that resolve to each rank's life once it formed.
        At TP 1, none."""
        ranks = self.ranks[name]
        if len(ranks) == 1:
            return []
        host, port = ray.get(ranks[0].rendezvous_address.remote())
        return [rank.join_tp_group.remote(host, port) for rank in ranks]

    async def form_tp_group_async(self, name: str) -> None:
        """`_form_tp_group` without blocking an event loop (a group Ray restarted forms anew); the
        driver's calls that compute reach the group again once it formed (`TpGroup.up`)."""
        ranks = self.ranks[name]
        if len(ranks) > 1:
            host, port = await ranks[0].rendezvous_address.remote()
            lives = await asyncio.gather(*(rank.join_tp_group.remote(host, port) for rank in ranks))
            self.formed_lives[name] = set(lives)
            self._group(name).up()

    def _group(self, name: str) -> TpGroup:
        group = self.handles()[name]
        if not isinstance(group, TpGroup):
            raise ValueError(f"{name} is a worker of one rank, not a TP group")
        return group

    def handles(self) -> dict[str, Handle]:
        return {**self.prefill, **self.decode}

    def rank_handles(self) -> dict[str, ray.actor.ActorHandle]:
        """Every rank actor by its rank's name (at TP 1: every worker by its name)."""
        return {
            rank_name(name, rank, len(ranks)): handle
            for name, ranks in self.ranks.items()
            for rank, handle in enumerate(ranks)
        }

    def worker_of(self, rank: str) -> str:
        """The worker a rank (named as `rank_handles` names it) belongs to."""
        return next(name for name, ranks in self.ranks.items() if rank in _rank_names(name, len(ranks)))

    def channel_ends(self, prefill_name: str, decode_name: str) -> list[tuple[str, str]]:
        """(prefill rank, decode rank) names of every channel between two workers."""
        worker = self.spec.worker
        return [
            (rank_name(prefill_name, s, worker.prefill_tp), rank_name(decode_name, d, worker.decode_tp))
            for s, d in self.pairing.channels
        ]

    def connect(self, prefill_name: str, decode_name: str) -> list[ray.ObjectRef]:
        """(Re)build the channels of one pair; returns refs that resolve when both ends are up.
        Blocks for the rendezvous addresses (the driver's async path uses `connect_async`)."""
        ranks, refs = self.rank_handles(), []
        for p_rank, d_rank in self.channel_ends(prefill_name, decode_name):
            host, port = ray.get(ranks[p_rank].rendezvous_address.remote(d_rank))
            refs += self._open(prefill_name, decode_name, (p_rank, d_rank), host, port)
        return refs

    async def connect_async(self, prefill_name: str, decode_name: str) -> None:
        """`connect` without blocking an event loop."""
        ranks, refs = self.rank_handles(), []
        for p_rank, d_rank in self.channel_ends(prefill_name, decode_name):
            host, port = await ranks[p_rank].rendezvous_address.remote(d_rank)
            refs += self._open(prefill_name, decode_name, (p_rank, d_rank), host, port)
        for ref in refs:
            await ref

    def _open(
        self, prefill_name: str, decode_name: str, ends: tuple[str, str], host: str, port: int
    ) -> list[ray.ObjectRef]:
        # The prefill end holds the rendezvous port on its node and keeps it across rebuilds.
        p_life, d_life = self.lives.get(prefill_name, 0), self.lives.get(decode_name, 0)
        ranks, (p_rank, d_rank) = self.rank_handles(), ends
        return [
            ranks[p_rank].open_channel.remote(d_rank, host, port, d_life),
            ranks[d_rank].open_channel.remote(p_rank, host, port, p_life),
        ]

    async def take_down(self, name: str) -> None:
        """Worker `name` lost a rank: restart the rest of its group with it (Ray restarts each rank
        it kills), so the group comes back as one, every pool empty. Every rank still in the life
        the group formed in goes down, and so does one that does not say which life it is in: a
        stopped process (`kill -STOP`) would resume in its old life, holding a group that is gone.
        A rank already in a new life (Ray restarted it) is left to start. At TP 1, nothing to do."""
        ranks = self.ranks[name]
        if len(ranks) == 1:
            return
        self._group(name).down()
        formed = self.formed_lives.get(name, set())
        lives = await asyncio.gather(
            *(asyncio.wait_for(r.life.remote(), LIFE_TIMEOUT_S) for r in ranks), return_exceptions=True
        )
        for rank, life in zip(ranks, lives, strict=True):
            if not isinstance(life, str) or life in formed:
                try:
                    ray.kill(rank, no_restart=False)
                except Exception:  # dead for good (its restarts used up): nothing to take down
                    pass

    async def answers(self, name: str, timeout_s: float) -> bool:
        """Whether every rank of worker `name` answers within `timeout_s`, in a life after the one
        its group last formed in (`take_down` ended that one)."""
        ended = self.formed_lives.get(name, set())
        lives = await asyncio.wait_for(
            asyncio.gather(*(r.life.remote() for r in self.ranks[name])), timeout_s
        )
        return not ended & set(lives)

    def shutdown(self) -> None:
        for handle in self.rank_handles().values():
            try:
                ray.kill(handle)
            except Exception:  # already dead: nothing to free
                pass
        self.prefill.clear()
        self.decode.clear()
        self.ranks.clear()
        for placement in [self.placement, *self.group_placements]:
            if placement is not None:
                remove_placement_group(placement)
        self.placement, self.group_placements = None, []


def _role(name: str) -> str:
    return "prefill" if name.startswith("prefill") else "decode"


def _rank_names(name: str, tp: int) -> list[str]:
    return [rank_name(name, rank, tp) for rank in range(tp)]


def _placed(count: int, bundle: dict, strategy: str):
    """A ready placement group of `count` `bundle`s; ValueError saying what it needed if the
    cluster cannot place it in time."""
    placement = placement_group([bundle] * count, strategy=strategy)
    try:
        ray.get(placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(placement)
        raise ValueError(
            f"the cluster could not place {count} workers ({bundle} each, {strategy}) within "
            f"{PLACEMENT_TIMEOUT_S} s. Fix: free or add resources, or run fewer workers"
        ) from None
    return placement
