"""Exactly-once effects for a user's own service that executes sagaloop steps.

A service that owns a database (the one sagaloop uses) can consume step messages itself and,
in ONE transaction on its own SQLAlchemy connection, write its business rows, the inbox row
that marks the message processed (with the reply it produced) and the reply in the outbox::

    store = SqlStore(url)
    with store.engine.begin() as conn:
        handle_step(store, conn, body, charge_card, app="billing")

where ``charge_card(conn, task) -> result`` does the business writes on the same
connection. A redelivered message finds its inbox row and re-sends the stored reply without
calling the handler, so the business rows are written exactly once. The engine's relay
publishes the reply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sagaloop import tracing
from sagaloop.engine.contract import UNENCODABLE_RESULT
from sagaloop.engine.messages import Envelope, engine_queue, inbox_key, step_result
from sagaloop.engine.ports import Clock, Outgoing, Store, SystemClock
from sagaloop.errors import ErrorInfo, MessageError, UnencodableError
from sagaloop.sagas.convert import encode_value

SERVICE_CONSUMER = "worker"  # shares the workers' inbox: one step message, one processing


@dataclasses.dataclass(frozen=True, slots=True)
class StepTask:
    """A step message as a user's service sees it."""

    run_id: str
    saga: str | None
    step: str
    position: int
    attempt: int
    idempotency_key: str
    direction: str
    args: dict[str, Any]
    result: Any
    in_doubt: bool
    message_id: str


def handle_step(
    store: Store,
    conn: Any,
    body: bytes,
    handler: Callable[[Any, StepTask], Any],
    *,
    app: str,
    clock: Clock | None = None,
) -> dict[str, Any]:
    """Process one step message inside the caller's open transaction ``conn`` (a SQLAlchemy
    Connection of the sagaloop database), calling ``handler(conn, task)``; return the reply
    payload queued for the engine. ``handler`` returns the step's JSON result, or raises: an
    :class:`~sagaloop.ApplicationError` with ``non_retryable=True`` fails the step for good;
    any other exception rolls the whole transaction back, so nothing is recorded and the
    message is delivered again. The handler runs inside a savepoint: a result that cannot be
    stored (a lone surrogate, an integer over Python's digit limit, NaN, too large) and a
    non-retryable failure roll back its writes alone, and the attempt is recorded as failed
    (not applied), so the engine retries it per the step's policy instead of the message
    coming back for ever."""
    clock = clock or SystemClock()
    tx = store.attach(conn)
    env = store.resolve(tx, Envelope.from_bytes(body))  # large values by reference
    if env.type != "step":
        raise MessageError(f"message type {env.type!r} is not a step")
    p = env.payload
    key = inbox_key(app, env)
    done, reply = store.inbox_get(tx, SERVICE_CONSUMER, key)
    if not done:
        task = StepTask(
            run_id=env.run_id,
            saga=env.saga,
            step=str(p.get("step")),
            position=env.position or 0,
            attempt=env.attempt or 1,
            idempotency_key=env.idempotency_key or "",
            direction=str(p.get("direction", "do")),
            args=dict(p.get("args") or {}),
            result=p.get("result"),
            in_doubt=bool(p.get("in_doubt")),
            message_id=env.message_id,
        )
        with tracing.step_attempt(env) as span:  # the span sagaloop.step (or .compensation)
            outcome = _outcome(conn, handler, task)
            reply = {"direction": task.direction, "worker": "service", **outcome}
            span.done(reply)
        store.inbox_put(tx, SERVICE_CONSUMER, key, reply, clock.now())
    now = clock.now()
    store.enqueue(tx, [Outgoing(engine_queue(app), step_result(env, reply, now))], now)
    return dict(reply)


def _outcome(conn: Any, handler: Callable[[Any, StepTask], Any], task: StepTask) -> dict[str, Any]:
    try:
        with conn.begin_nested():
            result = handler(conn, task)
            encode_value(result, what=f"result of step {task.step!r}")
    except UnencodableError as e:
        info = ErrorInfo(UNENCODABLE_RESULT, f"{e} (its writes were rolled back)", not_applied=True)
        return {"outcome": "failed", "error": info.to_json()}
    except Exception as e:
        info = ErrorInfo.from_exception(e)
        if not info.non_retryable:
            raise
        tracing.failed(e)
        return {"outcome": "failed", "error": info.to_json()}
    return {"outcome": "completed", "result": result}
