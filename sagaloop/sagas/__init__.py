"""Declaring sagas and steps: no I/O, no drivers."""

from sagaloop.sagas.app import App, SagaDef, StepDef
from sagaloop.sagas.context import Received, SagaContext, StepContext, current_saga
from sagaloop.sagas.policy import RetryPolicy

__all__ = [
    "App",
    "Received",
    "RetryPolicy",
    "SagaContext",
    "SagaDef",
    "StepContext",
    "StepDef",
    "current_saga",
]
