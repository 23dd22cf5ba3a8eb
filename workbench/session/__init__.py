"""Training-session primitives (Tinker's programming model): futures over a live policy.

    session = open_session(SessionSpec(model="tiny-sft"))   # workbench.opener

The clients (`session.clients`) are written once over an executor with two backends: in-process
threads (`create_session`) and Ray actors (`workbench.cluster.create_ray_session`), both running
the functions of `session.host`; the session both follow is `session.protocols.SessionLike`.
"""

from workbench.session.checkpoint import IncompleteCheckpoint, is_complete
from workbench.session.clients import SamplingClient, TrainingClient
from workbench.session.inprocess import Session, create_session, create_session_from_state
from workbench.session.losses import LOSSES, REDUCTIONS, LossConfig, loss_metrics
from workbench.session.spec import ClusterSpec, SessionSpec, SpeedSettings
from workbench.session.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampleResponse,
    datum_from_stream,
)

__all__ = [
    "LOSSES", "REDUCTIONS", "AdamParams", "ClusterSpec", "Datum", "ForwardBackwardOutput",
    "IncompleteCheckpoint", "LossConfig", "OptimStepOutput", "SampleResponse", "SamplingClient",
    "Session", "SessionSpec", "SpeedSettings", "TrainingClient", "create_session",
    "create_session_from_state", "datum_from_stream", "is_complete", "loss_metrics",
]
