"""sagaloop: durable AI-agent loops as message-broker-backed sagas.

Declare sagas and steps on an :class:`App`; the engine replays saga code deterministically from
its history, so a run survives any process dying, and every step's effect is recorded exactly
once.
"""

from sagaloop.client import Client
from sagaloop.engine.state import ALL_STATUSES
from sagaloop.errors import (
    ApplicationError,
    ApprovalDenied,
    ApprovalTakenError,
    DeclarationError,
    EventTimeoutError,
    NonDeterminismError,
    NotAppliedError,
    OverloadedError,
    RunFinishedError,
    RunNotFoundError,
    RunStateError,
    SagaFailedError,
    SagaloopError,
    StepCancelled,
    StepFailedError,
    ValidationError,
)
from sagaloop.runtime.steps import current_step
from sagaloop.sagas import (
    App,
    Received,
    RetryPolicy,
    SagaContext,
    SagaDef,
    StepContext,
    StepDef,
    current_saga,
)
from sagaloop.sagas.approvals import Approval

__version__ = "0.1.0"

__all__ = [
    "ALL_STATUSES",
    "App",
    "ApplicationError",
    "Approval",
    "ApprovalDenied",
    "ApprovalTakenError",
    "Client",
    "DeclarationError",
    "EventTimeoutError",
    "NonDeterminismError",
    "NotAppliedError",
    "OverloadedError",
    "Received",
    "RetryPolicy",
    "RunFinishedError",
    "RunNotFoundError",
    "RunStateError",
    "SagaContext",
    "SagaDef",
    "SagaFailedError",
    "SagaloopError",
    "StepCancelled",
    "StepContext",
    "StepDef",
    "StepFailedError",
    "ValidationError",
    "__version__",
    "current_saga",
    "current_step",
]
