"""What a `DeploymentSpec` refuses before Ray or any actor starts, beside the configurator's own
refusals: TP sizes the model implementation or the placement cannot run, and a colocated deployment
(no prefill workers) of what its decode workers cannot prefill themselves. Each raises a
`DeploymentRefused` carrying the facts; the command line words it with its flags and the fix."""

from __future__ import annotations

from distpool.facts import Facts
from distpool.memory.sizing import size_pools, size_tp_pools
from distpool.worker.config import WorkerConfig

# Why a deployment is refused (`DeploymentRefused.problem`).
PREFILL_TP_WITHOUT_PREFILL = "prefill_tp_without_prefill"  # a prefill TP size, and no prefill worker
COLOCATED_DECODE_TP = "colocated_decode_tp"  # colocated decode past TP 1 prefills nothing itself
COLOCATED_WITHOUT_STATE = "colocated_without_state"  # colocated chunked prefill needs recurrent state
TP_WITH_TRANSFORMERS = "tp_with_transformers"  # the transformers runner runs at TP 1 only
TP_WITH_SPREAD = "tp_with_spread"  # a TP group is packed on one node


class DeploymentRefused(Facts, ValueError):
    """A deployment refused for `problem` (one of the names above), with its TP sizes and the
    model's `architectures` and `kind`."""

    def __init__(self, problem: str, prefill_tp: int, decode_tp: int, architectures: str, kind: str) -> None:
        super().__init__(
            f"deployment refused ({problem}): prefill TP {prefill_tp}, decode TP {decode_tp}, "
            f"{architectures} ({kind})"
        )
        self.problem, self.prefill_tp, self.decode_tp = problem, prefill_tp, decode_tp
        self.architectures, self.kind = architectures, kind

    @classmethod
    def of(cls, problem: str, worker: WorkerConfig) -> DeploymentRefused:
        architectures = "/".join(worker.spec.architectures) or "this model"
        return cls(problem, worker.prefill_tp, worker.decode_tp, architectures, worker.spec.kind)


class TooFewNodes(Facts, ValueError):
    """A spread deployment of `workers` TP-1 workers, one per node, on a cluster of `nodes` live
    nodes (fewer): counted before placement, which would wait for nodes that never come."""

    def __init__(self, workers: int, nodes: int) -> None:
        super().__init__(f"{workers} workers spread one per node, but the cluster has {nodes} node(s)")
        self.workers, self.nodes = workers, nodes


class RankPoolRefused(Facts, ValueError):
    """Sizing refused one rank's pool of a `role` worker at TP `tp` (`tp` > 1): `refusal` says why."""

    def __init__(self, role: str, tp: int, refusal: ValueError) -> None:
        super().__init__(f"{role} at TP {tp}: {refusal}")
        self.role, self.tp, self.refusal = role, tp, refusal


def check_rank_pools(worker: WorkerConfig, roles: tuple[str, ...]) -> None:
    """Size each role's rank pool as its workers will: the shapes a rank stores, within the per-rank
    budget. A refusal at TP 1 is sizing's own; past TP 1, a `RankPoolRefused` naming the role."""
    for role in roles:
        tp = worker.tp_of(role)
        try:
            size_tp_pools(worker.spec, worker.for_role(role), worker.budget_bytes, tp)
        except ValueError as exc:
            if tp == 1:
                raise
            raise RankPoolRefused(role, tp, exc) from exc


def check_colocated(worker: WorkerConfig) -> None:
    """Refuse (`DeploymentRefused`) what a colocated deployment (no prefill workers) cannot serve:
    its decode workers prefill in chunks, continuing each request's recurrent state in place, at TP 1."""
    if worker.prefill_tp != 1:
        raise DeploymentRefused.of(PREFILL_TP_WITHOUT_PREFILL, worker)
    if worker.decode_tp != 1:
        raise DeploymentRefused.of(COLOCATED_DECODE_TP, worker)
    sizes = size_pools(worker.spec, worker.for_role("decode"), worker.budget_bytes)
    if not (sizes.slot_bytes and sizes.page_bytes):
        raise DeploymentRefused.of(COLOCATED_WITHOUT_STATE, worker)


def check_tensor_parallel(worker: WorkerConfig, model_impl: str, *, spread: bool) -> None:
    """Refuse (`DeploymentRefused`) what TP > 1 cannot run: the transformers runner, and workers
    spread one per node."""
    if worker.prefill_tp == worker.decode_tp == 1:
        return
    if model_impl == "transformers":
        raise DeploymentRefused.of(TP_WITH_TRANSFORMERS, worker)
    if spread:
        raise DeploymentRefused.of(TP_WITH_SPREAD, worker)
