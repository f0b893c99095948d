"""Small primitives that workflows ported from other engines need (issue 25): published values
that survive ``continue_as_new``, the failed step's error type as a field of the run's error, a
timeout on a child call, ``ctx.deprecate_patch`` and ``ctx.started_by``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.engine.replay import check_replay
from sagaloop.errors import (
    ApplicationError,
    ChildTimeoutError,
    ErrorInfo,
    SagaFailedError,
    StepFailedError,
    ValidationError,
)
from sagaloop.testing import Harness

# --- published values survive continue_as_new ----------------------------------------------------

carried = App("carried")


@carried.saga(name="counter")
async def counter(ctx: SagaContext, n: int) -> int:
    if n == 0:
        ctx.publish("first", "from the first history")
    ctx.publish("n", n)
    if n < 2:
        ctx.continue_as_new(n + 1)
    await ctx.wait_for_event("stop")
    ctx.publish("first", "overwritten")
    return n


def test_published_values_survive_continue_as_new_until_overwritten() -> None:
    env = Harness(carried)
    run_id = env.start(counter, 0)
    env.run_until_idle()
    history = env.history(run_id)
    assert history[0].kind == h.RUN_STARTED and history[0].data["epoch"] == 2
    assert not any(e.kind == h.PUBLISHED and e.name == "first" for e in history)
    assert env.client.get_published(run_id, "first") == "from the first history"
    assert env.client.get_published(run_id, "n") == 2
    assert env.status(run_id).published == {"first": "from the first history", "n": 2}
    env.restart()  # folded from the stored history alone
    assert env.client.get_published(run_id, "first") == "from the first history"
    env.send_event(run_id, "stop")
    env.run_until_idle()
    assert env.result(run_id) == 2
    assert env.client.get_published(run_id, "first") == "overwritten"


# --- the failed step's or child's error as fields of the run's error -----------------------------

failing = App("failing")


class OrderFailed(Exception):
    pass


@failing.step(retry=RetryPolicy(max_attempts=1))
def charge(ctx: StepContext, amount: int) -> int:
    raise ApplicationError(f"card declined for {amount}", type="CardDeclined", non_retryable=True)


@failing.saga(name="pay")
async def pay(ctx: SagaContext, amount: int) -> int:
    try:
        return await ctx.call(charge, amount)
    except StepFailedError as e:
        ctx.publish("seen", [e.step, e.cause_type, e.cause_message])
        if amount > 100:
            raise OrderFailed("the order could not be paid") from e
        raise


@failing.saga(name="checkout")
async def checkout(ctx: SagaContext, amount: int) -> int:
    return await ctx.call(pay, amount)


def test_the_run_error_names_the_failed_step_and_its_error_type() -> None:
    env = Harness(failing)
    run_id = env.start(pay, 5)
    env.run_until_idle()
    assert env.client.get_published(run_id, "seen") == [
        "charge",
        "CardDeclined",
        "card declined for 5",
    ]
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.type == "StepFailedError"
    assert error.step == "charge"
    assert error.cause is not None and error.cause.type == "CardDeclined"
    assert error.cause.message == "card declined for 5" and error.cause.non_retryable
    assert error.cause.traceback is None  # the step's own is in its step_failed event
    assert error.root_cause is error.cause
    stored = env.get(run_id).error
    assert stored is not None and stored["cause"]["type"] == "CardDeclined"


def test_an_error_raised_from_the_step_failure_keeps_it_as_its_cause() -> None:
    env = Harness(failing)
    run_id = env.start(pay, 500)
    env.run_until_idle()
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.type == "OrderFailed"
    assert error.step == "charge" and error.cause is not None
    assert error.cause.type == "CardDeclined"


def test_a_failed_child_run_chains_its_own_error_down_to_the_step() -> None:
    env = Harness(failing)
    run_id = env.start(checkout, 5)
    env.run_until_idle()
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.step == "pay"
    assert error.cause is not None and error.cause.type == "StepFailedError"  # the child's
    assert error.cause.step == "charge"
    assert error.root_cause.type == "CardDeclined"
    assert ErrorInfo.from_json(error.to_json()).root_cause.type == "CardDeclined"


# --- a timeout on await ctx.call(child) -----------------------------------------------------------

timed = App("timed")
child_undone: list[str] = []


@timed.step()
def book(ctx: StepContext, what: str) -> str:
    return f"booked {what}"


@book.compensation
def unbook(ctx: StepContext, what: str, booked: str) -> None:
    child_undone.append(what)


@timed.saga(name="supplier")
async def supplier(ctx: SagaContext, minutes: int) -> str:
    booked = await ctx.call(book, f"after {minutes} min")
    await ctx.sleep(timedelta(minutes=minutes))
    return booked


@timed.saga(name="buyer")
async def buyer(ctx: SagaContext, minutes: int) -> str:
    try:
        got = await ctx.call(supplier, minutes, run_id=f"supplier-{minutes}", timeout=MINUTE * 10)
    except TimeoutError as e:  # ChildTimeoutError
        assert isinstance(e, ChildTimeoutError) and e.run_id == f"supplier-{minutes}"
        return f"gave up at {ctx.now():%H:%M}"
    await ctx.sleep(timedelta(hours=1))  # the timer the child beat fires meanwhile
    return got


MINUTE = timedelta(minutes=1)


def test_a_child_slower_than_the_timeout_is_cancelled_and_the_call_raises() -> None:
    child_undone.clear()
    env = Harness(timed)
    start = env.clock.now()
    run_id = env.start(buyer, 60)
    env.run_until_idle()
    assert env.result(run_id) == f"gave up at {start + MINUTE * 10:%H:%M}"
    child = env.get("supplier-60")
    assert child.status == "cancelled"  # and compensated, as a cancelled run is
    assert child_undone == ["after 60 min"]
    kinds = [(e.kind, e.name) for e in env.history(run_id) if e.pos is not None]
    assert kinds[:3] == [
        (h.CHILD_STARTED, "supplier"),
        (h.TIMER_STARTED, "call_timeout"),
        (h.TIMER_FIRED, None),
    ]
    assert (h.CHILD_CANCEL_REQUESTED, "supplier") in kinds
    check_replay(timed, buyer, run_id, env.history(run_id), whole=True)


def test_a_child_faster_than_the_timeout_returns_its_output_and_the_timer_is_ignored() -> None:
    child_undone.clear()
    env = Harness(timed)
    run_id = env.start(buyer, 2)
    env.run_until_idle()
    assert env.result(run_id) == "booked after 2 min"
    assert env.get("supplier-2").status == "completed" and child_undone == []
    check_replay(timed, buyer, run_id, env.history(run_id), whole=True)


def test_the_timeout_replays_across_restarts() -> None:
    env = Harness(timed)
    run_id = env.start(buyer, 60)
    while env.step_once() or env.store.next_timer_at(app=timed.name) is not None:
        env.restart()  # nothing in memory between messages
        if not env.step_once():
            at = env.store.next_timer_at(app=timed.name)
            if at is None:
                break
            env.clock.set(at)
    assert env.get(run_id).status == "completed", env.status(run_id).to_json()
    assert env.get("supplier-60").status == "cancelled"


def test_a_bad_timeout_is_refused_before_anything_is_recorded() -> None:
    bad = App("bad_timeout")

    @bad.saga(name="inner")
    async def inner(ctx: SagaContext) -> None:
        return None

    @bad.saga(name="outer")
    async def outer(ctx: SagaContext, timeout: Any) -> str:
        try:
            await ctx.call(inner, timeout=timedelta(seconds=timeout) if timeout else "soon")
        except ValidationError as e:
            return str(e)
        return "called"

    env = Harness(bad)
    for value in (0, -5, None):
        run_id = env.start(outer, value)
        env.run_until_idle()
        assert "is a positive timedelta" in env.result(run_id)
        assert not [e for e in env.history(run_id) if e.kind == h.CHILD_STARTED]
