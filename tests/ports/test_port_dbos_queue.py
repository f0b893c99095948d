"""Port of DBOS queues: the documentation's queue example and the SDK's child-workflow queue test.

Originals:

- github.com/dbos-inc/dbos-docs, ``docs/python/tutorials/queue-tutorial.md`` ("Queue Example"
  and "Managing Concurrency"): ``queue = Queue("example_queue", concurrency=10)``; a workflow
  ``process_tasks(tasks)`` enqueues ``process_task`` for each task and returns ``[handle.
  get_result() for handle in task_handles]``; "at most 10 tasks submitted to it may run at
  once". Its assertions here: the results are the tasks' results in the tasks' order, and no
  more than 10 run at once (with more than 10 tasks, 10 do).
- github.com/dbos-inc/dbos-transact-py, commit c560d0b7ba895ad85d8207d1be5384b67f318c26,
  ``tests/test_queue.py::test_queue_childwf``: ``Queue("child_queue", 3)``; a workflow enqueues
  four child workflows that each wait for a ``release`` message (``DBOS.recv("release", 30)``),
  sleeps 1 s, asserts that the fourth is still ``ENQUEUED``, sends each child ``release`` and
  returns their results joined: ``"adbdadbd"``.

What maps to what:

- ``Queue(name, concurrency=N)`` -> ``Concurrency(limit=N)`` on the enqueued saga (one key:
  the saga's runs are the queue's);
- ``queue.enqueue(workflow, arg)`` from a workflow -> ``ctx.call(saga, arg)`` of that limited
  saga, awaited later: ``asyncio.ensure_future`` (or ``asyncio.gather``); ``handle.
  get_result()`` -> awaiting it; ``handle.get_workflow_id()`` -> the child's ``run_id``, given;
- ``DBOS.recv(topic, timeout)`` / ``DBOS.send(id, message, topic)`` -> ``ctx.wait_for_event(
  topic, timeout=...)`` / ``ctx.send_event(id, topic, message)``; ``DBOS.sleep`` ->
  ``ctx.sleep``;
- ``wfh4.get_status().status == "ENQUEUED"`` is asserted inside the workflow in the original;
  saga code reads no other run's status, so the test asserts it while the parent sleeps: the
  child run is recorded, its code not started (``processed_seq == 0``), and its status says it
  is queued.

Not ported: ``test_one_at_a_time`` enqueues two different workflows on one queue of
concurrency 1; sagaloop's limits are per saga (a queue shared by several sagas has no
equivalent).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from sagaloop import App, SagaContext, StepContext
from sagaloop.sagas.concurrency import Concurrency
from sagaloop.testing import Harness

# --- the docs' queue example --------------------------------------------------------------

app = App("port-dbos-queue")
CONCURRENCY = 10
queue = Concurrency(limit=CONCURRENCY)  # Queue("example_queue", concurrency=10)


@app.step()
def work(ctx: StepContext, task: int) -> int:
    return task * task


@app.saga(name="process_task", concurrency=queue)
async def process_task(ctx: SagaContext, task: int) -> int:
    return await ctx.call(work, task)


@app.saga(name="process_tasks")
async def process_tasks(ctx: SagaContext, tasks: list[int]) -> list[int]:
    task_handles = []
    # Enqueue each task so all tasks are processed concurrently.
    for task in tasks:
        handle = asyncio.ensure_future(ctx.call(process_task, task))
        task_handles.append(handle)
    # Wait for each task to complete and retrieve its result.
    # Return the results of all tasks.
    return [await handle for handle in task_handles]


def running_tasks(env: Harness) -> int:
    """The runs of process_task whose code runs: started, not ended."""
    runs = env.store.list_runs(saga="process_task", status="running", limit=1000)
    return sum(1 for r in runs if r.processed_seq > 0)


def test_process_tasks_runs_at_most_ten_at_once_and_returns_results_in_order() -> None:
    env = Harness(app)
    seen: list[int] = []

    def observed(ctx: StepContext, task: int) -> int:
        seen.append(running_tasks(env))  # how many tasks run while this one works
        return task * task

    tasks = list(range(25))
    with env.override(work, observed):
        run_id = env.start(process_tasks, tasks)
        env.run_until_idle()
    assert env.result(run_id) == [t * t for t in tasks]
    assert len(seen) == len(tasks)
    assert max(seen) == CONCURRENCY  # at most 10 at once, and 10 did run at once


# --- dbos-transact-py tests/test_queue.py::test_queue_childwf -------------------------------

children = App("port-dbos-queue-childwf")
RECV_TIMEOUT = timedelta(seconds=30)


@children.saga(name="test_child_wf", concurrency=Concurrency(limit=3))  # Queue("child_queue", 3)
async def test_child_wf(ctx: SagaContext, val: str) -> str:
    await ctx.wait_for_event("release", timeout=RECV_TIMEOUT)
    return val + "d"


@children.saga(name="test_workflow")
async def test_workflow(ctx: SagaContext, vars: list[str]) -> str:
    var1, var2 = vars
    ids = [f"{ctx.run_id}-child-{i}" for i in range(1, 5)]
    wfh1 = asyncio.ensure_future(ctx.call(test_child_wf, var1, run_id=ids[0]))
    wfh2 = asyncio.ensure_future(ctx.call(test_child_wf, var2, run_id=ids[1]))
    wfh3 = asyncio.ensure_future(ctx.call(test_child_wf, var1, run_id=ids[2]))
    wfh4 = asyncio.ensure_future(ctx.call(test_child_wf, var2, run_id=ids[3]))

    await ctx.sleep(timedelta(seconds=1))
    # (the original asserts here that wfh4 is ENQUEUED: the test does, see below)

    for child in ids:
        ctx.send_event(child, "release", "go")

    return (await wfh1) + (await wfh2) + (await wfh3) + (await wfh4)


def test_queue_childwf() -> None:
    env = Harness(children)
    run_id = env.start(test_workflow, ["a", "b"])
    env.run_until_idle(skip_time=False)  # the parent sleeps its 1 s
    fourth = env.get(f"{run_id}-child-4")
    assert fourth.status == "running" and fourth.processed_seq == 0  # ENQUEUED
    assert "queued behind 3 runs" in env.status(fourth.run_id).waiting_for[0]
    assert all(env.get(f"{run_id}-child-{i}").processed_seq > 0 for i in (1, 2, 3))
    env.run_until_idle()
    assert env.result(run_id) == "adbdadbd"
