"""What a `DeploymentSpec` refuses before Ray or any actor starts, beside the configurator's own
refusals: TP sizes the model implementation or the placement cannot run, and a colocated deployment
(`--prefill 0`) of what its decode workers cannot prefill themselves. Each raises ValueError with the fix."""

from __future__ import annotations

from distpool.memory.sizing import size_pools, size_tp_pools
from distpool.worker.config import WorkerConfig


class RankPoolRefused(ValueError):
    """Sizing refused one rank's pool of a `role` worker at TP `tp` (`tp` > 1): `refusal` says why."""

    def __init__(self, role: str, tp: int, refusal: ValueError) -> None:
        super().__init__(f"{role} at TP {tp}: {refusal}")
        self.role, self.tp, self.refusal = role, tp, refusal

    def __reduce__(self):
        return type(self), (self.role, self.tp, self.refusal)


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
    """Refuse (ValueError with the fix) what a colocated deployment (`--prefill 0`) cannot serve:
    its decode workers prefill in chunks, continuing each request's recurrent state in place, at TP 1."""
    if worker.prefill_tp != 1:
        raise ValueError(
            f"--prefill-tp {worker.prefill_tp} sizes prefill workers, and --prefill 0 starts none. "
            "Fix: drop --prefill-tp, or run prefill workers (--prefill 1)"
        )
    if worker.decode_tp != 1:
        raise ValueError(
            f"--decode-tp {worker.decode_tp} with --prefill 0: a decode worker of TP > 1 prefills nothing "
            "itself, so a colocated deployment serves at TP 1 only. Fix: --decode-tp 1, or run prefill "
            "workers (--prefill 1)"
        )
    sizes = size_pools(worker.spec, worker.for_role("decode"), worker.budget_bytes)
    if not (sizes.slot_bytes and sizes.page_bytes):
        raise ValueError(
            f"--prefill 0: a colocated worker prefills in chunks, each continuing the request's "
            f"recurrent state in place, and {'/'.join(worker.spec.architectures) or 'this model'} "
            f"({worker.spec.kind}) keeps no recurrent state beside KV pages. Fix: run prefill workers "
            "(--prefill 1), or serve a hybrid Mamba model"
        )


def check_tensor_parallel(worker: WorkerConfig, model_impl: str, *, spread: bool) -> None:
    """Refuse (ValueError with the fix) what TP > 1 cannot run: the transformers runner, and `--spread`."""
    sizes = f"--prefill-tp {worker.prefill_tp} --decode-tp {worker.decode_tp}"
    if worker.prefill_tp == worker.decode_tp == 1:
        return
    if model_impl == "transformers":
        raise ValueError(
            f"{sizes}: the transformers runner has no TP (transformers has no tensor-parallel plan for "
            "Mamba or gated delta net mixers). Fix: --prefill-tp 1 --decode-tp 1, or use --model-impl "
            "synthetic or reference"
        )
    if spread:
        raise ValueError(
            f"{sizes}: a TP group is packed on one node; --spread is for TP 1. Fix: drop --spread"
        )
