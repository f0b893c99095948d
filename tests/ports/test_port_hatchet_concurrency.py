"""Port of Hatchet's concurrency examples: ``CANCEL_IN_PROGRESS`` and ``GROUP_ROUND_ROBIN``.

Originals (github.com/hatchet-dev/hatchet):

- ``sdks/python/examples/concurrency_cancel_in_progress/worker.py`` (commit
  2c61ea919f7620998a83c9a8cdefec97acc5efe9) and its ``test_concurrency_cancel_in_progress.py``
  (commit 2d412dd2565bafb8271ad8492f28c3b2354f33ea): ``ConcurrencyExpression(expression=
  "input.group", max_runs=1, limit_strategy=CANCEL_IN_PROGRESS)``, two tasks of 5 s each; the
  test starts ten runs of group A, one a second, and asserts that the last completes and the
  nine others are cancelled.
- ``sdks/python/examples/concurrency_limit_rr/worker.py`` (commit
  00448a3bd5d1908227d1b910150e2a6d354ad5be) and its ``test_concurrency_limit_rr.py`` (commit
  46edb1f0b0d84d3f5838d181850883a125dc5f40): ``max_runs=1`` per ``input.group`` with
  ``GROUP_ROUND_ROBIN``, a task of 2 s; two runs in each of two groups; the test asserts 4
  successful runs, none cancelled, and a total time between 3.8 and 7 s (about 4: each group's
  two runs one after the other, the groups side by side). Upstream skips it ("the timing for
  this test is not reliable"); on the harness's virtual clock it is exact. Its runs are started
  without an input (``run_no_wait()``) though the workflow validates ``group``: here the loop's
  ``i`` is the group, two runs each, as the loop means.

What maps to what:

- ``ConcurrencyExpression(expression="input.group", max_runs=N, limit_strategy=...)`` ->
  ``Concurrency(limit=N, key=lambda input: input.group, at_limit=...)``: ``CANCEL_IN_PROGRESS``
  -> ``"cancel_in_progress"``; ``GROUP_ROUND_ROBIN`` -> ``"queue"`` (per-key queues in start
  order: a group's runs wait for its slot, other groups' runs do not wait for them);
- the workflow's tasks, which only pass time (``asyncio.sleep``/``time.sleep``) -> durable
  sleeps of the same length in the saga (``ctx.sleep``), so that time is the virtual clock's;
  ``parents=[step1]`` -> one after the other;
- ``aio_run(..., wait_for_result=False)`` / ``run_no_wait()`` -> ``Harness.start``; ``await
  asyncio.sleep(1)`` between starts -> ``Harness.advance``; ``aio_result()`` and
  ``hatchet.runs.list`` -> ``Harness.result`` and the runs' statuses.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel

from sagaloop import App, SagaContext, SagaFailedError
from sagaloop.sagas.concurrency import Concurrency
from sagaloop.testing import Harness

app = App("port-hatchet-concurrency")


class WorkflowInput(BaseModel):
    group: str


@app.saga(
    name="ConcurrencyCancelInProgress",
    concurrency=Concurrency(limit=1, key=lambda input: input.group, at_limit="cancel_in_progress"),
)
async def concurrency_cancel_in_progress_workflow(ctx: SagaContext, input: WorkflowInput) -> None:
    await ctx.sleep(timedelta(seconds=5))  # step1: 50 x asyncio.sleep(0.10)
    await ctx.sleep(timedelta(seconds=5))  # step2 (parents=[step1]): the same


def test_run_cancel_in_progress() -> None:
    env = Harness(app)
    refs: list[str] = []
    for _ in range(10):
        refs.append(env.start(concurrency_cancel_in_progress_workflow, WorkflowInput(group="A")))
        env.advance(timedelta(seconds=1))

    for ref in refs:
        try:
            env.run_until_idle()
            env.result(ref)
        except SagaFailedError:
            continue

    runs = [env.get(ref) for ref in refs]  # in the order of their "i"
    assert len(runs) == 10
    assert runs[-1].run_id == refs[9]
    assert runs[-1].status == "completed"
    assert all(r.status == "cancelled" for r in runs[:-1])


@app.saga(
    name="ConcurrencyDemoWorkflowRR",
    concurrency=Concurrency(limit=1, key=lambda input: input.group, at_limit="queue"),
)
async def concurrency_limit_rr_workflow(ctx: SagaContext, input: WorkflowInput) -> None:
    ctx.logger.info("starting step1")
    await ctx.sleep(timedelta(seconds=2))  # time.sleep(2)
    ctx.logger.info("finished step1")


def test_run_group_round_robin() -> None:
    env = Harness(app)
    num_groups = 2
    runs: list[str] = []

    # Start all runs
    for i in range(1, num_groups + 1):
        runs.append(env.start(concurrency_limit_rr_workflow, WorkflowInput(group=str(i))))
        runs.append(env.start(concurrency_limit_rr_workflow, WorkflowInput(group=str(i))))

    successful_runs = []
    cancelled_runs = []
    start_time = env.clock.now()

    env.run_until_idle()
    for i, run in enumerate(runs, start=1):
        try:
            result = env.result(run)
            successful_runs.append((i, result))
        except SagaFailedError as e:
            if e.status == "cancelled":
                cancelled_runs.append((i, str(e)))
            else:
                raise

    total_time = (env.clock.now() - start_time).total_seconds()

    assert len(successful_runs) == 4, f"Expected 4 successful runs, got {len(successful_runs)}"
    assert len(cancelled_runs) == 0, f"Expected 0 cancelled run, got {len(cancelled_runs)}"
    assert 3.8 <= total_time <= 7, f"Expected about 4 seconds, but it took {total_time:.2f}"
    # Not in the original: exactly two waves of 2 s, the groups side by side.
    assert total_time == 4.0
