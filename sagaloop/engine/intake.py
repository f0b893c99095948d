"""What a message addressed to a run that exists triggers: its payload parsed once (a malformed
one is a ``MessageError``: the consumer dead-letters it), then the functions of the run's state
that return the events it causes, which :class:`~sagaloop.engine.activation.Engine` applies in
order. Starts (of a run or of a child run) create runs and are the activation's own."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from sagaloop.engine import cancelling, decide, gate, updates
from sagaloop.engine import history as h
from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import (
    CancelPayload,
    ChildResult,
    Envelope,
    EventPayload,
    StepReply,
    TimerKind,
    TimerPayload,
    UndoRun,
    UpdatePayload,
    parse_payload,
)
from sagaloop.engine.ports import Clock, Store
from sagaloop.engine.state import RunState
from sagaloop.errors import MessageError
from sagaloop.sagas.app import App
from sagaloop.sagas.approvals import call_id_of

logger = logging.getLogger("sagaloop.engine.activation")

Triggers = Callable[[RunState], list[NewEvent]]


def triggers(env: Envelope, app: App, store: Store, clock: Clock) -> list[Triggers]:
    """The triggers of ``env``, a message to an existing run of ``app``."""
    if env.type == "event":
        payload: EventPayload = parse_payload(EventPayload, env)
        name, data = payload.name, payload.data
        if call_id_of(name) is not None:  # an answer to an approval: judged as recorded
            return [gate.answer_trigger(store, env.run_id, env.message_id, name, data)]
        arrived = {"data": data, **({"key": payload.key} if payload.key is not None else {})}
        event = NewEvent(h.EVENT_ARRIVED, name=name, data=arrived)
        return [lambda st: [event]]
    if env.type == "update":
        update: UpdatePayload = parse_payload(UpdatePayload, env)
        return [updates.Arrival(update.name, update.update_id, update.data)]
    if env.type == "cancel":
        cancelled = parse_payload(CancelPayload, env)
        reason = cancelled.reason

        def cancel(st: RunState) -> list[NewEvent]:
            saga = app.get_saga(st.saga)
            grace = timedelta(0) if saga is None or cancelled.now else saga.cancel_grace
            now, cut_short = clock.now(), cancelled.now
            return cancelling.cancel_events(st, reason, grace=grace, now=now, cut_short=cut_short)

        return [cancel]
    if env.type == "retry":
        return _retry(env, app, store, clock)
    if env.type == "step_result":
        pos, attempt = env.position, env.attempt
        if pos is None or attempt is None:
            raise MessageError("step_result needs position and attempt")
        reply = StepReply.parse(env)
        return [lambda st: decide.result_events(app, st, pos, attempt, reply, now=clock.now())]
    if env.type == "child_result":
        if (at := env.position) is None:
            raise MessageError("child_result needs a position and the child's run id")
        outcome = ChildResult.parse(env)
        return [lambda st: decide.child_outcome(st, at, outcome)]
    if env.type == "undo_run":
        # The parent compensates: undo this completed child run as a whole (its steps'
        # compensations, newest first), then tell the parent. Only its parent may ask.
        undo = UndoRun.parse(env)
        link = {"run_id": undo.parent, "position": undo.position}
        return [lambda st: cancelling.undo_run_events(st, link)]
    if env.type == "timer":
        if (timer_pos := env.position) is None:
            raise MessageError("timer needs position")
        kind, timer_attempt = TimerPayload.parse(env).kind, env.attempt or 0
        if kind == TimerKind.ATTEMPT_TIMEOUT:  # a handed-off attempt's timeout
            return [
                lambda st: decide.attempt_timeout_events(
                    app, st, timer_pos, timer_attempt, now=clock.now()
                )
            ]
        return [lambda st: decide.timer_events(st, timer_pos, kind, timer_attempt)]
    raise MessageError(f"message type {env.type!r} is not for the engine")


def _retry(env: Envelope, app: App, store: Store, clock: Clock) -> list[Triggers]:
    """An operator's retry of a run that needs attention: resume it, then process again the
    message it was parked on, if any."""
    kept: list[Triggers] = []

    def resume(st: RunState) -> list[NewEvent]:
        if st.parked is None:
            logger.info("retry of run %s ignored: it does not need attention", env.run_id)
            return []
        message = st.parked.get("message")
        if message is not None:  # the message the run was parked on: process it again
            again = Envelope.model_validate(message)
            if again.type != "start":
                kept.extend(triggers(again, app, store, clock))
        return [NewEvent(h.RUN_RESUMED, data={"reason": st.parked.get("reason")})]

    def then(st: RunState) -> list[NewEvent]:
        return [event for trigger in kept for event in trigger(st)]

    return [resume, then]
