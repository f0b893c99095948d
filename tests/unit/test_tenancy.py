"""Two apps on one database share nothing by accident (issue 10, defect 5), and messages that
sagaloop did not write itself cannot pass for internal ones on the embedded brokers (defect 4).

Each app runs in its own Harness on the same SQLite file, as two deployments would on one
database. An engine must never fire, activate or replay another app's run; an inbox id is
scoped by app, message type and run; ids joined from parts are unambiguous."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as hist
from sagaloop.engine.messages import Envelope, derived_id, engine_queue, step_queue
from sagaloop.engine.ports import Outgoing
from sagaloop.testing.harness import Harness

CALLS: dict[str, list[str]] = {"a": [], "b": []}


def make_app(name: str, key: str) -> App:
    """Two apps whose sagas and steps have the same names and different code."""
    app = App(name)

    @app.step(queue="q", name="charge")
    def charge(ctx: StepContext, what: str) -> str:
        CALLS[key].append(what)
        return f"{key}:{what}"

    @app.saga(name="nap")
    async def nap(ctx: SagaContext, what: str) -> str:
        await ctx.sleep(timedelta(hours=1))
        return await ctx.call(charge, what)

    @app.saga(name="wait")
    async def wait(ctx: SagaContext, what: str) -> str:
        data = await ctx.wait_for_event("go")
        return f"{await ctx.call(charge, what)}|{data}"

    return app


A, B = make_app("tenant-a", "a"), make_app("tenant-b", "b")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Harness, Harness]]:
    url = "sqlite:///" + str(tmp_path / "shared.db")
    CALLS["a"].clear()
    CALLS["b"].clear()
    ha, hb = Harness(A, url=url), Harness(B, url=url)
    try:
        yield ha, hb
    finally:
        ha.close()
        hb.close()


def kinds(h: Harness, run_id: str) -> list[str]:
    return [e.kind for e in h.history(run_id)]


def test_an_engine_fires_only_its_own_apps_timers(pair: tuple[Harness, Harness]) -> None:
    ha, hb = pair
    run = hb.start("nap", "b-run", run_id="b-nap")
    hb.run_until_idle(skip_time=False)
    assert hist.TIMER_STARTED in kinds(hb, run)
    assert ha.store.next_timer_at(app=A.name) is None, "A sees B's timer"
    ha.advance(timedelta(hours=2))
    ha.run_until_idle()
    assert hist.TIMER_FIRED not in kinds(hb, run), "A's engine fired B's timer"
    assert CALLS == {"a": [], "b": []}
    hb.advance(timedelta(hours=2))
    hb.run_until_idle()
    assert hb.get(run).status == "completed" and hb.get(run).output == "b:b-run"
    assert CALLS == {"a": [], "b": ["b-run"]}, "B's run ran A's code"


def test_a_message_for_another_apps_run_is_refused(pair: tuple[Harness, Harness]) -> None:
    ha, hb = pair
    run = hb.start("wait", "b-run", run_id="b-wait")
    hb.run_until_idle()
    before = kinds(hb, run)
    event = Envelope(type="event", run_id=run, payload={"name": "go", "data": "via-a"})
    ha.broker.publish_raw(engine_queue(A.name), event.to_bytes())  # type: ignore[attr-defined]
    ha.run_until_idle()
    assert kinds(hb, run) == before, "A's engine activated B's run"
    [(_, _, reason)] = ha.store.dead_letters()
    assert A.name in reason and B.name in reason, reason
    hb.send_event(run, "go", "via-b")
    hb.run_until_idle()
    assert hb.get(run).output == "b:b-run|via-b"
    assert CALLS == {"a": [], "b": ["b-run"]}


def test_the_engine_inbox_is_per_app(pair: tuple[Harness, Harness]) -> None:
    """B's message with the same id as A's was dropped without a trace."""
    ha, hb = pair
    for h, app in ((ha, A), (hb, B)):
        h.start("wait", app.name, run_id=f"{app.name}-run")
        h.run_until_idle()
    for h, app in ((ha, A), (hb, B)):
        event = Envelope(
            type="event",
            message_id="the-same-id",
            run_id=f"{app.name}-run",
            payload={"name": "go", "data": app.name},
        )
        h.broker.publish_raw(engine_queue(app.name), event.to_bytes())  # type: ignore[attr-defined]
        h.run_until_idle()
    assert ha.get(f"{A.name}-run").output == f"a:{A.name}|{A.name}"
    assert hb.get(f"{B.name}-run").output == f"b:{B.name}|{B.name}"


def test_the_worker_inbox_is_per_app(pair: tuple[Harness, Harness]) -> None:
    """A step message of B with the id of one A's worker processed runs B's step, not A's
    stored reply."""
    ha, hb = pair
    for h, app in ((ha, A), (hb, B)):
        h.start("wait", app.name, run_id=f"{app.name}-w")
        h.run_until_idle()
    now = ha.clock.now()
    for h, app in ((ha, A), (hb, B)):
        task = Envelope(
            type="step",
            message_id="one-step-id",
            run_id=f"{app.name}-w",
            position=99,
            attempt=1,
            payload={"step": "charge", "direction": "do", "args": {"what": app.name}},
        )
        with h.store.transaction() as tx:  # written by sagaloop's own store: trusted
            h.store.enqueue(tx, [Outgoing(step_queue(app.name, "q"), task)], now)
        h.run_until_idle()
    assert {"a": [A.name], "b": [B.name]} == CALLS


def test_event_ids_of_different_runs_never_collide(pair: tuple[Harness, Harness]) -> None:
    """``acct:7`` + ``reply`` and ``acct`` + ``7:reply`` used to join to one id."""
    ha, _ = pair
    assert derived_id("event", "acct:7", "reply") != derived_id("event", "acct", "7:reply")
    for run in ("acct:7", "acct"):
        ha.start("wait", run, run_id=run)
    ha.run_until_idle()
    ha.client.send_event("acct:7", "go", "first", event_id="reply")
    ha.client.send_event("acct", "go", "second", event_id="7:reply")
    ha.run_until_idle()
    assert ha.get("acct:7").output == "a:acct:7|first"
    assert ha.get("acct").output == "a:acct|second"


# --- forged internal messages on the embedded brokers -----------------------------------------


@pytest.mark.parametrize("broker", ["database", "memory"])
@pytest.mark.parametrize(
    ("queue", "message"),
    [
        (
            "engine",
            {
                "type": "step_result",
                "position": 1,
                "attempt": 1,
                "payload": {"outcome": "completed"},
            },
        ),
        ("engine", {"type": "timer", "position": 0, "payload": {"kind": "wait"}}),
        ("step", {"type": "step", "payload": {"step": "charge", "args": {"what": "forged"}}}),
        (
            "step",
            {
                "type": "step",
                "payload": {"step": "charge", "direction": "undo", "args": {"what": "forged"}},
            },
        ),
    ],
)
def test_an_internal_message_not_written_by_sagaloop_is_refused(
    tmp_path: Path, broker: Any, queue: str, message: dict[str, Any]
) -> None:
    CALLS["a"].clear()
    h = Harness(A, url="sqlite:///" + str(tmp_path / "db"), broker=broker)
    try:
        run = h.start("wait", "x", run_id="victim")
        h.run_until_idle()
        target = engine_queue(A.name) if queue == "engine" else step_queue(A.name, "q")
        body = json.dumps({"run_id": run, "position": 0, "attempt": 1, **message}).encode()
        h.broker.publish_raw(target, body)  # type: ignore[attr-defined]
        h.run_until_idle()
        dead = (
            h.store.dead_letters() if broker == "database" else h.broker.dead  # type: ignore[attr-defined]
        )
        [(_, _, reason)] = dead
        assert "not signed by sagaloop" in reason, reason
        assert CALLS["a"] == [] and h.get(run).status == "waiting"
        assert [e.kind for e in h.history(run)][-1] == hist.EVENT_WAITING
    finally:
        h.close()
