"""Builds a PD deployment on Ray: prefill and decode actors, placement, one channel per pair.

Configurator refusals surface here before any actor exists. With GPUs each worker gets its own GPU
through a placement group (spread across nodes when asked); without GPUs workers are CPU processes.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from decode.worker import DecodeWorker
from distpool.configs import REFERENCE_CONFIG
from distpool.configurator import PoolArgs, plan
from distpool.reference_model import ReferenceModel
from distpool.spec import HYBRID_MAMBA, ModelSpec
from prefill.worker import PrefillWorker

ACTOR_CONCURRENCY = 16  # transfers, polls and stats run beside the decode loop


@dataclass(frozen=True)
class DeploymentSpec:
    model_config: str = str(REFERENCE_CONFIG)
    num_prefill: int = 1
    num_decode: int = 1
    pool_args: PoolArgs = PoolArgs()
    unified: bool | None = None  # None: unified for hybrid Mamba, static pools otherwise
    budget_bytes: int = 256 << 20  # per worker
    device: str = "auto"
    spread: bool = False  # place every worker on a different node
    seed: int = 0
    transfer_timeout_s: float = 10.0
    chunk_bytes: int = 32 << 20

    def resolved_pool_args(self, spec: ModelSpec) -> PoolArgs:
        unified = spec.kind == HYBRID_MAMBA if self.unified is None else self.unified
        return dataclasses.replace(self.pool_args, enable_unified_memory=unified)

    def validate(self) -> ModelSpec:
        """Run the configurator for both roles and check the workers can run the model; raises
        ValueError before anything starts."""
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"need at least 1 prefill and 1 decode worker; got {self.num_prefill}P{self.num_decode}D"
            )
        spec = ModelSpec.from_hf(self.model_config)
        args = self.resolved_pool_args(spec)
        for mode in ("prefill", "decode"):
            plan(spec, dataclasses.replace(args, disaggregation_mode=mode), self.budget_bytes)
        ReferenceModel(self.model_config, seed=self.seed)  # workers run it: refuse what they cannot
        return spec


class Deployment:
    """Live actors of one deployment. `prefill` / `decode` map worker names to actor handles."""

    def __init__(self, spec: DeploymentSpec) -> None:
        self.spec = spec
        self.prefill: dict[str, ray.actor.ActorHandle] = {}
        self.decode: dict[str, ray.actor.ActorHandle] = {}
        self.placement = None
        self._ports = itertools.count()

    @classmethod
    def start(cls, spec: DeploymentSpec) -> Deployment:
        model = spec.validate()
        dep = cls(spec)
        try:
            dep._start_actors(spec.resolved_pool_args(model))
            ray.get([ref for p in dep.prefill for d in dep.decode for ref in dep.connect(p, d)])
        except BaseException:
            dep.shutdown()
            raise
        return dep

    def _start_actors(self, pool_args: PoolArgs) -> None:
        spec = self.spec
        names = [f"prefill-{i}" for i in range(spec.num_prefill)] + [
            f"decode-{i}" for i in range(spec.num_decode)
        ]
        gpus = ray.cluster_resources().get("GPU", 0) >= len(names) and spec.device in ("auto", "cuda")
        if gpus or spec.spread:
            bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
            strategy = "STRICT_SPREAD" if spec.spread else "PACK"
            self.placement = placement_group([bundle] * len(names), strategy=strategy)
            ray.get(self.placement.ready(), timeout=60)
        for index, name in enumerate(names):
            options: dict = {"num_cpus": 1, "max_concurrency": ACTOR_CONCURRENCY}
            if self.placement is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement, placement_group_bundle_index=index
                )
                if gpus:
                    options["num_gpus"] = 1
            cls = PrefillWorker if name.startswith("prefill") else DecodeWorker
            handle = (
                ray.remote(cls)
                .options(**options)
                .remote(
                    name=name,
                    model_config=spec.model_config,
                    pool_args=pool_args,
                    budget_bytes=spec.budget_bytes,
                    device="cuda" if gpus else ("cpu" if spec.device == "auto" else spec.device),
                    seed=spec.seed,
                    transfer_timeout_s=spec.transfer_timeout_s,
                    chunk_bytes=spec.chunk_bytes,
                )
            )
            (self.prefill if cls is PrefillWorker else self.decode)[name] = handle
        ray.get([h.ping.remote() for h in self.handles().values()])

    def handles(self) -> dict[str, ray.actor.ActorHandle]:
        return {**self.prefill, **self.decode}

    def connect(self, prefill_name: str, decode_name: str) -> list[ray.ObjectRef]:
        """(Re)build the channel of one pair; returns refs that resolve when both ends are up.

        The prefill end hosts the rendezvous store on its node and keeps it across rebuilds."""
        p, d = self.prefill[prefill_name], self.decode[decode_name]
        host, port = ray.get(p.rendezvous_address.remote())
        return [
            p.open_channel.remote(decode_name, host, port),
            d.open_channel.remote(prefill_name, host, port),
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
