"""The run's policy: what a run does next, as pure functions.

Each function takes the app's declarations, the run's :class:`RunState` (folded from its
history), the time and the fact that arrived (a step's reply, a timer, a child's outcome...)
and returns the history events to record; :func:`effects_of` turns recorded events into what
the activation sends and sets (step tasks, timers, messages to other runs, a restart when the
run continues as new) in an :class:`Effects`. Nothing here reads or writes the store, keeps a
cache or runs saga code: :class:`sagaloop.engine.activation.Engine` does, and calls these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sagaloop.engine import cancelling, handoff, updates
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.contract import (
    DO,
    UNDO,
    Direction,
    halts_in_doubt,
    idempotency_key,
    task_message_id,
)
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.messages import (
    ChildResult,
    ChildStart,
    Envelope,
    Outcome,
    StepReply,
    StepTask,
    TimerKind,
    UndoRun,
    derived_id,
    engine_queue,
    local_queue,
    step_queue,
)
from sagaloop.engine.ports import Outgoing, RunRecord, Timer
from sagaloop.engine.state import RunState
from sagaloop.errors import ActivationDeadlineError, ErrorInfo, NonDeterminismError
from sagaloop.sagas.app import App
from sagaloop.sagas.policy import RetryPolicy


@dataclasses.dataclass
class Effects:
    """What an activation writes, all at once in ``Engine.apply``."""

    at: datetime
    """When the activation happened: the time of all its events."""
    after_seq: int
    """The run's last stored event; ``events`` come after it."""
    events: list[NewEvent] = dataclasses.field(default_factory=list)
    messages: list[Outgoing] = dataclasses.field(default_factory=list)
    timers: list[Timer] = dataclasses.field(default_factory=list)
    clear_timers: bool = False
    dropped_timers: list[int] = dataclasses.field(default_factory=list)
    """The positions whose timer the saga code cancelled (``timer_cancelled``): deleted."""
    restart: NewEvent | None = None
    """Continued as new: the history is deleted and starts again with this ``run_started``."""
    trace: dict[str, str] | None = None
    """The trace context the messages it sends carry (see ``tracing.activation``)."""

    def send(self, queue: str, **envelope: Any) -> None:
        """Queue a message, stamped with the activation's time and trace, for the outbox."""
        message = Envelope(created_at=self.at, trace=self.trace, **envelope)
        self.messages.append(Outgoing(queue, message))

    def start(self, queue: str, message_id: str, run_id: str, saga: str, value: Any) -> None:
        """Queue the start of run ``run_id`` of ``saga`` with the input ``value`` (JSON)."""
        payload = {"input": value}
        self.send(
            queue, type="start", message_id=message_id, run_id=run_id, saga=saga, payload=payload
        )


# --- what a fact does to the run -----------------------------------------------------------------


def delay(policy: RetryPolicy, attempt: int, error: ErrorInfo) -> timedelta:
    """The wait before the attempt after ``attempt``: the policy's, or longer when the error
    asks it (a provider's ``Retry-After``)."""
    wait = policy.delay(attempt)
    if error.retry_after is not None:
        wait = max(wait, timedelta(seconds=error.retry_after))
    return wait


def result_events(
    app: App, st: RunState, pos: int, attempt: int, reply: StepReply, *, now: datetime
) -> list[NewEvent]:
    """The events a step's reply records: its completion, its halt, or what its failure leads
    to (see :func:`failure_events`); none for a late or duplicate reply."""
    step_state = st.steps.get(pos)
    if step_state is None:
        return []
    direction, outcome = reply.direction, reply.outcome
    worker = {"worker": reply.worker}
    name = step_state.name
    if direction == DO:
        if step_state.status != s.SCHEDULED or step_state.attempt != attempt:
            return []  # a late or duplicate reply (retrying: this attempt failed already)
        if outcome == Outcome.HANDED_OFF:  # ctx.complete_async(), or a heartbeat from outside
            return handoff.reply_events(app, st, pos, attempt, reply)
        if outcome == Outcome.COMPLETED:
            data = {"result": reply.result, "reconciled": reply.reconciled}
            if reply.reconciled and reply.took_s is not None:  # the attempt's time
                data["took_s"] = reply.took_s  # (not the lease a dead worker's message waited)
            return [NewEvent(h.STEP_COMPLETED, pos, name, {**data, **worker})]
        if outcome == Outcome.HALTED:
            assert reply.error is not None  # a halted reply says why (StepReply checks)
            reason = str(reply.error.get("message"))
            return [
                NewEvent(h.STEP_HALTED, pos, name, {"error": reply.error, **worker}),
                NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
            ]
    else:
        if step_state.comp_status not in s.IN_FLIGHT or step_state.comp_attempt != attempt:
            return []
        if outcome == Outcome.HANDED_OFF:  # a compensation cannot be handed off (refused)
            return []
        if outcome == Outcome.COMPLETED:
            return [NewEvent(h.COMPENSATION_COMPLETED, pos, name, {**worker})]
        if outcome == Outcome.HALTED:  # the worker gave up on the message: `retry` undoes again
            assert reply.error is not None
            reason = f"compensation of step {name!r}: {reply.error.get('message')}"
            return [
                NewEvent(h.COMPENSATION_FAILED, pos, name, {"error": reply.error, **worker}),
                NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
            ]
    error = ErrorInfo.from_json(reply.error or {"type": "Error", "message": "?"})
    cancelling = st.cancel_reason is not None or st.abandoned(pos)
    return failure_events(
        app, step_state, direction, attempt, error, worker, now=now, cancelling=cancelling
    )


def failure_events(
    app: App,
    step_state: s.StepState,
    direction: str,
    attempt: int,
    error: ErrorInfo,
    extra: dict[str, Any],
    *,
    now: datetime,
    cancelling: bool = False,
) -> list[NewEvent]:
    """What a failed attempt (``direction`` ``DO`` or ``UNDO``) leads to: a retry at a time
    (the policy's backoff, within the step's ``schedule_to_close``), a halt when the step
    cannot be re-run in doubt, a park (``give_up="park"``, or an error that needs a person),
    or the step's failure. ``extra`` is added to the failure event's data."""
    pos, name = step_state.pos, step_state.name
    step = app.get_step(name)
    policy = step.retry if step is not None else None
    in_doubt = not (error.not_applied or error.non_retryable or error.needs_attention)
    retryable = (
        policy is not None
        and not error.non_retryable
        and not error.needs_attention  # a person must fix it first: no attempt helps
        and policy.is_retryable(error.type)
        and policy.allows(attempt)
        # the run is cancelled: no new attempt of a step; undo what it may have done
        and not (cancelling and direction == DO)
    )
    if retryable and direction == DO and step is not None and step.schedule_to_close:
        assert policy is not None
        retry_at = now + delay(policy, attempt, error)
        if retry_at >= step_state.scheduled_at + step.schedule_to_close:
            retryable = False  # no attempt would start before the schedule_to_close
    data = {"error": error.to_json(), "in_doubt": in_doubt, **extra}
    if direction == UNDO:
        if retryable:
            assert policy is not None
            data["retry_at"] = (now + delay(policy, attempt, error)).isoformat()
            return [NewEvent(h.COMPENSATION_RETRYING, pos, name, data)]
        reason = f"compensation of step {name!r} failed for good: {error.type}: {error.message}"
        return [
            NewEvent(h.COMPENSATION_FAILED, pos, name, data),
            NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
        ]
    if retryable and in_doubt and step is not None and halts_in_doubt(step):
        reason = (
            f"step {name!r} (idempotent=False, no reconcile) failed in doubt with "
            f"{error.type}: {error.message}; it was not re-attempted. Check the effect, "
            "then `sagaloop retry` the run."
        )
        return [
            NewEvent(h.STEP_HALTED, pos, name, data),
            NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
        ]
    if retryable:
        assert policy is not None
        data["retry_at"] = (now + delay(policy, attempt, error)).isoformat()
        return [NewEvent(h.STEP_RETRYING, pos, name, data)]
    if not cancelling and (error.needs_attention or (policy and policy.give_up == "park")):
        why = "needs a person" if error.needs_attention else "failed for good"
        reason = (
            f"step {name!r} {why}: {error.describe()}; nothing was undone. Fix the cause, "
            "then `sagaloop retry` the run: the step runs again."
        )
        return [
            NewEvent(h.STEP_HALTED, pos, name, data),
            NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
        ]
    return [NewEvent(h.STEP_FAILED, pos, name, data)]


def timer_events(st: RunState, pos: int, kind: str, attempt: int) -> list[NewEvent]:
    """What a timer of ``kind`` (``sleep``, ``wait``, ``retry``, ``undo_retry``) for the
    command at ``pos`` does; none when what it was for has already happened."""
    step = st.steps.get(pos)
    if kind == TimerKind.SLEEP and pos in st.sleeps:
        return [NewEvent(h.TIMER_FIRED, pos)]
    wait = st.waits.get(pos)
    if kind == TimerKind.WAIT and wait is not None and not wait.resolved:
        return [NewEvent(h.TIMER_FIRED, pos, wait.name)]
    if (
        kind == TimerKind.RETRY
        and step
        and step.status == s.RETRYING
        and step.attempt + 1 == attempt
    ):
        data = {"attempt": attempt, "in_doubt": step.in_doubt}
        return [NewEvent(h.STEP_DISPATCHED, pos, step.name, data)]
    if (
        kind == TimerKind.UNDO_RETRY
        and step
        and step.comp_status == s.RETRYING
        and step.comp_attempt + 1 == attempt
    ):
        data = {"attempt": attempt, "in_doubt": step.comp_in_doubt}
        return [NewEvent(h.COMPENSATION_SCHEDULED, pos, step.name, data)]
    if kind == TimerKind.CANCEL_GRACE and st.cancelling is not None and st.cancel_reason is None:
        return cancelling.grace_expired_events(st)
    return []  # stale: what the timer was for has already happened


def attempt_timeout_events(
    app: App, st: RunState, pos: int, attempt: int, *, now: datetime
) -> list[NewEvent]:
    """The ``attempt_timeout`` timer of a handed-off attempt fired: if that attempt still waits
    to be completed from outside, it fails as a timeout, in doubt, and the step's retry policy
    applies (see :mod:`sagaloop.engine.handoff`); otherwise nothing (stale)."""
    if not handoff.waiting(st, pos, attempt):
        return []
    error = handoff.timeout_error(app, st, pos)
    cancelled = st.cancel_reason is not None or st.abandoned(pos)
    step_state = st.steps[pos]
    return failure_events(app, step_state, DO, attempt, error, {}, now=now, cancelling=cancelled)


def rejected_start_events(reason: str) -> list[NewEvent]:
    """The events that fail a run whose start the engine refused, saying why."""
    error = ErrorInfo("RejectedStart", f"the engine refused the start: {reason}").to_json()
    return [
        NewEvent(h.SAGA_FINISHED, data={"error": error}),
        NewEvent(h.RUN_FINISHED, data={"status": s.FAILED}),
    ]


def child_id_taken(child_run_id: str) -> ChildResult:
    """The outcome of a child run whose id another run has."""
    reason = f"the child run id {child_run_id!r} is taken by another run"
    error = ErrorInfo("ChildRunIdTaken", reason, non_retryable=True).to_json()
    return ChildResult(child=child_run_id, status=s.FAILED, error=error)


def child_outcome(st: RunState, pos: int, outcome: ChildResult) -> list[NewEvent]:
    """The event that settles the parent's call at ``pos`` with its child's ``outcome``; none
    if the call does not await that child (any more)."""
    child = st.children.get(pos)
    undone = st.steps.get(pos)
    if child is None and undone is not None and undone.child == outcome.child:
        if undone.comp_status in s.IN_FLIGHT:  # the child run was undone as a whole
            return [NewEvent(h.COMPENSATION_COMPLETED, pos, undone.name, {})]
        return []
    if child is None or child[0] != outcome.child:
        return []
    run_id, name = child
    status = outcome.status
    if status == s.COMPLETED:
        return [NewEvent(h.CHILD_COMPLETED, pos, name, {"result": outcome.output})]
    error = outcome.error
    if error is None:
        error = {"type": "ChildRunFailed", "message": f"child run {run_id!r} ended"}
    error = {**error, "message": f"child run {run_id!r} {status}: {error.get('message', '')}"}
    return [NewEvent(h.CHILD_FAILED, pos, name, {"error": error, "status": status})]


def resume_events(st: RunState) -> list[NewEvent]:
    """A parked run is retried: dispatch again the steps it halted and the compensations
    that failed for good."""
    events: list[NewEvent] = []
    for x in st.steps.values():
        if x.status == s.HALTED:  # in doubt, or parked by a failure a person fixed
            data = {"attempt": x.attempt + 1, "in_doubt": x.in_doubt, "force": True}
            events.append(NewEvent(h.STEP_DISPATCHED, x.pos, x.name, data))
        if x.comp_status == s.GAVE_UP:
            data = {"attempt": x.comp_attempt + 1, "in_doubt": True}
            events.append(NewEvent(h.COMPENSATION_SCHEDULED, x.pos, x.name, data))
    return events


def engine_failed(env: Envelope, error: ErrorInfo, failures: int) -> list[NewEvent]:
    """The engine failed ``failures`` times on ``env``: park the run with the message, which
    ``sagaloop retry`` processes again."""
    reason = (
        f"the engine failed {failures} times on a {env.type} message of this run: "
        f"{error.type}: {error.message}"
    )
    data = {
        "reason": reason,
        "error": error.to_json(),
        "message": env.model_dump(mode="json", exclude_none=True),
    }
    return [NewEvent(h.RUN_PARKED, data=data)]


def code_parked(e: NonDeterminismError | ActivationDeadlineError) -> dict[str, Any]:
    """The ``run_parked`` data for saga code that cannot go on: it is not run again (until a
    retry replays it with the code then deployed)."""
    if isinstance(e, ActivationDeadlineError):
        return {"reason": str(e), "deadline": True, "stack": e.stack}
    return {"reason": str(e), "nondeterminism": True}


def code_stopped(parked: dict[str, Any] | None) -> bool:
    """Whether the run is parked because its saga code could not go on (see
    :func:`code_parked`)."""
    return bool(parked and (parked.get("nondeterminism") or parked.get("deadline")))


def saved_run(run: RunRecord, st: RunState, *, now: datetime) -> RunRecord:
    """The run's row as ``st`` leaves it, updated at ``now``."""
    return dataclasses.replace(
        run,
        status=st.status(),
        last_seq=st.last_seq,
        processed_seq=st.last_seq,
        updated_at=now,
        output=st.saga_output,
        error=st.saga_error,
        reason=(st.parked or {}).get("reason"),
    )


# --- what the run does next ----------------------------------------------------------------------


def next_undo(app: App, st: RunState) -> list[NewEvent] | None:
    """The next compensation to schedule, newest completed step first; ``[]`` while a
    step or compensation is in flight (undo only once they settled); None: none left."""
    if st.in_flight() or st.compensations_in_flight():
        return []
    for step_state in st.to_compensate():
        step = app.get_step(step_state.name)
        if step_state.child is not None or (step is not None and step.compensation_fn):
            data = {"attempt": 1, "in_doubt": step_state.status != s.DONE}
            return [NewEvent(h.COMPENSATION_SCHEDULED, step_state.pos, step_state.name, data)]
    return None


def next_events(
    app: App, st: RunState, *, code: tuple[list[NewEvent], dict[str, Any] | None] | None
) -> list[NewEvent]:
    """What the run does next: the saga code's new commands (``code``: those and its outcome
    once it returned; None when no saga code runs for the run), then continue as new, record
    the code's outcome, compensate (newest first), finish, or park when its saga is not
    registered."""
    if st.finished or st.parked is not None:
        return []
    if code is not None:
        commands, outcome = code
        if commands:
            return commands
        if outcome is not None and st.cancelling is not None and st.cancel_reason is None:
            return cancelling.cancelled_code_events(st, outcome)
        if outcome is not None and "continue_as_new" in outcome:
            if st.continued is None:
                data = {"input": outcome["continue_as_new"]}
                return [NewEvent(h.RUN_CONTINUED, data={**data, **outcome})]
            return []
        if outcome is not None and not st.saga_done and st.cancel_reason is None:
            return [NewEvent(h.SAGA_FINISHED, data=cancelling.recorded(outcome))]
    elif not st.saga_done and not st.failing and app.get_saga(st.saga) is None:
        reason = f"saga {st.saga!r} is not registered in app {app.name!r}"
        return [NewEvent(h.RUN_PARKED, data={"reason": reason})]
    if not st.failing:
        if st.undo_requested is not None:  # ctx.compensate: undo, then let the code go on
            undo = next_undo(app, st)
            return [NewEvent(h.COMPENSATE_DONE, st.undo_requested)] if undo is None else undo
        if st.saga_done:
            return [NewEvent(h.RUN_FINISHED, data={"status": s.COMPLETED})]
        return []
    undo = next_undo(app, st)
    if undo is not None:
        return undo
    if st.cancel_reason is not None:
        status = s.CANCELLED
    elif any(x.comp_status == s.DONE for x in st.steps.values()):
        status = s.COMPENSATED
    else:
        status = s.FAILED
    return [NewEvent(h.RUN_FINISHED, data={"status": status})]


# --- what recorded events send and set -----------------------------------------------------------


def effects_of(
    app: App,
    st: RunState,
    ev: Event,
    effects: Effects,
    *,
    now: datetime,
    queue_of: Callable[[str], str],
) -> list[NewEvent]:
    """Add to ``effects`` what the event ``ev``, just recorded and folded into ``st``, sends
    and sets; return the events it leads to at once (a step that cannot be dispatched parks
    the run). ``queue_of(run_id)`` is the engine queue of another run's app. The engine
    handles ``run_resumed`` itself (it replays the saga code first)."""
    kind = ev.kind
    queue = engine_queue(app.name)
    if kind in (h.STEP_SCHEDULED, h.STEP_DISPATCHED, h.COMPENSATION_SCHEDULED):
        assert ev.pos is not None
        direction = UNDO if kind == h.COMPENSATION_SCHEDULED else DO
        attempt, force = ev.data.get("attempt", 1), bool(ev.data.get("force"))
        return dispatch(app, st, ev.pos, direction, attempt, force, effects, now=now)
    if kind == h.TIMER_STARTED:
        assert ev.pos is not None
        effects.timers.append(Timer(st.run_id, ev.pos, TimerKind.SLEEP, st.sleeps[ev.pos]))
    elif kind == h.EVENT_WAITING:
        assert ev.pos is not None
        wait = st.waits[ev.pos]
        if wait.until is not None and not wait.resolved:
            effects.timers.append(Timer(st.run_id, ev.pos, TimerKind.WAIT, wait.until))
    elif kind in (h.STEP_RETRYING, h.COMPENSATION_RETRYING):
        assert ev.pos is not None
        step_state = st.steps[ev.pos]
        if kind == h.STEP_RETRYING:
            timer_kind, attempt = TimerKind.RETRY, step_state.attempt + 1
            fire_at = step_state.retry_at
        else:
            timer_kind, attempt = TimerKind.UNDO_RETRY, step_state.comp_attempt + 1
            fire_at = step_state.comp_retry_at
        assert fire_at is not None
        effects.timers.append(Timer(st.run_id, ev.pos, timer_kind, fire_at, attempt))
    elif kind in (h.STEP_HANDED_OFF, h.STEP_HEARTBEAT):  # its timeout, if it has one
        assert ev.pos is not None
        if (timer := handoff.timer(app, st, ev.pos)) is not None:
            effects.timers.append(timer)
    elif kind == h.TIMER_CANCELLED:  # the code stopped waiting for it: it need not fire
        assert ev.pos is not None
        effects.dropped_timers.append(ev.pos)
    elif kind == h.EVENT_SENT:
        assert ev.pos is not None and ev.name is not None
        target = str(ev.data["run_id"])
        effects.send(
            queue_of(target),
            type="event",
            message_id=derived_id("sent", st.run_id, ev.pos),
            run_id=target,
            payload={"name": ev.name, "data": ev.data.get("data")},
        )
    elif kind == h.RUN_SPAWNED:
        assert ev.pos is not None and ev.name is not None
        spawned = derived_id("spawned", st.run_id, ev.pos)
        effects.start(queue, spawned, str(ev.data["run_id"]), ev.name, ev.data.get("input"))
    elif kind == h.EVENT_PUBLISHED:  # ctx.publish_event: the engine fans it out
        event_id = str(ev.data["event_id"])
        payload = {"name": ev.name, "data": ev.data.get("data")}
        if (key := ev.data.get("key")) is not None:
            payload["key"] = key
        message_id = derived_id("publish", event_id)
        effects.send(queue, type="publish", message_id=message_id, run_id=event_id, payload=payload)
    elif kind == h.EVENT_REJECTED:  # the wait goes on: so does its timeout
        rejected = st.waits.get(ev.pos) if ev.pos is not None else None
        if rejected is not None and rejected.until is not None and not rejected.resolved:
            effects.timers.append(Timer(st.run_id, rejected.pos, TimerKind.WAIT, rejected.until))
    elif kind == h.RUN_CONTINUED:  # a fresh history; a start message activates it
        effects.clear_timers = True
        data = {
            "input": ev.data.get("input"),
            "first_pos": ev.data.get("next_pos", 0),
            "epoch": st.epoch + 1,
            **({"parent": st.parent} if st.parent else {}),  # still its parent's call
            **({"started_by": st.started_by} if st.started_by else {}),
            **({"trace": st.trace} if st.trace else {}),  # the same run: the same trace
        }
        if kept := st.carried_published():  # readable until published again
            data["published"] = kept
        if answers := updates.carried(st):  # a retried update is answered the same
            data["updates"] = answers
        effects.restart = NewEvent(h.RUN_STARTED, name=st.saga, data=data)
        continued = derived_id("continued", st.run_id, st.epoch + 1)
        effects.start(queue, continued, st.run_id, st.saga, ev.data.get("input"))
        cancelling.cancel_children(app, st, effects)
    elif kind == h.CHILD_STARTED:
        assert ev.pos is not None and ev.name is not None
        effects.send(
            queue,
            type="child_start",
            message_id=derived_id("child", st.run_id, ev.pos),
            run_id=str(ev.data["run_id"]),
            saga=ev.name,
            position=ev.pos,
            payload=ChildStart(input=ev.data.get("input"), parent=st.run_id).to_payload(),
        )
    elif kind == h.CANCEL_REQUESTED:
        cancelling.cancel_children(app, st, effects)
    elif kind == h.CANCEL_DELIVERED:  # the code cleans up until then
        until = datetime.fromisoformat(str(ev.data["until"]))
        effects.timers.append(Timer(st.run_id, cancelling.GRACE_POS, TimerKind.CANCEL_GRACE, until))
    elif kind == h.CHILD_CANCEL_REQUESTED:
        why = f"its parent run {st.run_id!r} stopped waiting for it"
        cancelling.cancel_children(app, st, effects, only=ev.pos, why=why)
    elif kind == h.RUN_FINISHED:
        effects.clear_timers = True
        cancelling.cancel_children(app, st, effects)
        if st.parent is not None:  # tell the parent's call how its child ended
            outcome = ChildResult(
                child=st.run_id,
                status=ev.data.get("status"),
                output=st.saga_output,
                error=st.saga_error,
            )
            effects.send(
                queue,
                type="child_result",
                message_id=derived_id("child-result", st.run_id, ev.data.get("status")),
                run_id=str(st.parent["run_id"]),
                position=int(st.parent["position"]),
                payload=outcome.to_payload(),
            )
    return []


def dispatch(
    app: App,
    st: RunState,
    pos: int,
    direction: Direction,
    attempt: int,
    force: bool,
    effects: Effects,
    *,
    now: datetime,
) -> list[NewEvent]:
    """Send the task of attempt ``attempt`` of the step at ``pos`` (or of its compensation)
    to its queue; a child run is undone as a whole instead. A step no longer registered
    parks the run."""
    step_state = st.steps[pos]
    if step_state.child is not None:  # undo the child run as a whole
        effects.send(
            engine_queue(app.name),
            type="undo_run",
            message_id=derived_id("undo-child", st.run_id, pos, attempt),
            run_id=step_state.child,
            payload=UndoRun(parent=st.run_id, position=pos).to_payload(),
        )
        return []
    step = app.get_step(step_state.name)
    if step is None:
        reason = f"step {step_state.name!r} is not registered in app {app.name!r}"
        return [NewEvent(h.RUN_PARKED, data={"reason": reason})]
    in_doubt = step_state.in_doubt if direction == DO else step_state.comp_in_doubt
    given: dict[str, Any] = {}  # the keys that travel only when they say something
    if direction == UNDO:
        given["result"] = step_state.result if step_state.status == s.DONE else None
    elif step.schedule_to_close is not None:
        given["schedule_deadline"] = step_state.scheduled_at + step.schedule_to_close
    if force:
        given["force"] = True
    payload = StepTask(
        step=step.name, direction=direction, args=step_state.args, in_doubt=in_doubt, **given
    )
    task = Envelope(
        type="step",
        message_id=task_message_id(st.run_id, pos, direction, attempt),
        run_id=st.run_id,
        saga=st.saga,
        position=pos,
        attempt=attempt,
        idempotency_key=idempotency_key(st.run_id, pos, direction),
        payload=payload.to_payload(),
        created_at=now,
        trace=effects.trace,
    )
    queue = local_queue(app.name) if step.local else step_queue(app.name, step.queue)
    effects.messages.append(Outgoing(queue, task))
    return []
