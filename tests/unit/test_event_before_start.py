"""An event that sagaloop sent to a run can come before that run's start: a saga that spawns
a child and sends it an event writes two messages in one commit, and two consumer threads (or
two engine processes) may take them apart and process the event first. Such an event is
handed back until the run exists, a few times, then dead-lettered; one from outside
sagaloop's processes (a raw publish) is dead-lettered at once, as before."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sagaloop import App, SagaContext
from sagaloop.brokers.dead_letters import DeadLetters
from sagaloop.engine.messages import Envelope, engine_queue
from sagaloop.runtime.consumers import NOT_STARTED_TRIES
from sagaloop.testing import Harness

app = App("early")


@app.saga(name="wait-for-go")
async def wait_for_go(ctx: SagaContext, _: Any) -> Any:
    return await ctx.wait_for_event("go", timeout=timedelta(days=1))


@app.saga(name="child")
async def child(ctx: SagaContext, _: Any) -> Any:
    return await ctx.wait_for_event("go", timeout=timedelta(days=1))


@app.saga(name="parent")
async def parent(ctx: SagaContext, _: Any) -> Any:
    kid = ctx.start(child)  # one commit writes the child's start and the event to it
    ctx.send_event(kid, "go", "from the parent")
    return kid


def event(run_id: str, message_id: str) -> bytes:
    return Envelope(
        type="event",
        run_id=run_id,
        message_id=message_id,
        payload={"name": "go", "data": "early"},
        created_at=datetime(2026, 12, 3, tzinfo=UTC),
    ).to_bytes()


def dead_letters(h: Harness) -> list[str]:
    assert isinstance(h.broker, DeadLetters)
    return [letter.reason for letter in h.broker.list_dead_letters()]


@pytest.mark.parametrize("broker", ["database", "memory"])
def test_an_event_sagaloop_sent_before_its_run_started_reaches_the_run(broker: str) -> None:
    h = Harness(app, broker=broker)
    try:
        h.broker.publish_raw(engine_queue(app.name), event("late", "e-1"), trusted=True)  # type: ignore[attr-defined]
        h.run_until_idle(skip_time=False)  # processed before its run exists: handed back
        assert dead_letters(h) == []
        run = h.start(wait_for_go, None, run_id="late")
        h.run_until_idle()
        assert h.get(run).status == "completed"
        assert h.result(run) == "early"
        assert dead_letters(h) == []
    finally:
        h.close()


@pytest.mark.parametrize("broker", ["database", "memory"])
def test_an_event_sagaloop_sent_to_a_run_that_never_starts_is_dead_lettered_in_the_end(
    broker: str,
) -> None:
    h = Harness(app, broker=broker)
    try:
        h.broker.publish_raw(engine_queue(app.name), event("never", "e-2"), trusted=True)  # type: ignore[attr-defined]
        h.run_until_idle()
        (reason,) = dead_letters(h)
        assert reason == f"no run with id 'never' (after {NOT_STARTED_TRIES} deliveries)"
    finally:
        h.close()


def test_a_raw_event_for_a_missing_run_is_dead_lettered_at_once() -> None:
    h = Harness(app, broker="database")
    try:
        h.broker.publish_raw(engine_queue(app.name), event("nobody", "e-3"))  # type: ignore[attr-defined]
        h.run_until_idle(skip_time=False)
        assert dead_letters(h) == ["no run with id 'nobody'"]
    finally:
        h.close()


def test_a_parent_that_spawns_a_child_and_signals_it_at_once() -> None:
    h = Harness(app, broker="database")
    try:
        run = h.start(parent, None)
        h.run_until_idle()
        kid = h.result(run)
        assert h.get(kid).status == "completed" and h.result(kid) == "from the parent"
        assert dead_letters(h) == []
    finally:
        h.close()
