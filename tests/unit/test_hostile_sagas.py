"""Hostile saga code and unlucky messages on the engine side: a saga that never yields, saga
code raising BaseExceptions or starting threads, an output that cannot be stored, awaits that
lost a race, a start the engine refuses, and a message that fails every time. Each is turned
into a recorded outcome (failed, parked with the reason, rejected); none spins or stops the
engine, and other runs go on."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import pytest

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope, engine_queue
from sagaloop.testing.harness import Harness

app = App("hostile-sagas")
undone: list[str] = []


@app.step()
def hello(ctx: StepContext, name: str) -> str:
    return f"hello {name}"


@hello.compensation
def unhello(ctx: StepContext, name: str, result: str) -> None:
    undone.append(name)


@app.saga(name="greet")
async def greet(ctx: SagaContext, name: str) -> str:
    return await ctx.call(hello, name)


@app.saga(name="spin")
async def spin(ctx: SagaContext, name: str) -> str:
    await ctx.call(hello, name)
    n = 0
    while True:  # never yields: the activation deadline stops it
        n += 1


RAISES: dict[str, BaseException] = {
    "KeyboardInterrupt": KeyboardInterrupt(),
    "SystemExit": SystemExit(3),
    "CancelledError": asyncio.CancelledError(),
    "GeneratorExit": GeneratorExit(),
}


@app.saga(name="raise")
async def raise_(ctx: SagaContext, kind: str) -> str:
    await ctx.call(hello, kind)
    raise RAISES[kind]


@app.saga(name="thread")
async def thread(ctx: SagaContext) -> str:
    threading.Thread(target=lambda: None).start()
    return "started a thread"


@app.saga(name="unstorable")
async def unstorable(ctx: SagaContext, kind: str) -> Any:
    await ctx.call(hello, kind)
    return {"surrogate": "cut mid-emoji \ud83d", "digits": 10**5000}[kind]


@app.saga(name="race")
async def race(ctx: SagaContext) -> list[str]:
    """Waits for "a", "b", a timer or a step, whichever comes first, and cancels the losers,
    as code written for asyncio does; the losers' event, timer and result arrive later."""
    racers = {
        asyncio.ensure_future(ctx.wait_for_event("a")): "a",
        asyncio.ensure_future(ctx.wait_for_event("b")): "b",
        asyncio.ensure_future(ctx.sleep(timedelta(hours=1))): "timer",
        asyncio.ensure_future(ctx.call(hello, "racer")): "call",
    }
    done, losers = await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
    for loser in losers:
        loser.cancel()
    seen = [racers[d] for d in done]
    seen.append(await ctx.call(hello, "after"))
    seen.append(f"b={await ctx.wait_for_event('b')}")
    return seen


@app.saga(name="waiter")
async def waiter(ctx: SagaContext) -> Any:
    return await ctx.wait_for_event("a")


@pytest.fixture
def env() -> Harness:
    undone.clear()
    harness = Harness(app)
    harness.engine.watchdog.deadline = 0.3
    return harness


def parked(env: Harness, run_id: str) -> list[Any]:
    return [e for e in env.history(run_id) if e.kind == h.RUN_PARKED]


def test_a_saga_that_never_yields_is_parked_with_its_stack_and_the_engine_goes_on(
    env: Harness,
) -> None:
    stuck = env.start(spin, "spinner")
    env.run_until_idle()
    run = env.get(stuck)
    assert run.status == "needs_attention"
    assert run.reason and "without yielding" in run.reason
    [event] = parked(env, stuck)
    assert "in spin" in event.data["stack"] and "engine" not in event.data["stack"]

    ok = env.start(greet, "neighbour")  # the engine goes on
    env.run_until_idle()
    assert env.result(ok) == "hello neighbour"

    env.retry(stuck)  # the same code spins again: parked again, not lost
    env.run_until_idle()
    assert env.get(stuck).status == "needs_attention"
    assert len(parked(env, stuck)) == 2

    env.cancel(stuck)  # an operator gives up: its completed step is undone
    env.run_until_idle()
    assert env.get(stuck).status == "cancelled"
    assert undone == ["spinner"]


@pytest.mark.parametrize("kind", sorted(RAISES))
def test_a_base_exception_from_saga_code_fails_the_run(env: Harness, kind: str) -> None:
    run_id = env.start(raise_, kind)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "compensated", run
    assert run.error is not None
    assert run.error["type"] in (kind, "CancelledError"), run.error
    assert undone == [kind]
    after = env.start(greet, "next")  # the engine goes on
    env.run_until_idle()
    assert env.result(after) == "hello next"


def test_a_thread_started_in_saga_code_is_refused(env: Harness) -> None:
    run_id = env.start(thread)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert run.error is not None and run.error["type"] == "SagaDeterminismViolation"
    assert "thread" in run.error["message"]
    # threads elsewhere in the process are not affected
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()


@pytest.mark.parametrize("kind", ["surrogate", "digits"])
def test_a_saga_output_that_cannot_be_stored_fails_the_run_once(env: Harness, kind: str) -> None:
    run_id = env.start(unstorable, kind)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "compensated", run
    assert run.error is not None and "unstorable" in run.error["message"]
    assert undone == [kind]


def test_awaits_that_lost_a_race_do_not_break_later_events_timers_or_results(
    env: Harness,
) -> None:
    run_id = env.start(race)
    env.queues = [engine_queue(app.name)]  # hold the step back: "a" wins the race
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "a", 1)
    env.run_until_idle(skip_time=False)
    env.queues = None
    env.run_until_idle()  # the lost call's result and the lost sleep's timer: stale
    env.send_event(run_id, "b", 2)  # for the wait after the race, not the cancelled one
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "completed", env.status(run_id).to_json()
    assert run.output == ["a", "hello after", "b=2"], run.output
    assert not env.store.dead_letters()


def publish(env: Harness, body: dict[str, Any]) -> None:
    env.broker.publish([(engine_queue(app.name), Envelope(**body).to_bytes())])


def test_a_start_the_engine_refuses_fails_its_run_with_the_reason(env: Harness) -> None:
    publish(env, {"type": "start", "run_id": "bad-input", "saga": "greet", "payload": {"input": 7}})
    publish(env, {"type": "start", "run_id": "no-saga", "saga": "nope", "payload": {"input": 1}})
    env.run_until_idle()
    for run_id, words in [("bad-input", "input of saga 'greet'"), ("no-saga", "unknown saga")]:
        run = env.get(run_id)
        assert run.status == "failed", run
        assert run.error is not None and words in run.error["message"], run.error
    reasons = [reason for _, _, reason in env.store.dead_letters()]
    assert len(reasons) == 2, reasons  # and still dead-lettered, with the reason


def test_a_client_created_run_whose_start_is_refused_fails_instead_of_staying_running(
    env: Harness,
) -> None:
    """A Client without the saga's code cannot validate the input: the engine refuses it."""
    from sagaloop import Client

    client = Client(env.store, app.name, clock=env.clock)
    run_id = client.start("greet", {"not": "a string"})
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert run.error is not None and run.error["type"] == "RejectedStart"


def test_a_refused_start_for_an_existing_run_leaves_that_run_alone(env: Harness) -> None:
    run_id = env.start(greet, "victim")
    env.run_until_idle()
    publish(env, {"type": "start", "run_id": run_id, "saga": "greet", "payload": {"input": 7}})
    env.run_until_idle()
    assert env.result(run_id) == "hello victim"


def test_a_message_that_fails_every_time_parks_its_run_and_retry_processes_it_again(
    env: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mechanism behind "no message spins": a bug that fails every activation of one
    message (here injected into the engine) parks the run after 5 tries, with the error and
    the message kept; once the bug is fixed, `retry` processes the kept message."""
    from sagaloop.engine import intake

    run_id = env.start(waiter)
    env.run_until_idle()
    tries: list[str] = []

    fixed = intake.triggers

    def bug(env_: Envelope, *args: Any) -> Any:
        if env_.type != "event":
            return fixed(env_, *args)
        tries.append(env_.message_id)
        raise RuntimeError("a bug in the engine")

    monkeypatch.setattr(intake, "triggers", bug)
    env.send_event(run_id, "a", "first")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "needs_attention", run
    assert len(tries) == 5 and len(set(tries)) == 1
    [event] = parked(env, run_id)
    assert "5 times" in event.data["reason"] and "a bug in the engine" in event.data["reason"]
    assert event.data["message"]["type"] == "event"
    assert not env.store.dead_letters()

    monkeypatch.setattr(intake, "triggers", fixed)
    env.retry(run_id)
    env.run_until_idle()
    assert env.result(run_id) == "first"
