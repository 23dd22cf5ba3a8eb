"""Training-session primitives (seed 003's programming model): futures over a live policy.

Backends: in-process (`create_session`), and Ray actors with the same interface
(`workbench.cluster.create_ray_session`, which runs these same functions inside its actors).
"""

from workbench.session.checkpoint import IncompleteCheckpoint, is_complete
from workbench.session.inprocess import (
    SamplingClient,
    Session,
    TrainingClient,
    create_session,
    create_session_from_state,
)
from workbench.session.losses import LOSSES, REDUCTIONS, LossConfig, loss_metrics
from workbench.session.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampleResponse,
    datum_from_stream,
)

__all__ = [
    "LOSSES", "REDUCTIONS", "AdamParams", "Datum", "ForwardBackwardOutput", "IncompleteCheckpoint",
    "LossConfig", "OptimStepOutput", "SampleResponse", "SamplingClient", "Session",
    "TrainingClient", "create_session", "create_session_from_state", "datum_from_stream",
    "is_complete", "loss_metrics",
]
