"""The run's policy (``sagaloop.engine.decide``) as table tests: a run's state folded from a
few history events, one fact (a step's reply, a timer, a child's outcome), and the events and
messages the policy returns. No store, no engine, no harness."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sagaloop import App, RetryPolicy, StepContext
from sagaloop.engine import cancelling, decide
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.contract import DO, UNDO
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.messages import (
    ChildResult,
    Envelope,
    Outcome,
    StepReply,
    engine_queue,
    step_queue,
)
from sagaloop.engine.state import RunState
from sagaloop.errors import ErrorInfo

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NOW = T0 + timedelta(seconds=10)
POLICY = RetryPolicy(
    max_attempts=4,
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=60),
    non_retryable_errors=("CardDeclined",),
)

app = App("shop")


@app.step(retry=POLICY)
def charge(ctx: StepContext, amount: int) -> str:
    return "ch_1"


@charge.compensation
def refund(ctx: StepContext, amount: int, result: str) -> None:
    return None


@app.step(retry=POLICY)
def reserve(ctx: StepContext, item: str) -> str:
    return "r_1"


@reserve.compensation
def release(ctx: StepContext, item: str, result: str) -> None:
    return None


@app.step(retry=POLICY)
def notify(ctx: StepContext, text: str) -> None:  # no compensation
    return None


@app.step(retry=RetryPolicy(max_attempts=3, give_up="park"))
def book(ctx: StepContext, seat: str) -> str:
    return "b_1"


@app.step(retry=POLICY, idempotent=False)
def wire(ctx: StepContext, amount: int) -> str:  # non-idempotent, no reconcile
    return "w_1"


@app.step(retry=POLICY, schedule_to_close=timedelta(seconds=12))
def quote(ctx: StepContext, item: str) -> int:
    return 1


def fold(*events: NewEvent) -> RunState:
    """A run's state after ``run_started`` and ``events``, all recorded at ``T0``."""
    st = RunState("r1")
    started = NewEvent(h.RUN_STARTED, name="order", data={"input": None})
    for ev in h.number(0, [started, *events], T0):
        st.apply(ev)
    return st


def scheduled(pos: int, name: str, **args: Any) -> NewEvent:
    return NewEvent(h.STEP_SCHEDULED, pos, name, {"args": args})


def completed(pos: int, name: str, result: Any = "ok") -> NewEvent:
    return NewEvent(h.STEP_COMPLETED, pos, name, {"result": result})


def failed(pos: int, attempt: int, error: dict[str, Any], **reply: Any) -> StepReply:
    """A ``step_result`` payload of a failed attempt."""
    return StepReply(outcome=Outcome.FAILED, direction=DO, error=error, worker="w1", **reply)


def kinds(events: list[NewEvent]) -> list[str]:
    return [e.kind for e in events]


# --- what a step failure leads to ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "wait"),
    [(1, 1), (2, 2), (3, 4)],  # initial 1 s, doubling; the 4th attempt is the last
)
def test_a_retryable_failure_retries_after_the_backoff(attempt: int, wait: int) -> None:
    st = fold(scheduled(1, "charge", amount=5))
    st.steps[1].attempt = attempt  # as if attempts 1..attempt-1 had been retried
    error = {"type": "ConnectionError", "message": "reset"}
    events = decide.result_events(app, st, 1, attempt, failed(1, attempt, error), now=NOW)
    assert kinds(events) == [h.STEP_RETRYING]
    (ev,) = events
    assert (ev.pos, ev.name) == (1, "charge")
    assert ev.data["retry_at"] == (NOW + timedelta(seconds=wait)).isoformat()
    assert ev.data["in_doubt"] is True  # a connection error does not prove nothing happened
    assert ev.data["worker"] == "w1"
    assert ev.data["error"]["type"] == "ConnectionError"


def test_the_last_attempt_fails_the_step() -> None:
    st = fold(scheduled(1, "charge", amount=5))
    error = ErrorInfo("ConnectionError", "reset")
    events = decide.failure_events(app, st.steps[1], DO, 4, error, {}, now=NOW)
    assert kinds(events) == [h.STEP_FAILED]
    assert "retry_at" not in events[0].data


def test_retry_after_lengthens_the_backoff() -> None:
    error = ErrorInfo("RateLimited", "slow down", retry_after=30.0)
    assert decide.delay(POLICY, 1, error) == timedelta(seconds=30)
    assert decide.delay(POLICY, 1, ErrorInfo("RateLimited", "x")) == timedelta(seconds=1)
    assert decide.delay(POLICY, 20, ErrorInfo("RateLimited", "x")) == timedelta(seconds=60)


@pytest.mark.parametrize(
    "error",
    [
        {"type": "CardDeclined", "message": "no"},  # listed in non_retryable_errors
        {"type": "ValueError", "message": "bad", "non_retryable": True},
    ],
)
def test_a_non_retryable_failure_fails_the_step_at_once(error: dict[str, Any]) -> None:
    st = fold(scheduled(1, "charge", amount=5))
    events = decide.result_events(app, st, 1, 1, failed(1, 1, error), now=NOW)
    assert kinds(events) == [h.STEP_FAILED]
    assert events[0].data["error"]["type"] == error["type"]
    assert events[0].data["in_doubt"] is not error.get("non_retryable", False)


def test_give_up_park_halts_the_step_and_parks_the_run() -> None:
    st = fold(scheduled(1, "book", seat="1A"))
    error = ErrorInfo("ConnectionError", "reset")
    events = decide.failure_events(app, st.steps[1], DO, 3, error, {}, now=NOW)
    assert kinds(events) == [h.STEP_HALTED, h.RUN_PARKED]
    assert "failed for good" in events[1].data["reason"]
    assert "sagaloop retry" in events[1].data["reason"]


def test_give_up_park_fails_instead_while_the_run_is_cancelled() -> None:
    st = fold(scheduled(1, "book", seat="1A"), NewEvent(h.CANCEL_REQUESTED, data={}))
    error = {"type": "ConnectionError", "message": "reset"}
    events = decide.result_events(app, st, 1, 1, failed(1, 1, error), now=NOW)
    assert kinds(events) == [h.STEP_FAILED]  # no new attempt of a cancelled run's step


def test_an_error_that_needs_a_person_parks_without_retrying() -> None:
    st = fold(scheduled(1, "charge", amount=5))
    error = ErrorInfo("Misconfigured", "no API key", needs_attention=True)
    events = decide.failure_events(app, st.steps[1], DO, 1, error, {}, now=NOW)
    assert kinds(events) == [h.STEP_HALTED, h.RUN_PARKED]
    assert "needs a person" in events[1].data["reason"]
    assert events[0].data["in_doubt"] is False


def test_in_doubt_non_idempotent_without_reconcile_halts() -> None:
    st = fold(scheduled(1, "wire", amount=5))
    error = {"type": "TimeoutError", "message": "no answer"}
    events = decide.result_events(app, st, 1, 1, failed(1, 1, error), now=NOW)
    assert kinds(events) == [h.STEP_HALTED, h.RUN_PARKED]
    assert events[0].data["in_doubt"] is True
    assert "idempotent=False, no reconcile" in events[1].data["reason"]


def test_a_non_idempotent_step_retries_when_the_error_proves_nothing_happened() -> None:
    st = fold(scheduled(1, "wire", amount=5))
    error = {"type": "Refused", "message": "not sent", "not_applied": True}
    events = decide.result_events(app, st, 1, 1, failed(1, 1, error), now=NOW)
    assert kinds(events) == [h.STEP_RETRYING]
    assert events[0].data["in_doubt"] is False


def test_no_retry_past_the_schedule_to_close() -> None:
    st = fold(scheduled(1, "quote", item="x"))  # scheduled at T0, must start before T0 + 12 s
    error = ErrorInfo("ConnectionError", "reset")
    early = decide.failure_events(app, st.steps[1], DO, 1, error, {}, now=T0)
    assert kinds(early) == [h.STEP_RETRYING]
    late = decide.failure_events(app, st.steps[1], DO, 1, error, {}, now=T0 + timedelta(seconds=11))
    assert kinds(late) == [h.STEP_FAILED]


def test_a_failed_compensation_retries_then_parks() -> None:
    st = fold(scheduled(1, "charge", amount=5), completed(1, "charge"))
    error = ErrorInfo("ConnectionError", "reset")
    retry = decide.failure_events(app, st.steps[1], UNDO, 1, error, {}, now=NOW)
    assert kinds(retry) == [h.COMPENSATION_RETRYING]
    assert retry[0].data["retry_at"] == (NOW + timedelta(seconds=1)).isoformat()
    last = decide.failure_events(app, st.steps[1], UNDO, 4, error, {}, now=NOW)
    assert kinds(last) == [h.COMPENSATION_FAILED, h.RUN_PARKED]
    assert "compensation of step 'charge' failed for good" in last[1].data["reason"]


@pytest.mark.parametrize(
    ("attempt", "status"),
    [(2, s.SCHEDULED), (1, s.DONE)],  # a late attempt's reply; a reply to a settled step
)
def test_late_and_duplicate_replies_record_nothing(attempt: int, status: str) -> None:
    st = fold(scheduled(1, "charge", amount=5))
    st.steps[1].status = status
    reply = StepReply(outcome=Outcome.COMPLETED, direction=DO, result="ch_9")
    assert decide.result_events(app, st, 1, attempt, reply, now=NOW) == []


# --- compensation order --------------------------------------------------------------------------


def test_compensation_goes_newest_first_and_skips_steps_without_one() -> None:
    st = fold(
        scheduled(1, "charge", amount=5),
        completed(1, "charge"),
        scheduled(2, "reserve", item="x"),
        completed(2, "reserve"),
        scheduled(3, "notify", text="hi"),
        completed(3, "notify"),
        NewEvent(h.SAGA_FINISHED, data={"error": {"type": "E", "message": "boom"}}),
    )
    first = decide.next_events(app, st, code=None)
    assert kinds(first) == [h.COMPENSATION_SCHEDULED]
    assert (first[0].pos, first[0].name, first[0].data) == (
        2,
        "reserve",
        {"attempt": 1, "in_doubt": False},
    )
    for ev in h.number(st.last_seq, first, NOW):
        st.apply(ev)
    assert decide.next_events(app, st, code=None) == []  # one at a time: wait for it
    done = NewEvent(h.COMPENSATION_COMPLETED, 2, "reserve", {})
    for ev in h.number(st.last_seq, [done], NOW):
        st.apply(ev)
    second = decide.next_events(app, st, code=None)
    assert [(e.kind, e.pos) for e in second] == [(h.COMPENSATION_SCHEDULED, 1)]
    for ev in h.number(st.last_seq, [*second, NewEvent(h.COMPENSATION_COMPLETED, 1)], NOW):
        st.apply(ev)
    assert [e.data for e in decide.next_events(app, st, code=None)] == [{"status": s.COMPENSATED}]


def test_a_step_failed_in_doubt_is_compensated_as_in_doubt() -> None:
    error = {"type": "TimeoutError", "message": "?"}
    st = fold(
        scheduled(1, "charge", amount=5),
        NewEvent(h.STEP_FAILED, 1, "charge", {"error": error, "in_doubt": True}),
        NewEvent(h.SAGA_FINISHED, data={"error": error}),
    )
    (undo,) = decide.next_events(app, st, code=None)
    assert (undo.kind, undo.pos, undo.data) == (
        h.COMPENSATION_SCHEDULED,
        1,
        {"attempt": 1, "in_doubt": True},
    )


def test_a_cancelled_run_with_nothing_to_undo_ends_cancelled() -> None:
    st = fold(scheduled(1, "notify", text="hi"), completed(1, "notify"))
    (cancel,) = cancelling.cancel_events(st, None)
    assert (cancel.kind, cancel.data) == (h.CANCEL_REQUESTED, {"reason": "cancelled"})
    for ev in h.number(st.last_seq, [cancel], NOW):
        st.apply(ev)
    assert cancelling.cancel_events(st, "again") == []  # asked once
    (end,) = decide.next_events(app, st, code=None)
    assert (end.kind, end.data) == (h.RUN_FINISHED, {"status": s.CANCELLED})


def test_saga_code_commands_come_first_then_its_outcome() -> None:
    st = fold()
    command = scheduled(1, "charge", amount=5)
    assert decide.next_events(app, st, code=([command], None)) == [command]
    (done,) = decide.next_events(app, st, code=([], {"output": 3}))
    assert (done.kind, done.data) == (h.SAGA_FINISHED, {"output": 3})
    (cont,) = decide.next_events(app, st, code=([], {"continue_as_new": 4, "next_pos": 2}))
    assert cont.kind == h.RUN_CONTINUED
    assert cont.data == {"input": 4, "continue_as_new": 4, "next_pos": 2}


# --- timers --------------------------------------------------------------------------------------


def test_a_retry_timer_dispatches_the_next_attempt_once() -> None:
    error = {"type": "ConnectionError", "message": "reset"}
    retrying = {"error": error, "in_doubt": True, "retry_at": NOW.isoformat()}
    st = fold(scheduled(1, "charge", amount=5), NewEvent(h.STEP_RETRYING, 1, "charge", retrying))
    (ev,) = decide.timer_events(st, 1, "retry", 2)
    assert (ev.kind, ev.pos, ev.data) == (h.STEP_DISPATCHED, 1, {"attempt": 2, "in_doubt": True})
    assert decide.timer_events(st, 1, "retry", 3) == []  # a stale timer


# --- child runs ----------------------------------------------------------------------------------


def parent_with_child() -> RunState:
    return fold(NewEvent(h.CHILD_STARTED, 1, "pay", {"run_id": "c1", "input": 5}))


def test_a_failed_child_fails_the_parents_call() -> None:
    st = parent_with_child()
    outcome = ChildResult(child="c1", status=s.FAILED, error={"type": "E", "message": "boom"})
    (ev,) = decide.child_outcome(st, 1, outcome)
    assert (ev.kind, ev.pos, ev.name) == (h.CHILD_FAILED, 1, "pay")
    assert ev.data == {
        "error": {"type": "E", "message": "child run 'c1' failed: boom"},
        "status": s.FAILED,
    }


def test_a_completed_child_completes_the_call_and_other_children_are_ignored() -> None:
    st = parent_with_child()
    (ev,) = decide.child_outcome(st, 1, ChildResult(child="c1", status=s.COMPLETED, output=7))
    assert (ev.kind, ev.data) == (h.CHILD_COMPLETED, {"result": 7})
    assert decide.child_outcome(st, 1, ChildResult(child="c2", status=s.COMPLETED)) == []


def test_a_taken_child_run_id_fails_the_call_for_good() -> None:
    (ev,) = decide.child_outcome(parent_with_child(), 1, decide.child_id_taken("c1"))
    assert ev.kind == h.CHILD_FAILED
    assert ev.data["error"]["type"] == "ChildRunIdTaken"
    assert ev.data["error"]["non_retryable"] is True


# --- what recorded events send and set -----------------------------------------------------------


def effects_of(st: RunState, *events: NewEvent) -> tuple[decide.Effects, list[NewEvent]]:
    effects = decide.Effects(NOW, st.last_seq)
    more: list[NewEvent] = []
    for ev in h.number(st.last_seq, list(events), NOW):
        st.apply(ev)
        more += decide.effects_of(app, st, ev, effects, now=NOW, queue_of=lambda run: "other")
    return effects, more


def test_a_scheduled_step_sends_its_task_to_its_queue() -> None:
    effects, more = effects_of(fold(), scheduled(1, "charge", amount=5))
    assert more == []
    (out,) = effects.messages
    assert out.queue == step_queue("shop", "default")
    task = out.envelope
    assert (task.type, task.position, task.attempt) == ("step", 1, 1)
    assert task.idempotency_key == "r1/1/do"
    assert task.payload == {
        "step": "charge",
        "direction": DO,
        "args": {"amount": 5},
        "in_doubt": False,
    }


def test_a_retrying_step_sets_its_retry_timer() -> None:
    error = {"type": "ConnectionError", "message": "reset"}
    retry_at = NOW + timedelta(seconds=2)
    retrying = {"error": error, "in_doubt": True, "retry_at": retry_at.isoformat()}
    st = fold(scheduled(1, "charge", amount=5))
    effects, _ = effects_of(st, NewEvent(h.STEP_RETRYING, 1, "charge", retrying))
    (timer,) = effects.timers
    assert (timer.pos, timer.kind, timer.fire_at, timer.attempt) == (1, "retry", retry_at, 2)
    assert effects.messages == []


def test_an_unregistered_step_parks_the_run() -> None:
    _, more = effects_of(fold(), scheduled(1, "gone", x=1))
    assert kinds(more) == [h.RUN_PARKED]
    assert "'gone' is not registered" in more[0].data["reason"]


def test_a_finished_child_tells_its_parent() -> None:
    st = RunState("c1")
    started = Event(1, h.RUN_STARTED, T0, None, "pay", {"parent": {"run_id": "p", "position": 3}})
    st.apply(started)
    effects, _ = effects_of(
        st,
        NewEvent(h.SAGA_FINISHED, data={"output": 7}),
        NewEvent(h.RUN_FINISHED, data={"status": s.COMPLETED}),
    )
    assert effects.clear_timers
    (out,) = effects.messages
    assert out.queue == engine_queue("shop")
    assert (out.envelope.type, out.envelope.run_id, out.envelope.position) == (
        "child_result",
        "p",
        3,
    )
    assert out.envelope.payload == {
        "child": "c1",
        "status": s.COMPLETED,
        "output": 7,
        "error": None,
    }


def test_continue_as_new_restarts_the_history() -> None:
    st = fold()
    effects, _ = effects_of(st, NewEvent(h.RUN_CONTINUED, data={"input": 9, "next_pos": 4}))
    assert effects.clear_timers
    assert effects.restart is not None
    assert effects.restart.kind == h.RUN_STARTED
    assert effects.restart.data == {"input": 9, "first_pos": 4, "epoch": 1}
    (out,) = effects.messages
    assert (out.envelope.type, out.envelope.run_id, out.envelope.payload) == (
        "start",
        "r1",
        {"input": 9},
    )


def test_an_event_sent_goes_to_the_target_runs_engine_queue() -> None:
    sent = NewEvent(h.EVENT_SENT, 2, "paid", {"run_id": "r2", "data": {"ok": True}})
    effects, _ = effects_of(fold(), sent)
    (out,) = effects.messages
    assert out.queue == "other"
    assert out.envelope.payload == {"name": "paid", "data": {"ok": True}}


def test_a_message_the_engine_keeps_failing_on_parks_the_run_with_it() -> None:
    env = Envelope(type="timer", message_id="m1", run_id="r1", position=2, payload={})
    (ev,) = decide.engine_failed(env, ErrorInfo("KeyError", "'x'"), 3)
    assert ev.kind == h.RUN_PARKED
    assert (
        ev.data["reason"]
        == "the engine failed 3 times on a timer message of this run: KeyError: 'x'"
    )
    assert ev.data["message"]["message_id"] == "m1"
    assert decide.code_stopped(ev.data) is False
    assert decide.code_stopped({"reason": "?", "nondeterminism": True}) is True
