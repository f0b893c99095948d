"""sagaloop: durable AI-agent loops as message-broker-backed sagas.

Declare sagas and steps on an :class:`App`; the engine replays saga code deterministically from
its history, so a run survives any process dying, and every step's effect is recorded exactly
once. :func:`connect` opens a :class:`Client` from a database URL; :class:`Service` runs the
engine, workers, timers and relay of an app on threads in the caller's process. Each public name
is imported when first used: ``import sagaloop`` loads neither pydantic, SQLAlchemy nor a driver.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sagaloop.client import Client
    from sagaloop.engine.listing import RunOrder, run_cursor
    from sagaloop.engine.state import ALL_STATUSES
    from sagaloop.errors import (
        ApplicationError,
        ApprovalDenied,
        ApprovalTakenError,
        CompleteAsync,
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
        StepAttemptGoneError,
        StepCancelled,
        StepFailedError,
        UpdateFailedError,
        UpdateRefusedError,
        ValidationError,
    )
    from sagaloop.runtime.assembly import Roles, Tuning
    from sagaloop.runtime.connect import connect
    from sagaloop.runtime.service import Service
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

_LAZY = {
    "ALL_STATUSES": "sagaloop.engine.state",
    "App": "sagaloop.sagas",
    "ApplicationError": "sagaloop.errors",
    "Approval": "sagaloop.sagas.approvals",
    "ApprovalDenied": "sagaloop.errors",
    "ApprovalTakenError": "sagaloop.errors",
    "Client": "sagaloop.client",
    "CompleteAsync": "sagaloop.errors",
    "Concurrency": "sagaloop.sagas.concurrency",
    "DEFAULT_CANCEL_GRACE": "sagaloop.sagas.app",
    "Debounce": "sagaloop.sagas.debounce",
    "DeclarationError": "sagaloop.errors",
    "EventTimeoutError": "sagaloop.errors",
    "NonDeterminismError": "sagaloop.errors",
    "NotAppliedError": "sagaloop.errors",
    "OverloadedError": "sagaloop.errors",
    "PublishedEvent": "sagaloop.sagas.published",
    "Received": "sagaloop.sagas",
    "RetryPolicy": "sagaloop.sagas",
    "Roles": "sagaloop.runtime.assembly",
    "RunFinishedError": "sagaloop.errors",
    "RunNotFoundError": "sagaloop.errors",
    "RunOrder": "sagaloop.engine.listing",
    "RunStateError": "sagaloop.errors",
    "SagaContext": "sagaloop.sagas",
    "SagaDef": "sagaloop.sagas",
    "SagaFailedError": "sagaloop.errors",
    "SagaloopError": "sagaloop.errors",
    "Service": "sagaloop.runtime.service",
    "StepAttemptGoneError": "sagaloop.errors",
    "StepCancelled": "sagaloop.errors",
    "StepContext": "sagaloop.sagas",
    "StepDef": "sagaloop.sagas",
    "StepFailedError": "sagaloop.errors",
    "Tuning": "sagaloop.runtime.assembly",
    "UpdateFailedError": "sagaloop.errors",
    "UpdateRefusedError": "sagaloop.errors",
    "ValidationError": "sagaloop.errors",
    "connect": "sagaloop.runtime.connect",
    "current_saga": "sagaloop.sagas",
    "current_step": "sagaloop.runtime.steps",
    "run_cursor": "sagaloop.engine.listing",
}
"""Where each public name is defined: imported on first use, so that ``import sagaloop`` (and
``sagaloop --help``, which imports the package first) loads neither pydantic nor SQLAlchemy,
nor a driver."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # imported once
        return value
    raise AttributeError(f"module 'sagaloop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})  # the lazy names too (a REPL completes them)


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
    "CompleteAsync",
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
    "RunOrder",
    "RunStateError",
    "SagaContext",
    "SagaDef",
    "SagaFailedError",
    "SagaloopError",
    "Service",
    "StepAttemptGoneError",
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
    "run_cursor",
]
