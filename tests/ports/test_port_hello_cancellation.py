"""Port of Temporal's hello cancellation sample.

Original: github.com/temporalio/samples-python, commit e652a4d0e85042a34ec8fc46a4a03e51681fd7f9,
``hello/hello_cancellation.py`` (``CancellationWorkflow``), tested by
``tests/hello/hello_cancellation_test.py`` (``test_cancel_workflow``).

What maps to what:

- ``never_complete_activity`` -> the step ``never_complete``, declared with
  ``heartbeat_timeout=2 s`` and ``timeout=1000 s`` (the activity's ``start_to_close_timeout``);
  ``activity.heartbeat()`` -> ``ctx.heartbeat()``; Temporal's ``CancelledError`` raised by the
  heartbeat -> ``StepCancelled`` (the cancel delivered into the saga code cancelled its await
  of the step, so its next heartbeat stops it);
- the workflow's ``try: execute_activity(never_complete) finally:
  execute_activity(cleanup_activity)`` -> the same ``try``/``finally`` with ``ctx.call``: a
  cancel raises ``asyncio.CancelledError`` at the saga's await, its ``finally`` calls the step
  ``cleanup_activity`` (within the saga's ``cancel_grace``), and the error it re-raises ends the
  run cancelled;
- ``handle.cancel()`` -> ``Client.cancel``; ``WorkflowFailureError`` whose cause is a
  ``CancelledError`` -> ``SagaFailedError`` with status ``cancelled``;
  ``WorkflowExecutionStatus.CANCELED`` -> status ``cancelled``;
- ``wait_for_activity_to_start`` (polling ``describe().pending_activities``) -> polling
  ``Client.status(run_id).steps`` until the step's attempt runs;
- the worker, with its thread pool of activities, running while the test cancels -> the
  harness driven from a thread of its own (``test_cancel_workflow``: the harness takes a
  cancel made while it runs a step at once, so the step's heartbeat raises) or, in
  ``test_cancel_workflow_with_a_running_engine_and_worker``, an engine and a worker running on
  threads beside the test (``Runtime`` on a SQLite file).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from sagaloop import (
    App,
    Client,
    RetryPolicy,
    SagaContext,
    SagaFailedError,
    StepCancelled,
    StepContext,
)
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine import history as h
from sagaloop.runtime.service import Runtime
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness, eventually

app = App("port-hello-cancellation")
seen: list[str] = []
running = threading.Event()
give_up = threading.Event()  # ends the never-completing step if the test fails


@app.step(timeout=timedelta(seconds=1000), heartbeat_timeout=timedelta(seconds=2))
def never_complete(ctx: StepContext) -> None:
    # All long-running steps should heartbeat: it is how cancellation reaches them.
    try:
        while not give_up.is_set():
            running.set()
            ctx.heartbeat()
            time.sleep(0.02)
        raise RuntimeError("the test gave up: the step was never cancelled")
    except StepCancelled:
        seen.append("activity cancelled")
        raise


@app.step(timeout=timedelta(seconds=5))
def cleanup_activity(ctx: StepContext) -> None:
    seen.append("cleanup")


@app.saga(name="cancellation")
async def cancellation_workflow(ctx: SagaContext) -> None:
    try:
        await ctx.call(never_complete)
    finally:
        await ctx.call(cleanup_activity)


def test_cancel_workflow() -> None:
    seen.clear()
    running.clear()
    give_up.clear()
    env = Harness(app)
    run_id = env.start(cancellation_workflow)
    worker = threading.Thread(target=env.run_until_idle, name="port-worker", daemon=True)
    worker.start()
    try:
        assert running.wait(5), "the step never started"
        env.cancel(run_id)
        worker.join(60)
        assert not worker.is_alive(), "the cancellation never reached the running step"
    finally:
        give_up.set()
        worker.join(5)

    with pytest.raises(SagaFailedError) as err:
        env.result(run_id)
    assert err.value.status == "cancelled"
    assert env.get(run_id).status == "cancelled"
    assert seen == ["activity cancelled", "cleanup"]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    """An engine and a worker on their own threads, as ``sagaloop dev`` runs them."""
    store = SqlStore(f"sqlite:///{tmp_path / 'cancellation.db'}")
    store.upgrade()
    broker = DatabaseBroker(store, lease=timedelta(seconds=2), poll_interval=0.02)
    runtime = Runtime(app, store, broker, poll=0.02, heartbeat=0.5, concurrency=2).start()
    try:
        yield Client(store, app)
    finally:
        give_up.set()
        runtime.stop()
        store.close()


def test_cancel_workflow_with_a_running_engine_and_worker(client: Client) -> None:
    """The same test, against an engine and a worker running beside the test (as Temporal's
    worker runs beside its test), instead of the harness."""
    seen.clear()
    running.clear()
    give_up.clear()
    run_id = client.start(cancellation_workflow)

    def has_step_started() -> bool:
        return any(line.step == "never_complete" for line in client.status(run_id).steps)

    eventually(has_step_started, timeout=5, what="the step to start")
    assert running.wait(5)
    client.cancel(run_id)

    with pytest.raises(SagaFailedError) as err:
        client.result(run_id, timeout=10)
    assert err.value.status == "cancelled"
    assert client.get(run_id).status == "cancelled"
    # the cleanup and the cancelled step's last heartbeat run on two worker threads
    assert sorted(seen) == ["activity cancelled", "cleanup"]


# Found while porting: not part of the original.

flaky_attempts: list[int] = []


@app.step(retry=RetryPolicy(max_attempts=5, initial_interval=timedelta(seconds=1)))
def flaky(ctx: StepContext) -> None:
    flaky_attempts.append(ctx.attempt)
    raise ConnectionError("the service is down")


@app.saga(name="flaky")
async def flaky_saga(ctx: SagaContext) -> None:
    await ctx.call(flaky)


def test_a_cancelled_run_starts_no_new_attempt_of_its_steps() -> None:
    flaky_attempts.clear()
    env = Harness(app)
    run_id = env.start(flaky_saga)
    env.step_once()  # the start: the step is scheduled, its message queued for a worker
    env.cancel(run_id)
    env.run_until_idle()
    assert env.get(run_id).status == "cancelled"
    kinds = [e.kind for e in env.history(run_id)]
    assert h.STEP_RETRYING not in kinds[kinds.index(h.CANCEL_REQUESTED) :], kinds
    assert flaky_attempts == [1]
