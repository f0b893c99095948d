"""Child runs: `await ctx.call(saga, input)` runs a saga of the app as a child run whose id
derives from the parent's, returns its output, raises its failure as StepFailedError, is
cancelled with its parent, and is never started twice by a replay."""

from __future__ import annotations

from typing import Any

import pytest

from sagaloop import App, ApplicationError, SagaContext, StepContext, StepFailedError
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope, derived_id, engine_queue
from sagaloop.testing import Harness

app = App("children")
effects: list[str] = []


@app.step()
def compose(ctx: StepContext, greeting: str, name: str) -> str:
    effects.append(name)
    if name == "nobody":
        raise ApplicationError("no such person", type="Unknown", non_retryable=True)
    return f"{greeting}, {name}!"


@app.saga(name="greeting-child")
async def greeting_child(ctx: SagaContext, name: str) -> str:
    return await ctx.call(compose, "Hello", name)


@app.saga(name="greeting-parent")
async def greeting_parent(ctx: SagaContext, name: str) -> str:
    return await ctx.call(greeting_child, name)


@app.saga(name="guarded")
async def guarded(ctx: SagaContext, name: str) -> dict[str, Any]:
    try:
        return {"ok": await ctx.call(greeting_child, name, run_id=f"{ctx.run_id}:child")}
    except StepFailedError as e:
        return {"failed": e.error.type, "message": e.error.message}


@app.saga(name="waiting-child")
async def waiting_child(ctx: SagaContext) -> Any:
    return await ctx.wait_for_event("never")


@app.saga(name="waiting-parent")
async def waiting_parent(ctx: SagaContext) -> Any:
    return await ctx.call(waiting_child)


def test_the_child_returns_its_output_to_the_parent_like_temporals_hello_child() -> None:
    effects.clear()
    env = Harness(app)
    run_id = env.start(greeting_parent, "World")
    for _ in range(100):  # one message at a time, restarting in between: replays
        if not env.step_once():
            break
        env.restart()
    env.run_until_idle()
    assert env.result(run_id) == "Hello, World!"
    child = derived_id("child", run_id, 0)
    assert env.get(child).status == "completed"
    assert effects == ["World"]  # one child, one effect, whatever the replays
    assert [e.kind for e in env.history(run_id)].count(h.CHILD_STARTED) == 1


def test_a_failed_child_is_the_parents_step_failed_error() -> None:
    env = Harness(app)
    run_id = env.start(guarded, "nobody")
    env.run_until_idle()
    out = env.result(run_id)
    assert out["failed"] == "StepFailedError", out  # the child's own uncaught error
    assert f"child run '{run_id}:child' failed" in out["message"]
    assert "Unknown: no such person" in out["message"]
    assert env.get(f"{run_id}:child").status == "failed"


def test_cancelling_the_parent_cancels_its_child() -> None:
    env = Harness(app)
    run_id = env.start(waiting_parent)
    env.run_until_idle()
    child = derived_id("child", run_id, 0)
    assert env.get(child).status == "waiting"
    env.cancel(run_id)
    env.run_until_idle()
    assert env.get(run_id).status == "cancelled"
    assert env.get(child).status == "cancelled"


def test_a_child_run_id_taken_by_another_run_fails_the_call_instead_of_adopting_it() -> None:
    """A publisher who may start runs pre-starts a run under the id the child will have: the
    parent must not take that run's output as its child's."""
    env = Harness(app)
    run_id = "victim"
    squat = Envelope(
        type="start", run_id="victim:child", saga="greeting-child", payload={"input": "attacker"}
    )
    env.broker.publish([(engine_queue(app.name), squat.to_bytes())])
    env.run_until_idle()
    env.start(guarded, "Ada", run_id=run_id)
    env.run_until_idle()
    out = env.result(run_id)
    assert out["failed"] == "ChildRunIdTaken", out
    assert env.result("victim:child") == "Hello, attacker!"


@pytest.mark.parametrize("bad", ["not-a-saga", 42])
def test_calling_something_that_is_neither_step_nor_saga_fails_the_run(bad: Any) -> None:
    odd = App("odd")

    @odd.saga(name="s")
    async def s(ctx: SagaContext) -> Any:
        return await ctx.call(bad)

    env = Harness(odd)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.get(run_id).status == "failed"


trips = App("child-compensation")
undone: list[str] = []


@trips.step()
def reserve(ctx: StepContext, what: str) -> str:
    if what == "boom":
        raise ApplicationError("sold out", type="SoldOut", non_retryable=True)
    return f"{what}-ref"


@reserve.compensation
def release(ctx: StepContext, what: str, ref: str) -> None:
    undone.append(ref)


@trips.saga(name="leg")
async def leg(ctx: SagaContext, places: list[str]) -> list[str]:
    return [await ctx.call(reserve, p) for p in places]


@trips.saga(name="journey")
async def journey(ctx: SagaContext, last: str) -> list[Any]:
    first = await ctx.call(leg, ["car", "hotel"])  # a child run, completed
    await ctx.call(reserve, "lounge")
    second = await ctx.call(leg, ["train"])
    await ctx.call(reserve, last)  # "boom" fails the journey: everything is undone
    return [first, second]


def test_a_completed_child_is_undone_as_a_whole_when_its_parent_compensates() -> None:
    undone.clear()
    env = Harness(trips)
    run_id = env.start(journey, "boom")
    env.run_until_idle()
    assert env.get(run_id).status == "compensated"
    # newest first: the second child (train), the lounge, the first child (hotel, then car)
    assert undone == ["train-ref", "lounge-ref", "hotel-ref", "car-ref"]
    for pos in (0, 2):
        assert env.get(derived_id("child", run_id, pos)).status == "compensated"


def test_a_child_is_undone_only_by_its_parent() -> None:
    undone.clear()
    env = Harness(trips)
    run_id = env.start(journey, "plane")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    child = derived_id("child", run_id, 0)
    forged = Envelope(type="undo_run", run_id=child, payload={"parent": "x", "position": 0})
    env.broker.publish_raw(  # type: ignore[attr-defined]
        engine_queue(trips.name), forged.to_bytes(), trusted=True
    )
    env.run_until_idle()
    assert env.get(child).status == "completed" and undone == []
