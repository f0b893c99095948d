"""Steps completed from outside (Temporal's async activity completion), as pure functions.

A step's body calls ``ctx.complete_async()`` after handing its ``ctx.task_token`` to an outside
system; its reply says ``handed_off`` and the engine records ``step_handed_off``: the attempt
stays in flight. The outside system later completes or fails the attempt through the client
(``Client.complete_step``/``fail_step``), which sends a ``step_result`` naming the attempt; the
engine takes it as it takes a worker's reply (a late one, for an attempt no longer current,
changes nothing). ``Client.heartbeat_step`` sends a ``handed_off`` reply again: recorded as
``step_heartbeat``, it starts the ``heartbeat_timeout`` again.

If the step has a ``timeout`` (measured from the attempt's dispatch) or a ``heartbeat_timeout``
(from the hand-off or the last heartbeat), an ``attempt_timeout`` timer fails the attempt still
handed off at the first of them, in doubt (the outside system may have acted), and the step's
``RetryPolicy`` applies: a retry runs the body again, which hands off again with a new token.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime

from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import StepReply, TimerKind
from sagaloop.engine.ports import Timer
from sagaloop.errors import ErrorInfo, ValidationError
from sagaloop.sagas.app import App

TIMED_OUT = "StepTimeoutError"
"""The error type of a handed-off attempt failed by its timeout (as a worker's timeout)."""


@dataclass(frozen=True)
class TaskToken:
    """What a task token names: one attempt of the step at ``position`` of run ``run_id`` of
    ``app``."""

    app: str
    run_id: str
    position: int
    attempt: int

    def encode(self) -> str:
        """The opaque token: URL-safe base64 (no padding) of its JSON."""
        data = {"app": self.app, "run": self.run_id, "pos": self.position, "attempt": self.attempt}
        raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str) -> TaskToken:
        """The attempt ``token`` names; ``ValidationError`` if it is not a sagaloop task token."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = json.loads(raw)
            found = cls(str(data["app"]), str(data["run"]), int(data["pos"]), int(data["attempt"]))
        except (binascii.Error, ValueError, TypeError, KeyError) as e:
            raise ValidationError(
                f"{token[:40]!r} is not a sagaloop task token (StepContext.task_token)"
            ) from e
        if not found.run_id or found.position < 0 or found.attempt < 1:
            raise ValidationError(f"{token[:40]!r} is not a sagaloop task token")
        return found


def waiting(st: s.RunState, pos: int, attempt: int) -> bool:
    """Whether attempt ``attempt`` of the step at ``pos`` is handed off and still waits to be
    completed from outside."""
    step = st.steps.get(pos)
    return (
        step is not None
        and step.status == s.SCHEDULED
        and step.attempt == attempt
        and step.handed_off == attempt
    )


def current(st: s.RunState, pos: int, attempt: int) -> bool:
    """Whether ``attempt`` is the current attempt of the step at ``pos`` and in flight: what a
    completion from outside may settle. Its hand-off need not be recorded yet: the outside
    system may act on the token before the worker's ``handed_off`` reply reaches the engine
    (whichever comes second is then a late reply, or a heartbeat)."""
    step = st.steps.get(pos)
    return step is not None and step.status == s.SCHEDULED and step.attempt == attempt


def reply_events(
    app: App, st: s.RunState, pos: int, attempt: int, reply: StepReply
) -> list[NewEvent]:
    """What a ``handed_off`` reply of the current attempt records: ``step_handed_off`` the
    first time (the worker's reply), ``step_heartbeat`` after (the client's heartbeat); none
    for an attempt no longer current."""
    step = st.steps[pos]
    if step.status != s.SCHEDULED or step.attempt != attempt:
        return []  # a late or duplicate reply
    if step.handed_off == attempt:
        beat = {
            "attempt": attempt,
            **({"details": reply.result} if reply.result is not None else {}),
        }
        return [NewEvent(h.STEP_HEARTBEAT, pos, step.name, beat)]
    token = TaskToken(app.name, st.run_id, pos, attempt).encode()
    data = {"attempt": attempt, "token": token, "worker": reply.worker}
    return [NewEvent(h.STEP_HANDED_OFF, pos, step.name, data)]


def timer(app: App, st: s.RunState, pos: int) -> Timer | None:
    """The ``attempt_timeout`` timer of the handed-off attempt at ``pos`` (set again by each
    heartbeat), or None when its step has neither ``timeout`` nor ``heartbeat_timeout``."""
    step_state = st.steps[pos]
    step = app.get_step(step_state.name)
    if step is None or step_state.handed_off is None or step_state.beat_at is None:
        return None
    ends: list[datetime] = []
    if step.timeout is not None:
        started = step_state.attempts[-1].at if step_state.attempts else step_state.beat_at
        ends.append(started + step.timeout)
    if step.heartbeat_timeout is not None:
        ends.append(step_state.beat_at + step.heartbeat_timeout)
    if not ends:
        return None
    return Timer(st.run_id, pos, TimerKind.ATTEMPT_TIMEOUT, min(ends), step_state.handed_off)


def timeout_error(app: App, st: s.RunState, pos: int) -> ErrorInfo:
    """The error of a handed-off attempt whose timeout passed."""
    step_state = st.steps[pos]
    step = app.get_step(step_state.name)
    limits = []
    if step is not None and step.timeout is not None:
        limits.append(f"within its timeout of {step.timeout}")
    if step is not None and step.heartbeat_timeout is not None:
        limits.append(f"with a heartbeat every {step.heartbeat_timeout}")
    return ErrorInfo(
        TIMED_OUT,
        f"step {step_state.name!r} was handed off (attempt {step_state.attempt}) and not "
        f"completed from outside {' or '.join(limits) or 'in time'}; the outside system may "
        "still have acted (in doubt)",
    )
