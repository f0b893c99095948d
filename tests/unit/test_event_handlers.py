"""Event handlers (``ctx.on_event``) and ``ctx.wait_condition``: events handled as they arrive
whatever the saga awaits, in history order; events kept from before a registration handled
when it happens; a condition resumed after every handler of the batch ran, at the point the
history records, on every replay; its timeout a durable timer; bad input refused."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.engine.handlers import CONDITION
from sagaloop.engine.history import Event
from sagaloop.engine.messages import engine_queue
from sagaloop.engine.replay import Replayer
from sagaloop.errors import NonDeterminismError, SagaFailedError, ValidationError
from sagaloop.testing import Harness, replay

DAY = timedelta(days=1)


class Item(BaseModel):
    sku: str
    qty: int


app = App("event-handlers")


@app.step()
def price(ctx: StepContext, sku: str) -> int:
    return {"apple": 3, "pear": 5}.get(sku, 1)


@app.saga(name="cart")
async def cart(ctx: SagaContext) -> dict[str, Any]:
    """Items are added whatever the saga awaits; it checks out once told to and the cart is
    not empty."""
    items: list[str] = []
    done: list[bool] = []
    ctx.on_event("add_item", items.append)
    ctx.on_event("checkout", lambda _: done.append(True))
    await ctx.sleep(DAY)  # events arriving meanwhile are handled as they come
    seen_after_sleep = list(items)
    await ctx.wait_condition(lambda: bool(done) and bool(items))
    return {"after_sleep": seen_after_sleep, "items": items}


@app.saga(name="late-handler")
async def late_handler(ctx: SagaContext) -> list[str]:
    items: list[str] = []
    await ctx.sleep(DAY)  # no handler yet: the events are kept, in arrival order
    ctx.on_event("add_item", items.append)
    kept = list(items)  # handled at registration, before the code goes on
    await ctx.wait_condition(lambda: len(items) >= 4)
    return [*kept, "|", *items[len(kept) :]]


@app.saga(name="priced")
async def priced(ctx: SagaContext) -> dict[str, Any]:
    totals: list[int] = []

    async def add(item: Item) -> None:  # async: awaits a step while the saga goes on
        totals.append(item.qty * await ctx.call(price, item.sku))

    ctx.on_event("add_item", add, model=Item)
    await ctx.wait_condition(lambda: len(totals) >= 2)
    await ctx.wait_condition(ctx.all_handlers_finished)
    return {"totals": totals, "all_finished": ctx.all_handlers_finished()}


@app.saga(name="deadline")
async def deadline(ctx: SagaContext) -> str:
    approved: list[Any] = []
    ctx.on_event("approve", approved.append)
    try:
        await ctx.wait_condition(lambda: bool(approved), timeout=DAY)
    except TimeoutError:
        return f"timed out at {ctx.now().isoformat()}"
    return f"approved by {approved[0]}"


@app.saga(name="failing-handler")
async def failing_handler(ctx: SagaContext) -> str:
    def boom(data: Any) -> None:
        raise ValueError(f"bad item {data!r}")

    ctx.on_event("add_item", boom)
    await ctx.wait_condition(lambda: False)
    return "never"


@pytest.fixture(params=[False, True], ids=["replay", "cache"])
def env(request: pytest.FixtureRequest) -> Harness:
    return Harness(app, cache=request.param)


def kinds(env: Harness, run_id: str, kind: str) -> list[Event]:
    return [e for e in env.history(run_id) if e.kind == kind]


def test_events_are_handled_as_they_arrive_whatever_the_saga_awaits(env: Harness) -> None:
    run_id = env.start(cart)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "add_item", "apple")
    env.run_until_idle(skip_time=False)
    env.restart()  # the next activation replays the handled event from the history
    env.send_event(run_id, "add_item", "pear")
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "checkout")  # while the saga still sleeps: it waits on after
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status not in ("completed", "failed")
    env.advance(DAY)
    env.run_until_idle()
    assert env.result(run_id) == {"after_sleep": ["apple", "pear"], "items": ["apple", "pear"]}
    assert [e.data["condition"] for e in kinds(env, run_id, h.CONDITION_MET)] == []  # true at once
    replay(app, env.history(run_id), run_id=run_id)


def test_the_condition_waits_for_a_handler_and_its_resumption_is_recorded(env: Harness) -> None:
    run_id = env.start(cart)
    env.run_until_idle()  # the sleep ends: nothing was added, so the saga waits
    assert env.get(run_id).status not in ("completed", "failed")
    env.send_event(run_id, "checkout")
    env.run_until_idle()
    assert env.get(run_id).status not in ("completed", "failed")  # the cart is still empty
    env.restart()
    env.send_event(run_id, "add_item", "pear")
    env.run_until_idle()
    assert env.result(run_id) == {"after_sleep": [], "items": ["pear"]}
    markers = kinds(env, run_id, h.CONDITION_MET)
    assert [(e.name, e.data) for e in markers] == [(CONDITION, {"condition": 1})]
    arrived = kinds(env, run_id, h.EVENT_ARRIVED)
    assert arrived[-1].seq < markers[0].seq  # resumed after the event that made it true
    replay(app, env.history(run_id), run_id=run_id)


def test_events_kept_before_the_handler_are_handled_at_registration_in_order(
    env: Harness,
) -> None:
    run_id = env.start(late_handler)
    env.run_until_idle(skip_time=False)
    for sku in ("a", "b", "c"):
        env.send_event(run_id, "add_item", sku)
    env.run_until_idle(skip_time=False)
    env.advance(DAY)
    env.run_until_idle()
    env.send_event(run_id, "add_item", "d")
    env.run_until_idle()
    assert env.result(run_id) == ["a", "b", "c", "|", "d"]


def test_an_async_handler_awaits_a_step_and_the_saga_waits_for_handlers_to_finish(
    env: Harness,
) -> None:
    run_id = env.start(priced)
    env.run_until_idle()
    env.queues = [engine_queue(app.name)]  # hold the steps back: the handlers await them
    env.send_event(run_id, "add_item", {"sku": "apple", "qty": 2})
    env.send_event(run_id, "add_item", {"sku": "pear", "qty": 1})
    env.run_until_idle()
    assert env.get(run_id).status not in ("completed", "failed")
    assert len(kinds(env, run_id, h.STEP_SCHEDULED)) == 2  # both handlers run meanwhile
    env.queues = None
    env.run_until_idle()
    assert env.result(run_id) == {"totals": [6, 5], "all_finished": True}
    replay(app, env.history(run_id), run_id=run_id)


def test_event_data_that_does_not_fit_the_handlers_model_is_rejected_and_not_handled(
    env: Harness,
) -> None:
    run_id = env.start(priced)
    env.run_until_idle()
    env.send_event(run_id, "add_item", {"sku": "apple"})  # no qty
    env.send_event(run_id, "add_item", {"sku": "apple", "qty": 1})
    env.send_event(run_id, "add_item", {"sku": "pear", "qty": 2})
    env.run_until_idle()
    assert env.result(run_id) == {"totals": [3, 10], "all_finished": True}
    rejected = kinds(env, run_id, h.EVENT_REJECTED)
    assert [e.name for e in rejected] == ["add_item"]
    assert "qty" in rejected[0].data["reason"]


def test_the_timeout_raises_timeout_error_when_its_timer_fires_first(env: Harness) -> None:
    env.clock.set(datetime(2026, 1, 1, tzinfo=UTC))
    run_id = env.start(deadline)
    env.run_until_idle(skip_time=False)
    env.restart()
    env.advance(DAY)
    env.run_until_idle()
    assert env.result(run_id) == "timed out at 2026-01-02T00:00:00+00:00"
    assert kinds(env, run_id, h.CONDITION_MET) == []


def test_the_condition_that_comes_first_wins_and_its_timer_is_ignored(env: Harness) -> None:
    run_id = env.start(deadline)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "approve", "ada")
    env.run_until_idle()  # the timer fires later: ignored
    assert env.result(run_id) == "approved by ada"
    replay(app, env.history(run_id), run_id=run_id)


def test_a_handler_that_raises_fails_the_run(env: Harness) -> None:
    run_id = env.start(failing_handler)
    env.run_until_idle()
    env.send_event(run_id, "add_item", "x")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert run.error is not None and run.error["type"] == "ValueError", run.error
    with pytest.raises(SagaFailedError):
        env.result(run_id)


# --- a batch: every handler before the code resumes -----------------------------------------


def batch_app() -> tuple[App, Any]:
    batch = App("handler-batch")

    @batch.saga(name="first-seen")
    async def first_seen(ctx: SagaContext) -> list[str]:
        items: list[str] = []
        ctx.on_event("add_item", items.append)
        await ctx.wait_condition(lambda: bool(items))
        return list(items)  # what the code sees when it resumes

    return batch, first_seen


def event(seq: int, kind: str, name: str | None = None, data: Any = None) -> Event:
    return Event(seq, kind, datetime(2026, 1, 1, tzinfo=UTC), None, name, data or {})


def test_every_handler_of_a_batch_runs_before_the_code_resumes() -> None:
    batch, first_seen = batch_app()
    code = Replayer(batch, first_seen, "r1")
    code.feed([event(1, h.RUN_STARTED, data={"input": None})], replaying=False)
    assert code.take_new_commands() == []
    arrived = [event(2 + i, h.EVENT_ARRIVED, "add_item", {"data": s}) for i, s in enumerate("ab")]
    code.feed(arrived, replaying=False)  # one activation, two events
    commands = code.take_new_commands()
    assert [(c.kind, c.pos, c.name) for c in commands] == [(h.CONDITION_MET, 0, CONDITION)]
    assert code.outcome == {"output": ["a", "b"]}

    # replayed, the same history resumes the code where its marker is: the same output,
    # whatever the batches the replaying engine feeds
    marker = Event(4, h.CONDITION_MET, arrived[0].at, 0, CONDITION, {"condition": 1})
    again = Replayer(batch, first_seen, "r1")
    history = [event(1, h.RUN_STARTED, data={"input": None}), *arrived, marker]
    for ev in history:
        again.feed([ev], replaying=True)
    assert again.outcome == {"output": ["a", "b"]}


def test_a_condition_false_where_the_history_resumed_it_is_a_non_determinism() -> None:
    batch, _ = batch_app()
    start = event(1, h.RUN_STARTED, "first-seen", {"input": None})
    marker = Event(2, h.CONDITION_MET, start.at, 0, CONDITION, {"condition": 1})
    with pytest.raises(NonDeterminismError, match="wait_condition"):
        replay(batch, [start, marker], run_id="r1")  # no item arrived: the condition is false


# --- bad input ------------------------------------------------------------------------------


def refusing_app() -> tuple[App, Any]:
    bad = App("handler-refusals")

    @bad.saga(name="refusals")
    async def refusals(ctx: SagaContext) -> list[str]:
        said: list[str] = []
        registrations: list[Any] = [
            lambda: ctx.on_event("x", "not a function"),
            lambda: ctx.on_event("", print),
            lambda: ctx.on_event("x", print),  # accepted: the next one is a second handler
            lambda: ctx.on_event("x", print),
        ]
        for register in registrations:
            try:
                register()
            except ValidationError as e:
                said.append(str(e))
        awaits: list[Any] = [
            lambda: ctx.wait_for_event("x"),
            lambda: ctx.wait_for_any(["y", "x"]),
            lambda: ctx.wait_condition(True),  # type: ignore[arg-type]
            lambda: ctx.wait_condition(lambda: False, timeout=3),
        ]
        for wait in awaits:
            try:
                await wait()
            except ValidationError as e:
                said.append(str(e))
        return said

    return bad, refusals


def test_bad_input_is_refused_with_what_to_do() -> None:
    bad, refusals = refusing_app()
    env = Harness(bad)
    run_id = env.start(refusals)
    env.run_until_idle()
    said = env.result(run_id)
    assert len(said) == 7, said
    assert "needs a function" in said[0]
    assert "1 to 200 characters" in said[1]
    assert "already has a handler" in said[2]
    assert "wait with ctx.wait_condition" in said[3] and "wait with" in said[4]
    assert "ctx.wait_condition needs a function" in said[5]
    assert "positive timedelta" in said[6]
    assert env.history(run_id)[-1].kind == h.RUN_FINISHED  # nothing recorded for them


# --- code that never yields -----------------------------------------------------------------


def spinning_app() -> tuple[App, Any, Any]:
    spin = App("handler-spin")

    @spin.saga(name="spin-after")
    async def spin_after(ctx: SagaContext) -> None:
        go: list[Any] = []
        ctx.on_event("go", go.append)
        await ctx.wait_condition(lambda: bool(go))
        while True:  # resumed by the condition, never yields again
            pass

    def forever() -> bool:
        while True:
            pass

    @spin.saga(name="spinning-condition")
    async def spinning_condition(ctx: SagaContext) -> None:
        go: list[Any] = []
        ctx.on_event("go", go.append)
        await ctx.wait_condition(lambda: bool(go) and forever())

    return spin, spin_after, spinning_condition


@pytest.mark.parametrize("saga", ["spin-after", "spinning-condition"])
def test_code_resumed_by_a_condition_that_never_yields_parks_the_run(saga: str) -> None:
    spin, *_ = spinning_app()
    env = Harness(spin)
    env.engine.watchdog.deadline = 0.3
    run_id = env.start(saga)
    env.run_until_idle()
    env.send_event(run_id, "go")
    env.run_until_idle()
    env.send_event(run_id, "go")  # the one after: the engine is not stuck either way
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "needs_attention", run
    assert run.reason and "without yielding" in run.reason


@pytest.mark.parametrize("cache", [False, True], ids=["replay", "cache"])
def test_the_event_sent_with_the_start_is_handled_once_registered(cache: bool) -> None:
    batch, first_seen = batch_app()
    env = Harness(batch, cache=cache)
    run_id = env.client.start(first_seen, run_id="box", event=("add_item", "a"))
    env.run_until_idle()
    assert env.result(run_id) == ["a"]
    replay(batch, env.history(run_id), run_id=run_id)
