"""Builds a PD deployment on Ray: prefill and decode actors, placement, one channel per pair.

A `DeploymentSpec` is validated once, when it is made: configurator refusals and models the workers
cannot run surface there, before Ray or any actor starts. With GPUs each worker gets its own GPU
through a placement group (spread across nodes when asked); without GPUs workers are CPU processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from decode.worker import DecodeWorker
from distpool.memory.sizing import size_pools
from distpool.model.spec import HYBRID_MAMBA
from distpool.model_impl.select import choose_model_impl
from distpool.worker.config import WorkerConfig
from prefill.worker import PrefillWorker

ACTOR_CONCURRENCY = 16  # transfers, result waits and stats run beside the decode loop
MAX_RESTARTS = 3  # per worker and run: a worker that keeps dying is left dead
PLACEMENT_TIMEOUT_S = 60  # a placement group not ready by then never will be: say what it needed


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
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"need at least 1 prefill and 1 decode worker; got {self.num_prefill}P{self.num_decode}D"
            )
        for role in ("prefill", "decode"):
            size_pools(self.worker.spec, self.worker.for_role(role), self.worker.budget_bytes)
        # the reference model and the transformers runner refuse what they cannot run
        choose_model_impl(self.worker.spec, self.worker.model_impl, has_weights=self.worker.hf is not None)

    @classmethod
    def build(cls, worker: WorkerConfig, *, unified: bool | None = None, **counts) -> DeploymentSpec:
        """A spec whose workers use unified memory as `unified` says (None: for hybrid Mamba only)."""
        unified = worker.spec.kind == HYBRID_MAMBA if unified is None else unified
        args = dataclasses.replace(worker.pool_args, enable_unified_memory=unified)
        return cls(worker=dataclasses.replace(worker, pool_args=args), **counts)


class Deployment:
    """Live actors of one deployment. `prefill` / `decode` map worker names to actor handles."""

    def __init__(self, spec: DeploymentSpec) -> None:
        self.spec = spec
        self.prefill: dict[str, ray.actor.ActorHandle] = {}
        self.decode: dict[str, ray.actor.ActorHandle] = {}
        self.placement = None
        self.lives: dict[str, int] = {}  # worker -> how often it was restarted (and rejoined) so far

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
        gpus = ray.cluster_resources().get("GPU", 0) >= len(names) and worker.device in ("auto", "cuda")
        if gpus or spec.spread:
            nodes = sum(1 for node in ray.nodes() if node["Alive"])
            if spec.spread and nodes < len(names):
                raise ValueError(
                    f"--spread puts each of the {len(names)} workers on its own node, but the cluster has "
                    f"{nodes} node(s). Fix: drop --spread, or add nodes"
                )
            bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
            strategy = "STRICT_SPREAD" if spec.spread else "PACK"
            self.placement = placement_group([bundle] * len(names), strategy=strategy)
            try:
                ray.get(self.placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise ValueError(
                    f"the cluster could not place {len(names)} workers ({bundle} each, {strategy}) within "
                    f"{PLACEMENT_TIMEOUT_S} s. Fix: free or add resources, or run fewer workers"
                ) from None
        device = "cuda" if gpus else ("cpu" if worker.device == "auto" else worker.device)
        config = dataclasses.replace(worker, device=device)
        for index, name in enumerate(names):
            options: dict = {"num_cpus": 1, "max_concurrency": ACTOR_CONCURRENCY}
            if self.placement is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement, placement_group_bundle_index=index
                )
                if gpus:
                    options["num_gpus"] = 1
            cls = PrefillWorker if name.startswith("prefill") else DecodeWorker
            # Ray restarts a dead worker (a fresh instance of the same class and arguments); the
            # driver rebuilds its channels when it answers again (serving.recovery).
            options |= {"max_restarts": MAX_RESTARTS, "max_task_retries": 0}
            handle = ray.remote(cls).options(**options).remote(name=name, config=config)
            (self.prefill if cls is PrefillWorker else self.decode)[name] = handle
        ray.get([h.ping.remote() for h in self.handles().values()])

    def handles(self) -> dict[str, ray.actor.ActorHandle]:
        return {**self.prefill, **self.decode}

    def connect(self, prefill_name: str, decode_name: str) -> list[ray.ObjectRef]:
        """(Re)build the channel of one pair; returns refs that resolve when both ends are up.
        Blocks for the rendezvous address (the driver's async path uses `connect_async`)."""
        host, port = ray.get(self.prefill[prefill_name].rendezvous_address.remote(decode_name))
        return self._open(prefill_name, decode_name, host, port)

    async def connect_async(self, prefill_name: str, decode_name: str) -> None:
        """`connect` without blocking an event loop."""
        host, port = await self.prefill[prefill_name].rendezvous_address.remote(decode_name)
        for ref in self._open(prefill_name, decode_name, host, port):
            await ref

    def _open(self, prefill_name: str, decode_name: str, host: str, port: int) -> list[ray.ObjectRef]:
        # The prefill end holds the rendezvous port on its node and keeps it across rebuilds.
        p_life, d_life = self.lives.get(prefill_name, 0), self.lives.get(decode_name, 0)
        return [
            self.prefill[prefill_name].open_channel.remote(decode_name, host, port, d_life),
            self.decode[decode_name].open_channel.remote(prefill_name, host, port, p_life),
        ]

    def shutdown(self) -> None:
        for handle in self.handles().values():
            try:
                ray.kill(handle)
            except Exception:  # already dead: nothing to free
                pass
        self.prefill.clear()
        self.decode.clear()
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None
