"""sagaloop: durable AI-agent loops as message-broker-backed sagas.

Declare sagas and steps on an :class:`App`; the engine replays saga code deterministically from
its history, so a run survives any process dying, and every step's effect is recorded exactly
once. :func:`connect` opens a :class:`Client` from a database URL; :class:`Service` runs the
engine, workers, timers and relay of an app on threads in the caller's process (its drivers are
imported when first used: ``import sagaloop`` loads none).
"""

from typing import TYPE_CHECKING, Any

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
    UpdateFailedError,
    UpdateRefusedError,
    ValidationError,
)
from sagaloop.runtime.connect import connect
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
from sagaloop.sagas.app import DEFAULT_CANCEL_GRACE
from sagaloop.sagas.approvals import Approval
from sagaloop.sagas.concurrency import Concurrency
from sagaloop.sagas.debounce import Debounce
from sagaloop.sagas.published import PublishedEvent

if TYPE_CHECKING:
    from sagaloop.runtime.assembly import Roles, Tuning
    from sagaloop.runtime.service import Service

_LAZY = {"Roles": "assembly", "Service": "service", "Tuning": "assembly"}
"""Public names imported on first use (from ``sagaloop.runtime.<module>``): their modules
import the store's driver."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"sagaloop.runtime.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'sagaloop' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "ALL_STATUSES",
    "DEFAULT_CANCEL_GRACE",
    "App",
    "ApplicationError",
    "Approval",
    "ApprovalDenied",
    "ApprovalTakenError",
    "Client",
    "Concurrency",
    "Debounce",
    "DeclarationError",
    "EventTimeoutError",
    "NonDeterminismError",
    "NotAppliedError",
    "OverloadedError",
    "PublishedEvent",
    "Received",
    "RetryPolicy",
    "Roles",
    "RunFinishedError",
    "RunNotFoundError",
    "RunStateError",
    "SagaContext",
    "SagaDef",
    "SagaFailedError",
    "SagaloopError",
    "Service",
    "StepCancelled",
    "StepContext",
    "StepDef",
    "StepFailedError",
    "Tuning",
    "UpdateFailedError",
    "UpdateRefusedError",
    "ValidationError",
    "__version__",
    "connect",
    "current_saga",
    "current_step",
]
