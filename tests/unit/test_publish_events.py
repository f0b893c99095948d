"""Events routed other than by run id (issue 25 item 1): ``Client.publish_event`` reaches the
runs subscribed to or waiting on ``(name, key)``, a ``match`` predicate picks the event a wait
takes, ``ctx.subscribe`` keeps what is published while the code is elsewhere, and sagas
declared with ``on_event`` start one run per event, on both store backends."""

from __future__ import annotations

import asyncio
import json
import sqlite3
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

    @app.saga(
        name="on_order", on_event="order.placed", run_id=lambda e: f"{app.name}-{e.data['id']}"
    )
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


def _runs(env: Harness, saga: str) -> list[str]:
    """The runs of ``saga`` of this test's app (the PostgreSQL database is shared)."""
    return [r.run_id for r in env.client.list(saga=saga) if r.app == env.app.name]


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
    assert "waiting for event 'order.paid' published with key 'A'" in str(
        env.status("a").waiting_for
    )
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
    assert env.result(f"{env.app.name}-7") == "handled 7"
    audits = _runs(env, "audit")
    assert len(audits) == 1 and env.result(audits[0]) == {"id": 7}
    assert _runs(env, "on_order") == [f"{env.app.name}-7"]


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


def test_the_subscription_store_serves_a_key_and_every_key_and_rolls_back(url: str) -> None:
    from sagaloop.store.sql import SqlStore

    store = SqlStore(url)
    store.upgrade()
    app, other = f"st{uuid.uuid4().hex[:8]}", f"st{uuid.uuid4().hex[:8]}"
    try:
        with store.transaction() as tx:
            store.set_subscriptions(tx, app, "r1", frozenset({("n", "A"), ("m", "")}))
            store.set_subscriptions(tx, app, "r2", frozenset({("n", "")}))
            store.set_subscriptions(tx, app, "r3", frozenset({("n", "B")}))
            store.set_subscriptions(tx, other, "r4", frozenset({("n", "A")}))
        assert store.subscribers(None, app, "n", "A") == ["r1", "r2"]  # its key, and any key
        assert store.subscribers(None, app, "n", None) == ["r2"]  # no key: the any-key ones
        assert store.subscribers(None, app, "m", "Z") == ["r1"]
        with store.transaction() as tx:  # a diff: one deleted, one added, one kept
            store.set_subscriptions(tx, app, "r1", frozenset({("n", "A"), ("o", "")}))
        assert store.subscriptions_of(None, "r1") == {("n", "A"), ("o", "")}
        with pytest.raises(RuntimeError), store.transaction() as tx:
            store.set_subscriptions(tx, app, "r1", frozenset())
            raise RuntimeError("rolled back")
        assert store.subscriptions_of(None, "r1") == {("n", "A"), ("o", "")}
    finally:
        with store.transaction() as tx:
            for run_id in ("r1", "r2", "r3"):
                store.set_subscriptions(tx, app, run_id, frozenset())
            store.set_subscriptions(tx, other, "r4", frozenset())
        store.close()


def test_wait_for_any_on_a_key_and_a_lost_race_ends_the_wait_s_subscription() -> None:
    app = App(f"pub{uuid.uuid4().hex[:10]}")

    @app.saga(name="either")
    async def either(ctx: SagaContext, key: str) -> Any:
        got = await ctx.wait_for_any(["shipped", "cancelled"], key=key)
        return [got.name, got.data]

    @app.saga(name="race")
    async def race(ctx: SagaContext) -> str:
        wait = asyncio.ensure_future(ctx.wait_for_event("tick", key="k"))
        nap = asyncio.ensure_future(ctx.sleep(timedelta(minutes=1)))
        await asyncio.wait({wait, nap}, return_when=asyncio.FIRST_COMPLETED)
        wait.cancel()
        await ctx.sleep(timedelta(hours=1))
        return "slept"

    with closing(Harness(app)) as env:
        env.start("either", "p1", run_id="e")
        env.start("race", run_id="r")
        env.run_until_idle(skip_time=False)
        assert env.store.subscriptions_of(None, "e") == {("shipped", "p1"), ("cancelled", "p1")}
        assert env.store.subscriptions_of(None, "r") == {("tick", "k")}
        env.client.publish_event("cancelled", "late", key="p2")
        env.client.publish_event("cancelled", "sorry", key="p1")
        env.advance(timedelta(minutes=1))  # the nap wins the race
        env.run_until_idle(skip_time=False)
        assert env.result("e") == ["cancelled", "sorry"]
        assert env.store.subscriptions_of(None, "e") == frozenset()
        assert env.get("r").status == "waiting"
        assert env.store.subscriptions_of(None, "r") == frozenset()  # the lost wait's, ended
        env.client.publish_event("tick", 1, key="k")
        env.run_until_idle(skip_time=False)
        assert not [e for e in env.history("r") if e.kind == h.EVENT_ARRIVED]


def test_continue_as_new_ends_the_subscriptions_and_a_handler_takes_subscribed_events() -> None:
    app = App(f"pub{uuid.uuid4().hex[:10]}")

    @app.saga(name="rounds")
    async def rounds(ctx: SagaContext, n: int) -> list[Any]:
        seen: list[Any] = []
        ctx.on_event("note", seen.append)
        if n == 0:
            ctx.subscribe("note", key="first")
            await ctx.wait_condition(lambda: len(seen) == 1)
            ctx.continue_as_new(1)
        ctx.subscribe("note", key="second")
        await ctx.wait_condition(lambda: len(seen) == 1)
        return seen

    with closing(Harness(app)) as env:
        env.start("rounds", 0, run_id="c")
        env.run_until_idle(skip_time=False)
        assert env.store.subscriptions_of(None, "c") == {("note", "first")}
        env.client.publish_event("note", "one", key="first")
        env.run_until_idle(skip_time=False)
        assert env.store.subscriptions_of(None, "c") == {("note", "second")}  # the new history's
        env.client.publish_event("note", "stale", key="first")  # nobody subscribes to it now
        env.client.publish_event("note", "two", key="second")
        env.run_until_idle(skip_time=False)
        assert env.result("c") == ["two"]

        assert env.store.subscriptions_of(None, "c") == frozenset()


def test_saga_code_refuses_bad_names_keys_and_predicates() -> None:
    app = App(f"pub{uuid.uuid4().hex[:10]}")

    @app.saga(name="bad")
    async def bad(ctx: SagaContext, which: str) -> str:
        try:
            if which == "name":
                ctx.subscribe("")
            elif which == "key":
                ctx.publish_event("n", key="")
            else:
                await ctx.wait_for_event("n", match="data.userId")  # type: ignore[arg-type]
        except ValidationError as e:
            return str(e)
        return "accepted"

    with closing(Harness(app)) as env:
        for which in ("name", "key", "match"):
            env.start("bad", which, run_id=which)
        env.run_until_idle()
        assert "event name of 1 to 200" in env.result("name")
        assert "a key is 1 to 200" in env.result("key")
        assert "is a function" in env.result("match")
    with pytest.raises(Exception, match="run_id= is a function of the event"):
        app.saga(name="x", run_id=lambda e: "r")(bad.fn)


def test_a_match_wait_takes_the_oldest_kept_event_it_matches() -> None:
    app = App(f"pub{uuid.uuid4().hex[:10]}")

    @app.saga(name="late")
    async def late(ctx: SagaContext) -> list[Any]:
        ctx.subscribe("score")
        await ctx.sleep(timedelta(hours=1))
        high = await ctx.wait_for_event("score", match=lambda d: d > 10)
        rest = await ctx.wait_for_event("score")
        return [high, rest]

    with closing(Harness(app)) as env:
        env.start("late", run_id="l")
        env.run_until_idle(skip_time=False)
        for score in (3, 42):
            env.client.publish_event("score", score)
            env.run_until_idle(skip_time=False)
        env.advance(timedelta(hours=1))
        env.run_until_idle()
        assert env.result("l") == [42, 3]  # 3 was kept, skipped by the match, taken next
        seqs = {e.data["data"]: e.seq for e in env.history("l") if e.kind == h.EVENT_ARRIVED}
        taken = [e.data["seq"] for e in env.history("l") if e.kind == h.EVENT_TAKEN]
        assert taken == [seqs[42], seqs[3]]
        assert env.status("l").status == "completed"


def test_a_raw_publish_sent_twice_under_one_event_id_is_fanned_out_once(env: Harness) -> None:
    env.start("paid", "R", run_id="raw")
    _waits(env, "raw")
    queue = engine_queue(env.app.name)
    bodies = [  # different bytes (no message id: each its own hash), one event id
        {"type": "publish", "run_id": "evt-r", "payload": {"name": "order.paid", "key": "R"}},
        {
            "type": "publish",
            "run_id": "evt-r",
            "payload": {"name": "order.paid", "key": "R"},
            "v": 1,
        },
        {
            "type": "publish",
            "run_id": "evt-p",
            "payload": {"name": "order.placed", "data": {"id": 3}},
        },
        {
            "type": "publish",
            "run_id": "evt-p",
            "payload": {"name": "order.placed", "data": {"id": 3}},
            "v": 1,
        },
    ]
    env.broker.publish([(queue, json.dumps(b).encode()) for b in bodies])
    env.run_until_idle(skip_time=False)
    assert env.get("raw").status == "completed"
    assert len([e for e in env.history("raw") if e.kind == h.EVENT_ARRIVED]) == 1
    assert _runs(env, "on_order") == [f"{env.app.name}-3"]
    assert len(_runs(env, "audit")) == 1
    inbox = env.store.inbox_get(None, "engine", f"{env.app.name}:publish:evt-r:publish%3Aevt-r")
    assert inbox[0], "recorded once, under the event id"


PUBLISH_APP = """
from sagaloop import App, SagaContext

app = App("cli_publish_app")


@app.saga(name="waiter")
async def waiter(ctx: SagaContext, order: str) -> object:
    return await ctx.wait_for_event("order.paid", key=order)
"""


def test_the_cli_publishes_once_per_event_id_and_refuses_bad_input(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from sagaloop.cli.main import cli

    (tmp_path / "cli_publish_app.py").write_text(PUBLISH_APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path / 's.db'}"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)

    def run(*args: str) -> Any:
        return CliRunner().invoke(cli, list(args), catch_exceptions=False)

    assert run("db", "upgrade").exit_code == 0
    args = ["publish", "order.paid", "--key", "7", "--data", '{"amount": 3}', "--event-id", "p7"]
    first = run(*args, "--app", "cli_publish_app")
    assert first.exit_code == 0 and first.output.strip() == "p7"
    bad = run("publish", "order.paid", "--data", "[1,", "--app", "cli_publish_app")
    assert bad.exit_code != 0 and "not valid JSON" in bad.output
    empty_key = run("publish", "order.paid", "--key", "", "--app", "cli_publish_app")
    assert empty_key.exit_code != 0 and "key" in empty_key.output
    with sqlite3.connect(tmp_path / "s.db") as conn:
        [(queue, raw)] = conn.execute("select queue, body from sagaloop_outbox").fetchall()
    body = json.loads(raw)
    assert queue == "cli_publish_app.engine"
    assert body["type"] == "publish" and body["run_id"] == "p7"
    assert body["payload"] == {"name": "order.paid", "data": {"amount": 3}, "key": "7"}


def test_upgrade_from_version_7_adds_the_subscriptions_table(tmp_path: Any) -> None:
    import sqlalchemy as sa

    from sagaloop.store import migrations
    from sagaloop.store.sql import SqlStore

    store = SqlStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.upgrade()
    with store.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE sagaloop_subscriptions"))
        conn.execute(sa.text("UPDATE sagaloop_schema SET version = 7"))
    assert store.upgrade() == (7, migrations.LATEST)  # 8 and whatever came after
    with store.transaction() as tx:
        store.set_subscriptions(tx, "app", "r", frozenset({("n", "k")}))
    assert store.subscribers(None, "app", "n", "k") == ["r"]
    store.close()


def test_an_event_a_handler_took_is_not_shown_as_kept() -> None:
    app = App(f"pub{uuid.uuid4().hex[:10]}")

    @app.saga(name="listener")
    async def listener(ctx: SagaContext) -> None:
        ctx.subscribe("note")
        seen: list[Any] = []
        ctx.on_event("note", seen.append)
        await ctx.wait_for_event("never")

    with closing(Harness(app)) as env:
        env.start("listener", run_id="l")
        env.run_until_idle(skip_time=False)
        env.client.publish_event("note", "hello")
        env.run_until_idle(skip_time=False)
        assert env.get("l").status == "waiting"
        assert len([e for e in env.history("l") if e.kind == h.EVENT_ARRIVED]) == 1
        assert env.status("l").kept == []  # the handler took it
