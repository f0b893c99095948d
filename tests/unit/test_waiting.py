"""Durable waiting: events with timeouts across restarts, early and repeated events, durable
sleeps under the virtual clock, the status timeline, cancellation while waiting, and events
addressed to finished or unknown runs."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

import sagaloop
from sagaloop import App, EventTimeoutError, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope, engine_queue
from sagaloop.testing import Harness

TWO_DAYS = timedelta(days=2)


class Reply(BaseModel):
    text: str
    accepted: bool


def kinds(env: Harness, run_id: str, kind: str) -> list[Any]:
    return [e for e in env.history(run_id) if e.kind == kind]


def reply_app() -> tuple[App, Any]:
    app = App("waiting")

    @app.saga(name="ask")
    async def ask(ctx: SagaContext, question: str) -> dict[str, Any]:
        try:
            reply = await ctx.wait_for_event("reply", timeout=TWO_DAYS, model=Reply)
        except EventTimeoutError as e:
            return {"outcome": "timeout", "event": e.event, "at": ctx.now().isoformat()}
        assert isinstance(reply, Reply)
        return {"outcome": "reply", "text": reply.text, "accepted": reply.accepted}

    return app, ask


def test_event_arriving_after_restart_resumes_the_run_with_its_data() -> None:
    app, ask = reply_app()
    env = Harness(app)
    run_id = env.start(ask, "refund?")
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"

    env.advance(timedelta(days=1))
    env.restart()
    env.send_event(run_id, "reply", {"text": "yes please", "accepted": True})
    env.run_until_idle()  # skipping time must not fire the cancelled timeout

    run = env.get(run_id)
    assert run.status == "completed"
    assert run.output == {"outcome": "reply", "text": "yes please", "accepted": True}
    assert not kinds(env, run_id, h.TIMER_FIRED)
    assert env.store.next_timer_at() is None, "the timeout timer is gone with the run"


def test_timeout_raises_event_timeout_error_in_the_saga() -> None:
    app, ask = reply_app()
    env = Harness(app)
    started = env.clock.now()
    run_id = env.start(ask, "refund?")
    env.run_until_idle()  # skips the virtual clock to the timeout

    run = env.get(run_id)
    assert run.status == "completed"
    assert run.output["outcome"] == "timeout" and run.output["event"] == "reply"
    assert datetime.fromisoformat(run.output["at"]) == started + TWO_DAYS
    assert env.clock.now() == started + TWO_DAYS
    waiting = kinds(env, run_id, h.EVENT_WAITING)
    assert [datetime.fromisoformat(e.data["timeout_at"]) for e in waiting] == [started + TWO_DAYS]
    assert len(kinds(env, run_id, h.TIMER_FIRED)) == 1

    # a late reply is refused: the run is over
    with pytest.raises(sagaloop.RunFinishedError):
        env.send_event(run_id, "reply", {"text": "too late", "accepted": True})


def test_timeout_does_not_fire_early() -> None:
    app, ask = reply_app()
    env = Harness(app)
    run_id = env.start(ask, "refund?")
    env.run_until_idle(skip_time=False)
    env.advance(TWO_DAYS - timedelta(seconds=1))
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    env.advance(timedelta(seconds=1))
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).output["outcome"] == "timeout"


@pytest.mark.parametrize("early", [False, True], ids=["while-waiting", "before-the-wait"])
def test_an_event_whose_data_does_not_fit_is_rejected_and_the_wait_goes_on(early: bool) -> None:
    """A typo in one event (`send-event RUN reply --data '{"msg": "typo"}'`) must not fail the
    run for good: it is recorded as rejected with the reason, the wait (and its timeout) goes
    on, and a good event completes it; replayed from the history, the same happens."""
    app, ask = reply_app()
    env = Harness(app)
    run_id = env.start(ask, "refund?")
    if not early:
        env.run_until_idle(skip_time=False)
    publish_event(env, run_id, "reply", {"text": "no accepted field"})  # a plain publisher
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    [rejected] = kinds(env, run_id, h.EVENT_REJECTED)
    assert rejected.name == "reply" and "accepted" in rejected.data["reason"]
    assert env.status(run_id).to_json()  # the timeline renders it

    env.restart()  # from the history alone: the bad event is skipped again, not re-recorded
    env.send_event(run_id, "reply", {"text": "yes", "accepted": True})
    env.run_until_idle(skip_time=False)
    run = env.get(run_id)
    assert run.status == "completed", run
    assert run.output == {"outcome": "reply", "text": "yes", "accepted": True}
    assert len(kinds(env, run_id, h.EVENT_REJECTED)) == 1


def publish_event(env: Harness, run_id: str, name: str, data: Any) -> None:
    """As a publisher without the saga's code does (through the public message contract)."""
    body = Envelope(type="event", run_id=run_id, payload={"name": name, "data": data})
    env.broker.publish([(engine_queue(env.app.name), body.to_bytes())])


def test_a_client_that_can_check_refuses_an_event_that_does_not_fit_its_wait() -> None:
    app, ask = reply_app()
    env = Harness(app)
    run_id = env.start(ask, "refund?")
    env.run_until_idle(skip_time=False)
    with pytest.raises(sagaloop.ValidationError, match="accepted") as refused:
        env.send_event(run_id, "reply", {"text": "typo"})
    assert "nothing was sent" in str(refused.value)
    env.run_until_idle(skip_time=False)
    assert not kinds(env, run_id, h.EVENT_ARRIVED)
    env.send_event(run_id, "reply", {"text": "ok", "accepted": True})
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == {"outcome": "reply", "text": "ok", "accepted": True}


def test_the_wait_after_a_rejected_event_still_times_out() -> None:
    app, ask = reply_app()
    env = Harness(app)
    run_id = env.start(ask, "refund?")
    publish_event(env, run_id, "reply", {"text": "early and wrong"})  # consumed by the wait
    env.run_until_idle()  # skips to the timeout
    run = env.get(run_id)
    assert run.status == "completed" and run.output["outcome"] == "timeout"


def test_event_sent_before_the_wait_is_kept_and_returned_at_once() -> None:
    app = App("early")

    @app.step()
    def prepare(ctx: StepContext) -> str:
        return "ready"

    @app.saga(name="early")
    async def early(ctx: SagaContext) -> list[Any]:
        first = await ctx.call(prepare)
        data = await ctx.wait_for_event("approval", timeout=TWO_DAYS)
        return [first, data]

    env = Harness(app)
    started = env.clock.now()
    run_id = env.start(early)
    env.send_event(run_id, "approval", {"by": "alice"})  # before the saga reaches the wait
    env.run_until_idle(skip_time=False)

    run = env.get(run_id)
    assert run.status == "completed"
    assert run.output == ["ready", {"by": "alice"}]
    assert env.clock.now() == started  # no time had to pass
    arrived = kinds(env, run_id, h.EVENT_ARRIVED)
    waiting = kinds(env, run_id, h.EVENT_WAITING)
    assert len(arrived) == 1 and len(waiting) == 1
    assert arrived[0].seq < waiting[0].seq, "the event really arrived before the wait"


@pytest.mark.parametrize("early", [True, False])
def test_two_events_of_the_same_name_are_consumed_in_order(early: bool) -> None:
    app = App("order")

    @app.saga(name="two")
    async def two(ctx: SagaContext) -> list[Any]:
        first = await ctx.wait_for_event("msg")
        second = await ctx.wait_for_event("msg")
        return [first, second]

    env = Harness(app)
    run_id = env.start(two)
    if early:  # both arrive before the first wait
        env.send_event(run_id, "msg", 1)
        env.send_event(run_id, "msg", 2)
    else:  # one at a time, with a restart (a replay from the history) in between
        env.run_until_idle(skip_time=False)
        assert env.get(run_id).status == "waiting"
        env.send_event(run_id, "msg", 1)
        env.run_until_idle(skip_time=False)
        assert env.get(run_id).status == "waiting"
        env.restart()
        env.send_event(run_id, "msg", 2)
    env.run_until_idle()
    assert env.get(run_id).output == [1, 2]
    assert [e.data["data"] for e in kinds(env, run_id, h.EVENT_ARRIVED)] == [1, 2]


def test_events_of_other_names_do_not_satisfy_a_wait() -> None:
    app = App("names")

    @app.saga(name="names")
    async def names(ctx: SagaContext) -> list[Any]:
        b = await ctx.wait_for_event("b")
        a = await ctx.wait_for_event("a")
        return [a, b]

    env = Harness(app)
    run_id = env.start(names)
    env.send_event(run_id, "a", "A")
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    env.send_event(run_id, "b", "B")
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).output == ["A", "B"]


def test_durable_sleep_of_two_days() -> None:
    app = App("sleeper")

    @app.saga(name="sleeper")
    async def sleeper(ctx: SagaContext) -> list[str]:
        before = ctx.now()
        await ctx.sleep(TWO_DAYS)
        return [before.isoformat(), ctx.now().isoformat()]

    env = Harness(app)
    started = env.clock.now()
    run_id = env.start(sleeper)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    assert env.status(run_id).waiting_for == ["sleeping until 2026-01-03 00:00:00 UTC"]

    env.restart()  # no process holds the run while it sleeps
    env.advance(timedelta(days=1))
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"

    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "completed"
    before, after = (datetime.fromisoformat(x) for x in run.output)
    assert before == started
    assert after >= started + TWO_DAYS
    fired = kinds(env, run_id, h.TIMER_FIRED)
    assert len(fired) == 1 and fired[0].at >= started + TWO_DAYS


def test_cancel_while_sleeping_ends_cancelled_without_waiting_for_the_timer() -> None:
    app = App("cancel-sleep")

    @app.saga(name="nap")
    async def nap(ctx: SagaContext) -> str:
        await ctx.sleep(TWO_DAYS)
        return "woke up"

    env = Harness(app)
    started = env.clock.now()
    run_id = env.start(nap)
    env.run_until_idle(skip_time=False)
    env.cancel(run_id)
    env.run_until_idle()
    assert env.get(run_id).status == "cancelled"
    assert env.clock.now() < started + TWO_DAYS, "the sleep's timer was not waited for"
    assert env.store.next_timer_at() is None
    assert not kinds(env, run_id, h.TIMER_FIRED)


def test_status_says_what_the_run_waits_for() -> None:
    app, ask = reply_app()
    env = Harness(app)
    run_id = env.start(ask, "refund?")
    env.run_until_idle(skip_time=False)

    timeline = env.status(run_id)
    assert timeline.status == "waiting"
    assert timeline.waiting_for == ["waiting for event 'reply' until 2026-01-03 00:00:00 UTC"]

    env.send_event(run_id, "reply", {"text": "ok", "accepted": False})
    env.run_until_idle()
    assert env.status(run_id).waiting_for == []


def test_cancel_while_waiting_compensates_and_ends_cancelled() -> None:
    app = App("cancel")
    effects: list[str] = []

    @app.step()
    def book(ctx: StepContext, what: str) -> str:
        effects.append(f"book:{what}")
        return f"{what}-booking"

    @book.compensation
    def unbook(ctx: StepContext, what: str, result: str) -> None:
        effects.append(f"unbook:{result}")

    @app.saga(name="trip")
    async def trip(ctx: SagaContext) -> str:
        await ctx.call(book, "flight")
        await ctx.call(book, "hotel")
        await ctx.wait_for_event("confirm", timeout=TWO_DAYS)
        await ctx.call(book, "car")
        return "done"

    env = Harness(app)
    run_id = env.start(trip)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"

    env.cancel(run_id, "customer changed their mind")
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "cancelled"
    assert effects == [
        "book:flight",
        "book:hotel",
        "unbook:hotel-booking",
        "unbook:flight-booking",
    ]
    assert [e.data["reason"] for e in kinds(env, run_id, h.CANCEL_REQUESTED)] == [
        "customer changed their mind"
    ]
    assert not kinds(env, run_id, h.TIMER_FIRED), "the timeout does not fire after the cancel"
    assert [line.compensation for line in env.status(run_id).steps] == [
        "compensated",
        "compensated",
    ]
    with pytest.raises(sagaloop.SagaFailedError) as info:
        env.result(run_id)
    assert info.value.status == "cancelled"

    # a finished run refuses further events and cancellations
    with pytest.raises(sagaloop.RunFinishedError):
        env.send_event(run_id, "confirm", True)
    with pytest.raises(sagaloop.RunFinishedError):
        env.cancel(run_id)


def test_event_to_finished_or_unknown_run_is_refused() -> None:
    app = App("finished")

    @app.saga(name="quick")
    async def quick(ctx: SagaContext) -> int:
        return 1

    env = Harness(app)
    run_id = env.start(quick)
    env.run_until_idle()
    assert env.get(run_id).status == "completed"

    with pytest.raises(sagaloop.RunFinishedError) as finished:
        env.send_event(run_id, "late", {"x": 1})
    assert finished.value.run_id == run_id and finished.value.status == "completed"

    with pytest.raises(sagaloop.RunNotFoundError) as missing:
        env.send_event("no-such-run", "late")
    assert missing.value.run_id == "no-such-run"

    assert env.run_until_idle() == 0, "nothing was queued for either"
