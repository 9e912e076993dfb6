"""The deployment on Ray and its recovery: actors, placement, channels; lost and restarted workers.

`deployment.py`: prefill and decode actors, placement and channels (none when colocated), with what
a deployment refuses before Ray starts (`deployment_checks.py`: a `DeploymentRefused` with the
facts); `tp_group.py`: the driver's handle on a worker that is a TP group of ranks; `recovery.py`:
lost and restarted workers.
"""

from distpool.serving.deploy.deployment import Deployment, DeploymentSpec
from distpool.serving.deploy.deployment_checks import (
    COLOCATED_DECODE_TP,
    COLOCATED_WITHOUT_STATE,
    PREFILL_TP_WITHOUT_PREFILL,
    TP_WITH_SPREAD,
    TP_WITH_TRANSFORMERS,
    DeploymentRefused,
    RankPoolRefused,
    TooFewNodes,
)
from distpool.serving.deploy.recovery import PING_TIMEOUT_S, Recovery, WorkerLost

__all__ = [
    "COLOCATED_DECODE_TP",
    "COLOCATED_WITHOUT_STATE",
    "Deployment",
    "DeploymentRefused",
    "DeploymentSpec",
    "PING_TIMEOUT_S",
    "PREFILL_TP_WITHOUT_PREFILL",
    "RankPoolRefused",
    "Recovery",
    "TP_WITH_SPREAD",
    "TP_WITH_TRANSFORMERS",
    "TooFewNodes",
    "WorkerLost",
]
