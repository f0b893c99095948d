"""Declaring sagas and steps: no I/O, no drivers."""

from sagaloop.sagas.app import App, SagaDef, StepDef
from sagaloop.sagas.context import SagaContext, StepContext
from sagaloop.sagas.policy import RetryPolicy

__all__ = ["App", "RetryPolicy", "SagaContext", "SagaDef", "StepContext", "StepDef"]
