"""The step contract the engine and the step runner share: the two directions of a step, the
keys and message ids derived from a step's position, the error type of an unencodable result,
and the rule for an attempt in doubt. The engine decides with these; the runtime
(``sagaloop.runtime.steps``) and users' own services (``sagaloop.outbox``) act on them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sagaloop.engine.messages import Direction as Direction
from sagaloop.engine.messages import derived_id

if TYPE_CHECKING:
    from sagaloop.sagas.app import StepDef


DO = Direction.DO
UNDO = Direction.UNDO
UNENCODABLE_RESULT = "UnencodableResult"
"""The error type of an attempt whose result could not be stored or sent (list it in a retry
policy's ``non_retryable_errors`` to fail such a step at once)."""


def idempotency_key(run_id: str, pos: int, direction: str) -> str:
    return f"{run_id}/{pos}/{direction}"


def task_message_id(run_id: str, pos: int, direction: str, attempt: int) -> str:
    return derived_id("step", run_id, pos, direction, attempt)


def halts_in_doubt(step: StepDef[Any, Any]) -> bool:
    """Whether an attempt of ``step`` that may have taken effect (in doubt) is halted rather
    than run again: the step is declared ``idempotent=False`` and has no reconcile function to
    look for an earlier attempt's effect. The engine halts such a step instead of retrying it,
    and a worker handed such an attempt halts it too, until a person checks the effect and
    retries the run."""
    return not step.idempotent and step.reconcile_fn is None
