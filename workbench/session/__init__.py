"""Training-session primitives (seed 003's programming model): futures over a live policy.

Backends: in-process (`create_session`); Ray actors come next with the same interface.
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
