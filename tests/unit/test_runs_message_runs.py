"""Runs that start and message other runs, and signal-with-start: `ctx.start` and
`ctx.send_event` go through the outbox with the transaction that recorded them, so a replay
never starts a second run nor sends an event twice; `Client.start(..., event=...)` and
`sagaloop start --event` start a run and deliver its first event in one transaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_env import cli_database, run

from sagaloop import App, Client, RunFinishedError, SagaContext
from sagaloop.engine import history as h
from sagaloop.engine.messages import derived_id
from sagaloop.testing import Harness

app = App("family")


@app.saga(name="child")
async def child(ctx: SagaContext, name: str) -> str:
    reply = await ctx.wait_for_event("hello")
    ctx.send_event(reply["from"], "done", f"{name} got {reply['text']}")
    return name


@app.saga(name="parent")
async def parent(ctx: SagaContext, n: int) -> list[Any]:
    kids = [ctx.start(child, f"kid{i}") for i in range(n)]
    named = ctx.start("child", "named", run_id=f"{ctx.run_id}-named")
    for kid in [*kids, named]:
        ctx.send_event(kid, "hello", {"from": ctx.run_id, "text": "hi"})
    answers = sorted([await ctx.wait_for_event("done") for _ in range(n + 1)])
    return [kids, named, answers]


def test_a_parent_starts_children_and_they_message_each_other_once_across_restarts() -> None:
    env = Harness(app)
    run_id = env.start(parent, 2)
    for _ in range(200):  # one message at a time, forgetting everything in memory in between
        if not env.step_once():
            break
        env.restart()
    env.run_until_idle()
    kids, named, answers = env.result(run_id)
    assert named == f"{run_id}-named"
    assert answers == ["kid0 got hi", "kid1 got hi", "named got hi"]
    for kid in [*kids, named]:
        assert env.get(kid).status == "completed"
        arrived = [e for e in env.history(kid) if e.kind == h.EVENT_ARRIVED]
        assert len(arrived) == 1, kid  # sent once, whatever the replays
    sent = [e for e in env.history(run_id) if e.kind == h.EVENT_SENT]
    assert len(sent) == 3
    assert not env.store.dead_letters()


def test_a_child_run_id_derives_from_the_parent_and_the_call_position() -> None:
    env = Harness(app)
    first = env.start(parent, 1)
    env.run_until_idle()
    kids, named, _ = env.result(first)
    assert kids == [derived_id("spawned", first, 0)]  # the first command of the parent
    assert named == f"{first}-named"


def test_an_event_to_a_run_that_does_not_exist_is_dead_lettered_not_lost_silently() -> None:
    lonely = App("lonely")

    @lonely.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        ctx.send_event("nobody", "ping")
        return "sent"

    env = Harness(lonely)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.result(run_id) == "sent"
    [(_, _, reason)] = env.store.dead_letters()
    assert "nobody" in reason


signals = App("signal-with-start")


@signals.saga(name="inbox")
async def inbox(ctx: SagaContext) -> list[Any]:
    return [await ctx.wait_for_event("item"), await ctx.wait_for_event("item")]


def test_signal_with_start_delivers_the_first_event_with_the_start_then_to_the_run() -> None:
    env = Harness(signals)
    run_id = env.client.start(inbox, run_id="box", event=("item", 1), event_id="a")
    again = env.client.start(inbox, run_id="box", event=("item", 1), event_id="a")  # a retry
    assert run_id == again == "box"
    env.client.start(inbox, run_id="box", event=("item", 2))  # the run is there: signal it
    env.run_until_idle()
    assert env.result("box") == [1, 2]
    with pytest.raises(RunFinishedError):
        env.client.start(inbox, run_id="box", event=("item", 3))


def test_sagaloop_start_with_an_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = (
        "from sagaloop import App, SagaContext\n"
        "app = App('swscli')\n"
        "@app.saga(name='inbox')\n"
        "async def inbox(ctx: SagaContext) -> object:\n"
        "    return await ctx.wait_for_event('item')\n"
    )
    db = cli_database(tmp_path, monkeypatch, "swscli", source)
    out = run("start", "inbox", "--event", "item", "--data", '{"n": 1}', "--app", "swscli")
    assert out.exit_code == 0, out.output
    run_id = out.output.strip()
    bad = run("start", "inbox", "--data", "1", "--app", "swscli")
    assert bad.exit_code != 0 and "--event" in bad.output
    import swscli

    env = Harness(swscli.app, url=f"sqlite:///{db}")
    env.clock.set(Client(env.store).get(run_id).created_at)
    env.run_until_idle()
    assert env.result(run_id) == {"n": 1}
