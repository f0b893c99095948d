"""What :class:`~sagaloop.client.client.Client` does for steps completed from outside
(``Client.complete_step``, ``fail_step``, ``heartbeat_step``; see
:mod:`sagaloop.engine.handoff`).

Each reads the run named by the task token, refuses (``StepAttemptGoneError``, nothing sent)
an attempt that no longer waits to be completed from outside, and queues a ``step_result`` for
the run's engine through the store's outbox, as ``Client.send_event`` does. A completion's
message id derives from the token and its outcome, so a call repeated before the engine took
the first is taken once; one that races a timeout or a cancel is a late reply, which the engine
ignores."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from sagaloop.client.checks import check_message, to_json
from sagaloop.engine import handoff
from sagaloop.engine import state as s
from sagaloop.engine.contract import DO
from sagaloop.engine.messages import Envelope, Outcome, StepReply, derived_id
from sagaloop.engine.ports import RunRecord
from sagaloop.engine.state import RunState
from sagaloop.errors import ErrorInfo, StepAttemptGoneError, StepCancelled, ValidationError
from sagaloop.sagas.convert import ANY

if TYPE_CHECKING:
    from sagaloop.client.client import Client

OUTSIDE = "outside"
"""The ``worker`` a completion from outside names in its reply."""


def _waiting(client: Client, token: str) -> tuple[handoff.TaskToken, RunRecord, RunState]:
    """The attempt ``token`` names, its run and the run's state; ``StepAttemptGoneError`` if
    the attempt no longer waits to be completed from outside."""
    if not isinstance(token, str) or not token:
        raise ValidationError("a task token is a non-empty string (StepContext.task_token)")
    found = handoff.TaskToken.decode(token)
    run = client.get(found.run_id)  # RunNotFoundError
    if run.app != found.app:
        raise ValidationError(
            f"the task token names app {found.app!r}, but run {found.run_id!r} is of app "
            f"{run.app!r}: it is not a token of this run"
        )
    state = RunState(run.run_id)
    for event in client.store.load_history(None, run.run_id):
        state.apply(event)
    pos, attempt = found.position, found.attempt
    if handoff.current(state, pos, attempt) and run.status not in s.FINAL_STATUSES:
        return found, run, state
    step = state.steps.get(pos)
    if run.status in s.FINAL_STATUSES:
        why = f"its run is {run.status}"
    elif step is None:
        why = "its run has no step at that position (the run continued as new?)"
    elif step.attempt != attempt:
        why = f"the step is at attempt {step.attempt} now (it timed out or was retried)"
    elif step.status == s.DONE:
        why = "it was completed already"
    else:
        why = f"the step is {step.status} (the attempt was failed, or timed out)"
    raise StepAttemptGoneError(
        f"attempt {attempt} of the step at position {pos} of run {run.run_id!r} no longer "
        f"waits to be completed from outside: {why}. Nothing was sent.",
        run_id=run.run_id,
        position=pos,
        attempt=attempt,
    )


def _send(
    client: Client, found: handoff.TaskToken, run: RunRecord, reply: StepReply, key: str
) -> None:
    env = Envelope(
        type="step_result",
        message_id=key,
        run_id=run.run_id,
        saga=run.saga,
        position=found.position,
        attempt=found.attempt,
        payload=reply.to_payload(),
        created_at=client.clock.now(),
    )
    check_message(env)
    client._send(env, live=True, run=run)


def complete(client: Client, token: str, result: Any = None) -> None:
    """Complete the attempt ``token`` names with ``result`` (converted with the step's output
    converter when the client has the App that declares it, else sent as JSON)."""
    found, run, state = _waiting(client, token)
    name = state.steps[found.position].name
    step = client.app.get_step(name) if client.app is not None else None
    if step is not None and run.app == client.app_name:
        value = step.result.to_json(result, what=f"result of step {name!r}")
    else:
        value = to_json(result, ANY, f"result of step {name!r}")
    reply = StepReply(direction=DO, worker=OUTSIDE, outcome=Outcome.COMPLETED, result=value)
    _send(client, found, run, reply, derived_id("handoff", token, Outcome.COMPLETED))


def fail(client: Client, token: str, error: str, *, non_retryable: bool = False) -> None:
    """Fail the attempt ``token`` names with the message ``error``: the step's retry policy
    applies (``non_retryable``: no retry), as to an attempt that raised, in doubt."""
    if not isinstance(error, str) or not error:
        raise ValidationError("fail_step needs the error's message (a non-empty string)")
    found, run, _ = _waiting(client, token)
    info = ErrorInfo("StepFailedOutside", error, non_retryable=non_retryable)
    reply = StepReply(direction=DO, worker=OUTSIDE, outcome=Outcome.FAILED, error=info.to_json())
    _send(client, found, run, reply, derived_id("handoff", token, Outcome.FAILED))


def heartbeat(client: Client, token: str, details: Any = None) -> None:
    """Say the outside system still works on the attempt ``token`` names: its
    ``heartbeat_timeout`` starts again (recorded as ``step_heartbeat``, with ``details``).
    Raises ``StepCancelled`` when the run is being cancelled: stop, and fail the step."""
    found, run, state = _waiting(client, token)
    if state.cancel_reason is not None or state.cancelling is not None:
        raise StepCancelled(
            f"run {run.run_id!r} is being cancelled: stop working on its step, and fail it "
            "(Client.fail_step) so that the run goes on"
        )
    value = to_json(details, ANY, "heartbeat details")
    reply = StepReply(direction=DO, worker=OUTSIDE, outcome=Outcome.HANDED_OFF, result=value)
    _send(client, found, run, reply, derived_id("handoff-beat", token, uuid.uuid4().hex))
