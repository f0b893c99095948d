"""Events routed other than by run id (issue 25 item 1): ``Client.publish_event`` reaches the
runs subscribed to or waiting on ``(name, key)``, a ``match`` predicate picks the event a wait
takes, ``ctx.subscribe`` keeps what is published while the code is elsewhere, and sagas
declared with ``on_event`` start one run per event, on both store backends."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import closing
from datetime import timedelta
from typing import Any

import pytest

from sagaloop import (
    App,
    NonDeterminismError,
    PublishedEvent,
    SagaContext,
    ValidationError,
)
from sagaloop.engine import history as h
from sagaloop.engine.messages import engine_queue
from sagaloop.testing import Harness, replay


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return "sqlite://"
    return str(request.getfixturevalue("postgres_url"))


def _app() -> App:
    app = App(f"pub{uuid.uuid4().hex[:10]}")  # a name of its own: the PostgreSQL db is shared

    @app.saga(name="paid")
    async def paid(ctx: SagaContext, order: str) -> Any:
        return await ctx.wait_for_event("order.paid", key=order, timeout=timedelta(hours=1))

    @app.saga(name="signup")
    async def signup(ctx: SagaContext, user: str) -> Any:
        return await ctx.wait_for_event("user.signed_up", match=lambda d: d["user"] == user)

    @app.saga(name="ticker")
    async def ticker(ctx: SagaContext, symbol: str) -> list[Any]:
        ctx.subscribe("price", key=symbol)
        await ctx.sleep(timedelta(hours=1))  # what is published meanwhile is kept
        first = await ctx.wait_for_event("price")
        second = await ctx.wait_for_event("price")
        ctx.unsubscribe("price", key=symbol)
        return [first, second]

    @app.saga(name="on_order", on_event="order.placed", run_id=lambda e: f"order-{e.data['id']}")
    async def on_order(ctx: SagaContext, order: dict[str, Any]) -> str:
        return f"handled {order['id']}"

    @app.saga(name="audit", on_event="order.placed")
    async def audit(ctx: SagaContext, order: Any) -> Any:
        return order

    @app.saga(name="announcer")
    async def announcer(ctx: SagaContext, order: str) -> str:
        return ctx.publish_event("order.paid", {"by": "announcer"}, key=order)

    return app


@pytest.fixture
def env(url: str) -> Iterator[Harness]:
    with closing(Harness(_app(), url=url)) as harness:
        yield harness


def _waits(env: Harness, run_id: str) -> None:
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"


def test_an_event_published_with_a_key_reaches_the_runs_waiting_on_that_key_only(
    env: Harness,
) -> None:
    env.start("paid", "A", run_id="a")
    env.start("paid", "B", run_id="b")
    _waits(env, "a")
    _waits(env, "b")
    assert env.store.subscriptions_of(None, "a") == {("order.paid", "A")}  # type: ignore[attr-defined]

    env.client.publish_event("order.paid", {"amount": 5}, key="A")
    env.run_until_idle(skip_time=False)

    assert env.result("a") == {"amount": 5}
    assert env.get("b").status == "waiting"
    assert not [e for e in env.history("b") if e.kind == h.EVENT_ARRIVED]  # never delivered
    assert env.store.subscriptions_of(None, "a") == frozenset()  # type: ignore[attr-defined]
    taken = [e for e in env.history("a") if e.kind == h.EVENT_TAKEN]
    assert [(e.pos, e.name) for e in taken] == [(0, "order.paid")]

    env.client.publish_event("order.paid", {"amount": 7}, key="B")
    env.run_until_idle(skip_time=False)
    assert env.result("b") == {"amount": 7}


def test_a_keyed_wait_times_out_and_its_subscription_ends(env: Harness) -> None:
    env.start("paid", "Z", run_id="z")
    _waits(env, "z")
    env.advance(timedelta(hours=2))
    env.run_until_idle()
    assert env.get("z").status == "failed"
    assert "EventTimeoutError" in json.dumps(env.get("z").error)
    assert env.store.subscriptions_of(None, "z") == frozenset()  # type: ignore[attr-defined]


def test_match_takes_the_first_event_its_predicate_is_true_for_and_replays_the_same(
    env: Harness,
) -> None:
    env.start("signup", "u1", run_id="s1")
    _waits(env, "s1")
    env.client.publish_event("user.signed_up", {"user": "u2"})
    env.run_until_idle(skip_time=False)
    assert env.get("s1").status == "waiting", "u2's event does not match: kept, not taken"
    env.client.publish_event("user.signed_up", {"user": "u1", "plan": "pro"})
    env.run_until_idle(skip_time=False)

    assert env.result("s1") == {"user": "u1", "plan": "pro"}
    history = env.history("s1")
    arrived = {e.seq: e.data["data"]["user"] for e in history if e.kind == h.EVENT_ARRIVED}
    [taken] = [e for e in history if e.kind == h.EVENT_TAKEN]
    assert arrived[taken.data["seq"]] == "u1"  # which event the predicate chose, recorded
    replay(env.app, history)  # the code, replayed, takes the same one

    changed = App(env.app.name)  # a deploy whose predicate takes another event

    @changed.saga(name="signup")
    async def signup(ctx: SagaContext, user: str) -> Any:
        return await ctx.wait_for_event("user.signed_up", match=lambda d: True)

    with pytest.raises(NonDeterminismError, match="took the event at seq"):
        replay(changed, history)


def test_a_subscription_keeps_what_is_published_while_the_code_is_elsewhere(
    env: Harness,
) -> None:
    env.client.publish_event("price", 1, key="ACME")  # before the run subscribes: never seen
    env.run_until_idle(skip_time=False)
    env.start("ticker", "ACME", run_id="t")
    env.run_until_idle(skip_time=False)
    assert env.get("t").status == "waiting"  # asleep
    env.client.publish_event("price", 2, key="ACME")
    env.client.publish_event("price", 99, key="OTHER")
    env.client.publish_event("price", 3, key="ACME")
    env.run_until_idle(skip_time=False)
    env.advance(timedelta(hours=1))
    env.run_until_idle()
    assert env.result("t") == [2, 3]
    assert env.store.subscriptions_of(None, "t") == frozenset()  # type: ignore[attr-defined]


def test_on_event_starts_one_run_per_event_even_when_published_again(env: Harness) -> None:
    first = env.client.publish_event("order.placed", {"id": 7}, event_id="evt-7")
    again = env.client.publish_event("order.placed", {"id": 7}, event_id="evt-7")
    assert first == again == PublishedEvent("order.placed", {"id": 7}, None, "evt-7")
    env.run_until_idle()
    assert env.result("order-7") == "handled 7"
    audits = [r for r in env.client.list(saga="audit")]
    assert len(audits) == 1 and env.result(audits[0].run_id) == {"id": 7}
    assert len(env.client.list(saga="on_order")) == 1


def test_saga_code_publishes_through_the_outbox_once(env: Harness) -> None:
    env.start("paid", "K", run_id="k")
    _waits(env, "k")
    env.start("announcer", "K", run_id="ann")
    env.run_until_idle(skip_time=False)
    event_id = env.result("ann")
    assert env.result("k") == {"by": "announcer"}
    [published] = [e for e in env.history("ann") if e.kind == h.EVENT_PUBLISHED]
    assert published.data["event_id"] == event_id and published.data["key"] == "K"


def test_hostile_publishes_are_refused_with_reasons(env: Harness) -> None:
    for name, key in [("", None), ("x" * 201, None), ("ok", ""), ("ok", "k\x00")]:
        with pytest.raises(ValidationError):
            env.client.publish_event(name, key=key)
    queue = engine_queue(env.app.name)
    bad = [
        {"type": "publish", "run_id": "e1", "payload": {"data": 1}},
        {"type": "publish", "run_id": "e2", "payload": {"name": "n", "key": 5}},
        {"type": "publish", "run_id": "e3", "payload": {"name": "n", "extra": 1}},
    ]
    env.broker.publish([(queue, json.dumps(b).encode()) for b in bad])
    env.run_until_idle()
    reasons = [reason for _q, _b, reason in env.store.dead_letters()]  # type: ignore[attr-defined]
    assert len(reasons) == 3 and all("invalid publish payload" in r for r in reasons), reasons


def test_a_run_id_function_that_raises_dead_letters_the_publish_with_why() -> None:
    app = App(f"pub{uuid.uuid4().hex[:10]}")

    @app.saga(on_event="boom", run_id=lambda e: e.data["missing"])
    async def started(ctx: SagaContext, data: Any) -> None:
        return None

    with closing(Harness(app)) as env:
        env.client.publish_event("boom", {})
        env.run_until_idle()
        [(_q, _b, reason)] = env.store.dead_letters()
        assert "run_id function of saga 'started' raised" in reason
