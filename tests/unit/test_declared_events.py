"""A rejected event is seen by its sender (issue 23, item 5).

A saga declares the events it accepts (``@app.saga(events={...})``): the client refuses a bad
one at the door even before the wait begins, and an undeclared name; an event refused later
(sent by a publisher without the saga's code) is shown with its reason in ``status``, whose
"why it waits" stays true: a refused event never ends a wait. Events received and not yet
taken are listed too."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel

import sagaloop
from sagaloop import App, EventTimeoutError, SagaContext
from sagaloop.client import Client
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope, engine_queue
from sagaloop.testing import Harness, replay

TWO_DAYS = timedelta(days=2)


class Reply(BaseModel):
    text: str
    accepted: bool


app = App("declared")


@app.saga(name="undeclared")
async def undeclared(ctx: SagaContext) -> Any:
    """Declares nothing: its wait names the model itself."""
    await ctx.wait_for_event("go")
    try:
        reply = await ctx.wait_for_event("reply", timeout=TWO_DAYS, model=Reply)
    except EventTimeoutError:
        return "timeout"
    return reply.text


@app.saga(name="declared", events={"reply": Reply, "go": None})
async def declared(ctx: SagaContext) -> Any:
    """Declares its events: ``wait_for_event("reply")`` takes the declared model."""
    await ctx.wait_for_event("go")
    try:
        reply = await ctx.wait_for_event("reply", timeout=TWO_DAYS)
    except EventTimeoutError:
        return "timeout"
    assert isinstance(reply, Reply), reply
    return reply.text


def kinds(env: Harness, run_id: str, kind: str) -> list[Any]:
    return [e for e in env.history(run_id) if e.kind == kind]


# --- a refused event never ends a wait --------------------------------------------------------


def test_an_early_event_refused_when_the_wait_begins_leaves_the_wait_open_and_says_why() -> None:
    """Sent before the wait began (the client could not check it then), refused when the wait
    began: status still says what the run waits for, with the reason of the refusal, and the
    wait's timeout still runs."""
    env = Harness(app)
    run_id = env.start(undeclared)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "reply", {"text": "typo"})  # no wait for it yet: nothing to check
    env.send_event(run_id, "go")
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    [rejected] = kinds(env, run_id, h.EVENT_REJECTED)
    assert rejected.name == "reply" and "accepted" in rejected.data["reason"]
    status = env.status(run_id)
    [line] = [w for w in status.waiting_for if "waiting for event 'reply'" in w]
    assert "1 refused" in line and "accepted" in line, status.waiting_for
    assert [w.events for w in status.waits] == [["reply"]]
    assert status.kept == [], "the refused event is not kept for a later wait"
    env.run_until_idle()  # skipping time: the wait's timeout fires
    assert env.result(run_id) == "timeout"


def test_of_two_early_events_the_misfit_is_refused_and_the_fit_one_ends_the_wait() -> None:
    env = Harness(app)
    run_id = env.start(undeclared)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "reply", {"text": "typo"})
    env.send_event(run_id, "reply", {"text": "yes", "accepted": True})
    env.send_event(run_id, "go")
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == "yes"
    replay(app, env.history(run_id), run_id=run_id)


# --- declared events: refused at the door ------------------------------------------------------


def test_a_declared_event_that_does_not_fit_is_refused_before_the_wait_begins() -> None:
    env = Harness(app)
    run_id = env.start(declared)
    env.run_until_idle(skip_time=False)
    with pytest.raises(sagaloop.ValidationError, match="accepted") as refused:
        env.send_event(run_id, "reply", {"text": "typo"})
    assert "nothing was sent" in str(refused.value)
    with pytest.raises(sagaloop.ValidationError, match="'go', 'reply'") as unknown:
        env.send_event(run_id, "replied", {"text": "yes", "accepted": True})
    assert "nothing was sent" in str(unknown.value)
    env.run_until_idle(skip_time=False)
    assert not kinds(env, run_id, h.EVENT_ARRIVED), "nothing reached the run"
    env.send_event(run_id, "reply", {"text": "yes", "accepted": True})  # early, and fits
    env.send_event(run_id, "go", [1, 2])  # declared without a model: any data
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == "yes"
    [waiting] = [e for e in kinds(env, run_id, h.EVENT_WAITING) if e.name == "reply"]
    assert waiting.data["model"] == f"{__name__}:Reply", "the declared model, recorded"
    replay(app, env.history(run_id), run_id=run_id)


def test_a_client_without_the_app_checks_with_the_declaration_the_run_recorded() -> None:
    """``sagaloop send-event`` has no saga code: the run's start recorded what it accepts."""
    env = Harness(app)
    run_id = env.start(declared)
    [started] = kinds(env, run_id, h.RUN_STARTED)
    assert started.data["events"] == {"reply": f"{__name__}:Reply", "go": None}
    bare = Client(env.store, "declared", clock=env.clock)
    with pytest.raises(sagaloop.ValidationError, match="accepted"):
        bare.send_event(run_id, "reply", {"text": "typo"})
    with pytest.raises(sagaloop.ValidationError, match="does not accept"):
        bare.send_event(run_id, "other")
    bare.send_event(run_id, "reply", {"text": "yes", "accepted": True})
    bare.send_event(run_id, "go")
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == "yes"


def test_a_saga_that_declares_nothing_takes_any_event_name() -> None:
    env = Harness(app)
    run_id = env.start(undeclared)
    [started] = kinds(env, run_id, h.RUN_STARTED)
    assert "events" not in started.data
    env.send_event(run_id, "anything", {"at": "all"})  # kept, never taken: not refused
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"


def test_a_declaration_names_events_and_models_it_can_check() -> None:
    bad = App("bad-declarations")

    async def saga(ctx: SagaContext) -> None:
        return None

    with pytest.raises(sagaloop.DeclarationError, match="approval"):
        bad.saga(name="a", events={"approval:x": None})(saga)
    with pytest.raises(sagaloop.DeclarationError, match="event name"):
        bad.saga(name="b", events={"": None})(saga)
    with pytest.raises(sagaloop.DeclarationError, match="model"):
        bad.saga(name="c", events={"x": 42})(saga)  # type: ignore[dict-item]
    ids = bad.saga(name="d", events={"ids": list[int]})(saga)  # a type of pydantic's too
    assert ids.recorded_events() == {"ids": None}, "not importable: the engine checks it"


# --- events received, not yet taken -----------------------------------------------------------


def test_status_lists_the_events_received_and_not_yet_taken() -> None:
    env = Harness(app)
    run_id = env.start(undeclared)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "reply", {"text": "early", "accepted": True})
    env.run_until_idle(skip_time=False)
    status = env.status(run_id)
    assert [(k.name, k.data) for k in status.kept] == [
        ("reply", {"text": "early", "accepted": True})
    ]
    assert any("event 'reply' received" in w and "kept" in w for w in status.waiting_for), (
        status.waiting_for
    )
    assert status.to_json()["kept"][0]["name"] == "reply"
    env.send_event(run_id, "go")
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == "early"
    assert env.status(run_id).kept == []


@app.saga(name="continues", events={"reply": Reply})
async def continues(ctx: SagaContext, rounds: int) -> Any:
    """Continues as new once, then waits: the engine writes the second history's start."""
    if rounds:
        ctx.continue_as_new(rounds - 1)
    reply = await ctx.wait_for_event("reply")
    return reply.text


@app.saga(name="parent")
async def parent(ctx: SagaContext) -> Any:
    return await ctx.call(declared, run_id="the-child")


def test_runs_the_engine_starts_record_the_declaration_too() -> None:
    """A child run and a run started by a publisher without the client: their start is
    written by the engine, and a client without the App still refuses a bad event at the
    door. A run continued as new: a client with the App does (one without it checks once the
    wait begins)."""
    env = Harness(app)
    bare = Client(env.store, "declared", clock=env.clock)
    continued = env.start(continues, 1)
    env.start(parent)
    published = "published-start"
    env.broker.publish(
        [
            (
                engine_queue(app.name),
                Envelope(type="start", run_id=published, saga="declared", payload={}).to_bytes(),
            )
        ]
    )
    env.run_until_idle(skip_time=False)
    assert kinds(env, continued, h.EVENT_WAITING), "continued as new, then waits"
    for client, run_id in ((env.client, continued), (bare, "the-child"), (bare, published)):
        with pytest.raises(sagaloop.ValidationError, match="accepted"):
            client.send_event(run_id, "reply", {"text": "typo"})
        with pytest.raises(sagaloop.ValidationError, match="does not accept"):
            client.send_event(run_id, "other")
        client.send_event(run_id, "reply", {"text": run_id, "accepted": True})
    env.send_event("the-child", "go")
    env.send_event(published, "go")
    env.run_until_idle(skip_time=False)
    assert env.result(continued) == continued
    assert env.result(published) == published
    declared_events = [e for e in env.history(published) if e.kind == h.EVENTS_DECLARED]
    assert len(declared_events) == 1, "recorded once, not again on replay"
    replay(app, env.history(published), run_id=published)


def test_the_mcp_send_event_tool_refuses_what_the_run_would_refuse() -> None:
    from sagaloop.mcp_server.server import SagaMCPServer

    env = Harness(app)
    run_id = env.start(declared)
    env.run_until_idle(skip_time=False)
    server = SagaMCPServer(env.client, app)
    with pytest.raises(sagaloop.ValidationError, match="nothing was sent"):
        server.answer("send_event", {"run_id": run_id, "name": "reply", "data": {}}, "mcp")
    with pytest.raises(sagaloop.ValidationError, match="does not accept"):
        server.answer("send_event", {"run_id": run_id, "name": "other"}, "mcp")
    sent = server.answer("send_event", {"run_id": run_id, "name": "go"}, "mcp")
    assert sent["sent"] is True
    env.run_until_idle(skip_time=False)
    status = server.answer("run_status", {"run_id": run_id}, "mcp")
    assert any("waiting for event 'reply'" in line for line in status["waiting_for"]), status


@app.saga(name="either", events={"reply": Reply, "stop": None})
async def either(ctx: SagaContext) -> Any:
    got = await ctx.wait_for_any(["reply", "stop"])
    return ["reply", got.data.text] if got.name == "reply" else ["stop", got.data]


def test_wait_for_any_validates_with_the_declared_models() -> None:
    env = Harness(app)
    run_id = env.start(either)
    env.publish_event(run_id, "reply", {"text": "typo"})  # past the client: the engine refuses
    env.run_until_idle(skip_time=False)
    [waiting] = kinds(env, run_id, h.EVENT_WAITING)
    assert waiting.data["models"] == {"reply": f"{__name__}:Reply"}
    assert any("1 refused" in line for line in env.status(run_id).waiting_for)
    env.send_event(run_id, "reply", {"text": "yes", "accepted": True})
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == ["reply", "yes"]


def test_an_event_sent_with_the_start_is_checked_against_the_declaration() -> None:
    env = Harness(app)
    with pytest.raises(sagaloop.ValidationError, match="accepted"):
        env.client.start(declared, run_id="with-event", event=("reply", {"text": "typo"}))
    assert env.store.get_run("with-event") is None, "nothing was written"
    env.client.start(declared, run_id="with-event", event=("go", None))
    env.send_event("with-event", "reply", {"text": "yes", "accepted": True})
    env.run_until_idle(skip_time=False)
    assert env.result("with-event") == "yes"
