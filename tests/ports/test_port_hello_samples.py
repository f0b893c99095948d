"""Ports of Temporal's one-file ``hello`` samples that show one primitive each: activity retry,
an exception, parallel activities, continue-as-new, a query, an update, a local activity and
a heartbeating activity, written as the samples write them (``asyncio.sleep`` and
``asyncio.gather`` in the workflow included).

Original: github.com/temporalio/samples-python, ``hello/hello_activity_retry.py``,
``hello_exception.py``, ``hello_parallel_activity.py``, ``hello_continue_as_new.py``,
``hello_query.py`` (tested by ``tests/hello/hello_query_test.py``), ``hello_update.py``
(``tests/hello/hello_update_test.py``), ``hello_local_activity.py`` and
``hello_activity_heartbeat.py``; the samples without a test of their own are checked against
what their ``main()`` prints.

What maps to what:

- ``@activity.defn`` -> ``@app.step``; ``activity.info().attempt`` -> ``StepContext.attempt``;
  ``activity.heartbeat()`` -> ``StepContext.heartbeat()``; ``heartbeat_timeout`` and
  ``start_to_close_timeout`` -> ``@app.step(heartbeat_timeout=, timeout=)``;
  ``execute_local_activity`` -> a step declared ``local=True``;
- ``RetryPolicy(maximum_interval=..., maximum_attempts=...)`` -> ``RetryPolicy(
  maximum_interval=..., max_attempts=...)``;
- ``workflow.execute_activity`` -> ``ctx.call``; ``asyncio.gather`` of them -> the same;
- ``asyncio.sleep`` in the workflow -> the same: a durable timer;
- ``workflow.continue_as_new(x)`` -> ``ctx.continue_as_new(x)``;
- ``@workflow.query`` over the object's state -> ``ctx.publish`` + ``@query``;
- ``@workflow.update`` -> ``ctx.on_update``; ``handle.describe().status`` -> ``Client.get``;
- ``WorkflowFailureError`` whose cause is the ``ActivityError`` -> ``SagaFailedError``
  from ``Harness.result`` with the run's error naming the step and its error.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest

from sagaloop import App, RetryPolicy, SagaContext, SagaFailedError, StepContext
from sagaloop.client import RunView, query
from sagaloop.testing import Harness, replay

app = App("port-hello-samples")


@dataclasses.dataclass
class ComposeGreetingInput:
    greeting: str
    name: str


# --- hello_activity_retry.py -------------------------------------------------------------------


@app.step(
    timeout=timedelta(seconds=10),
    retry=RetryPolicy(maximum_interval=timedelta(seconds=2), max_attempts=None),
)
def compose_greeting_retried(ctx: StepContext, input: ComposeGreetingInput) -> str:
    print(f"Invoking activity, attempt number {ctx.attempt}")
    if ctx.attempt < 4:
        raise RuntimeError("Intentional failure")
    return f"{input.greeting}, {input.name}!"


@app.saga(name="hello-activity-retry")
async def activity_retry(ctx: SagaContext, name: str) -> str:
    return await ctx.call(compose_greeting_retried, ComposeGreetingInput("Hello", name))


def test_hello_activity_retry() -> None:
    env = Harness(app)
    run_id = env.start(activity_retry, "World")
    env.run_until_idle()
    assert env.result(run_id) == "Hello, World!"
    attempts = [e for e in env.history(run_id) if e.kind == "step_retrying"]
    assert len(attempts) == 3  # failed three times, then succeeded on the fourth


# --- hello_exception.py ------------------------------------------------------------------------


@app.step(timeout=timedelta(seconds=10), retry=RetryPolicy(max_attempts=2))
def compose_greeting_failing(ctx: StepContext, input: ComposeGreetingInput) -> str:
    raise RuntimeError(f"Greeting exception: {input.greeting}, {input.name}!")


@app.saga(name="hello-exception")
async def exception(ctx: SagaContext, name: str) -> str:
    return await ctx.call(compose_greeting_failing, ComposeGreetingInput("Hello", name))


def test_hello_exception() -> None:
    env = Harness(app)
    run_id = env.start(exception, "World")
    env.run_until_idle()
    with pytest.raises(SagaFailedError) as failure:
        env.result(run_id)
    error = failure.value.error
    assert error.step == "compose_greeting_failing"
    assert "Greeting exception: Hello, World!" in str(error.root_cause.message)
    tried = [e for e in env.history(run_id) if e.kind in ("step_retrying", "step_failed")]
    assert len(tried) == 2  # maximum_attempts=2


# --- hello_parallel_activity.py ----------------------------------------------------------------


@app.step(timeout=timedelta(seconds=5))
def say_hello_activity(ctx: StepContext, name: str) -> str:
    return f"Hello, {name}!"


@app.saga(name="hello-parallel-activity")
async def parallel_activity(ctx: SagaContext) -> list[str]:
    results = await asyncio.gather(
        ctx.call(say_hello_activity, "user1"),
        ctx.call(say_hello_activity, "user2"),
        ctx.call(say_hello_activity, "user3"),
        ctx.call(say_hello_activity, "user4"),
        ctx.call(say_hello_activity, "user5"),
    )
    return list(sorted(results))


@pytest.mark.parametrize("cache", [False, True], ids=["replay", "cache"])
def test_hello_parallel_activity(cache: bool) -> None:
    env = Harness(app, cache=cache)
    run_id = env.start(parallel_activity)
    env.run_until_idle()
    assert env.result(run_id) == [f"Hello, user{i}!" for i in range(1, 6)]
    scheduled = [e.seq for e in env.history(run_id) if e.kind == "step_scheduled"]
    completed = [e.seq for e in env.history(run_id) if e.kind == "step_completed"]
    assert len(scheduled) == 5 and max(scheduled) < min(completed)  # all five at once


# --- hello_continue_as_new.py ------------------------------------------------------------------


@app.saga(name="hello-continue-as-new")
async def looping(ctx: SagaContext, iteration: int) -> None:
    if iteration == 10:
        return
    ctx.logger.info("Running workflow iteration %s", iteration)
    await asyncio.sleep(1)
    ctx.continue_as_new(iteration + 1)


def test_hello_continue_as_new() -> None:
    env = Harness(app)
    began = env.clock.now()
    run_id = env.start(looping, 0)
    env.run_until_idle()
    assert env.result(run_id) is None
    history = env.history(run_id)
    assert history[0].data["input"] == 10  # the last history only
    assert env.clock.now() - began >= timedelta(seconds=10)  # ten durable one-second sleeps


# --- hello_query.py ----------------------------------------------------------------------------


@app.saga(name="hello-query")
async def greeting_query(ctx: SagaContext, name: str) -> None:
    ctx.publish("greeting", f"Hello, {name}!")
    await asyncio.sleep(2)
    ctx.publish("greeting", f"Goodbye, {name}!")


@query(greeting_query)
def greeting(run: RunView) -> str:
    return str(run.published.get("greeting", "<no greeting>"))


def test_query_workflow() -> None:
    env = Harness(app)
    run_id = env.start(greeting_query, "World")
    env.run_until_idle(skip_time=False)
    assert env.query(run_id, greeting) == "Hello, World!"
    env.advance(timedelta(seconds=3))  # manually skip 3 seconds
    env.run_until_idle(skip_time=False)
    assert env.query(run_id, greeting) == "Goodbye, World!"


# --- hello_update.py ---------------------------------------------------------------------------


@app.saga(name="hello-update")
async def greeting_update(ctx: SagaContext) -> str:
    is_complete = False

    async def update_workflow_status(_: object) -> str:
        nonlocal is_complete
        is_complete = True
        return "Workflow status updated"

    ctx.on_update("update_workflow_status", update_workflow_status)
    await ctx.wait_condition(lambda: is_complete)
    return "Hello, World!"


def test_update_workflow() -> None:
    env = Harness(app)
    run_id = env.start(greeting_update)
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"  # RUNNING: a run that waits holds nothing
    assert env.update(run_id, "update_workflow_status") == "Workflow status updated"
    env.run_until_idle()
    assert env.result(run_id) == "Hello, World!"
    assert env.get(run_id).status == "completed"


# --- hello_local_activity.py -------------------------------------------------------------------


@app.step(local=True, timeout=timedelta(seconds=10))
def compose_greeting_local(ctx: StepContext, input: ComposeGreetingInput) -> str:
    return f"{input.greeting}, {input.name}!"


@app.saga(name="hello-local-activity")
async def local_activity(ctx: SagaContext, name: str) -> str:
    return await ctx.call(compose_greeting_local, ComposeGreetingInput("Hello", name))


def test_hello_local_activity() -> None:
    env = Harness(app)
    run_id = env.start(local_activity, "World")
    env.run_until_idle()
    assert env.result(run_id) == "Hello, World!"


# --- hello_activity_heartbeat.py ---------------------------------------------------------------


@app.step(timeout=timedelta(seconds=10), heartbeat_timeout=timedelta(seconds=2))
def compose_greeting_heartbeat(ctx: StepContext, input: ComposeGreetingInput) -> str:
    for _ in range(0, 3):
        print("Heartbeating activity")
        ctx.heartbeat()  # the sample sleeps a second between heartbeats: not here
    return f"{input.greeting}, {input.name}!"


@app.saga(name="hello-activity-heartbeat")
async def activity_heartbeat(ctx: SagaContext, name: str) -> str:
    return await ctx.call(compose_greeting_heartbeat, ComposeGreetingInput("Hello", name))


def test_hello_activity_heartbeat() -> None:
    env = Harness(app)
    run_id = env.start(activity_heartbeat, "World")
    env.run_until_idle()
    assert env.result(run_id) == "Hello, World!"
    replay(app, env.history(run_id), run_id=run_id)
