"""Port of Temporal's safe message handlers sample: a cluster manager whose updates assign
nodes to jobs and delete jobs under a lock, while its main code runs health checks.

Original: github.com/temporalio/samples-python, ``message_passing/safe_message_handlers/``
(``workflow.py``: ``ClusterManagerWorkflow``; ``activities.py``; ``starter.py``: the cluster's
life cycle) and ``tests/message_passing/safe_message_handlers/workflow_test.py`` (its three
tests, with their assertions).

What maps to what:

- the ``start_cluster`` and ``shutdown_cluster`` signals -> ``ctx.on_event`` handlers (the
  second async: it waits for the cluster to have started, with ``ctx.wait_condition``);
- the ``assign_nodes_to_job`` and ``delete_job`` updates -> async ``ctx.on_update`` handlers
  that wait for the cluster to have started, raise ``ApplicationError`` when it is shut down,
  and run their activity under the same ``asyncio.Lock`` as the health check;
  ``execute_update`` -> ``Harness.update`` / ``Client.update``, which return the handler's
  result; several updates sent at once (``asyncio.gather`` of ``execute_update``) ->
  ``Harness.send_update`` for each, then ``Harness.update`` with each id;
  ``WorkflowUpdateFailedError`` whose cause is the ``ApplicationError`` -> ``UpdateFailedError``
  whose ``error`` has its type and message;
- the activities -> steps (``find_bad_nodes`` with ``RetryPolicy(max_attempts=1)``);
- ``workflow.wait_condition(..., timeout=...)`` raising ``asyncio.TimeoutError`` ->
  ``ctx.wait_condition(..., timeout=...)`` raising ``TimeoutError`` (a durable timer);
- ``workflow.info().is_continue_as_new_suggested()`` and ``get_current_history_length()`` ->
  ``ctx.continue_as_new_suggested`` and ``ctx.history_length``; ``workflow.continue_as_new`` ->
  ``ctx.continue_as_new``, carrying the state as the sample does;
- ``handle.result()`` -> ``Harness.result``.

The harness never moves its clock by itself here (the health checks would run for ever):
tests step it (``Harness.update``, ``run_until_idle(skip_time=False)``) and move the clock
where the sample sleeps. Every test runs with the saga code replayed from its history on each
activation and with it cached between activations.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop import (
    App,
    ApplicationError,
    Client,
    RetryPolicy,
    SagaContext,
    StepContext,
    UpdateFailedError,
)
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.runtime.service import Runtime
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness, replay

# --- activities.py -----------------------------------------------------------------------------


@dataclasses.dataclass
class AssignNodesToJobInput:
    nodes: list[str]
    job_name: str


@dataclasses.dataclass
class UnassignNodesForJobInput:
    nodes: list[str]
    job_name: str


@dataclasses.dataclass
class FindBadNodesInput:
    nodes_to_check: set[str]


app = App("port-safe-message-handlers")


@app.step()
async def assign_nodes_to_job(ctx: StepContext, input: AssignNodesToJobInput) -> None:
    ctx.logger.info("Assigning nodes %s to job %s", input.nodes, input.job_name)
    await asyncio.sleep(0.01)  # the sample sleeps 0.1 s


@app.step()
async def unassign_nodes_for_job(ctx: StepContext, input: UnassignNodesForJobInput) -> None:
    ctx.logger.info("Deallocating nodes %s from job %s", input.nodes, input.job_name)
    await asyncio.sleep(0.01)


@app.step(retry=RetryPolicy(max_attempts=1))
async def find_bad_nodes(ctx: StepContext, input: FindBadNodesInput) -> set[str]:
    await asyncio.sleep(0.01)
    bad_nodes = {n for n in input.nodes_to_check if int(n) % 5 == 0}
    ctx.logger.info("Found bad nodes: %s" if bad_nodes else "No new bad nodes found.", bad_nodes)
    return bad_nodes


# --- workflow.py -------------------------------------------------------------------------------


@dataclasses.dataclass
class ClusterManagerState:
    cluster_started: bool = False
    cluster_shutdown: bool = False
    nodes: dict[str, str | None] = dataclasses.field(default_factory=dict)
    jobs_assigned: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class ClusterManagerInput:
    state: ClusterManagerState | None = None
    test_continue_as_new: bool = False


@dataclasses.dataclass
class ClusterManagerResult:
    num_currently_assigned_nodes: int
    num_bad_nodes: int


@dataclasses.dataclass
class ClusterManagerAssignNodesToJobInput:
    total_num_nodes: int
    job_name: str


@dataclasses.dataclass
class ClusterManagerDeleteJobInput:
    job_name: str


@dataclasses.dataclass
class ClusterManagerAssignNodesToJobResult:
    nodes_assigned: set[str]


class ClusterManagerWorkflow:
    """The sample's workflow class, its methods as they are; ``run`` below registers its
    handlers (Temporal registers decorated methods)."""

    def __init__(self, ctx: SagaContext, input: ClusterManagerInput) -> None:
        self.ctx = ctx
        self.state = input.state if input.state else ClusterManagerState()
        if input.test_continue_as_new:
            self.max_history_length: int | None = 120
            self.sleep_interval_seconds = 1
        else:
            self.max_history_length = None
            self.sleep_interval_seconds = 600
        self.nodes_lock = asyncio.Lock()

    async def start_cluster(self, _: Any = None) -> None:  # signal
        self.state.cluster_started = True
        self.state.nodes = {str(k): None for k in range(25)}
        self.ctx.logger.info("Cluster started")

    async def shutdown_cluster(self, _: Any = None) -> None:  # signal
        await self.ctx.wait_condition(lambda: self.state.cluster_started)
        self.state.cluster_shutdown = True
        self.ctx.logger.info("Cluster shut down")

    async def assign_nodes_to_job(  # update
        self, input: ClusterManagerAssignNodesToJobInput
    ) -> ClusterManagerAssignNodesToJobResult:
        await self.ctx.wait_condition(lambda: self.state.cluster_started)
        if self.state.cluster_shutdown:
            raise ApplicationError("Cannot assign nodes to a job: Cluster is already shut down")
        async with self.nodes_lock:
            # Idempotency guard.
            if input.job_name in self.state.jobs_assigned:
                return ClusterManagerAssignNodesToJobResult(
                    self.get_assigned_nodes(job_name=input.job_name)
                )
            unassigned_nodes = self.get_unassigned_nodes()
            if len(unassigned_nodes) < input.total_num_nodes:
                raise ApplicationError(
                    f"Cannot assign {input.total_num_nodes} nodes; "
                    f"have only {len(unassigned_nodes)} available"
                )
            nodes_to_assign = unassigned_nodes[: input.total_num_nodes]
            await self._assign_nodes_to_job(nodes_to_assign, input.job_name)
            return ClusterManagerAssignNodesToJobResult(
                nodes_assigned=self.get_assigned_nodes(job_name=input.job_name)
            )

    async def _assign_nodes_to_job(self, assigned_nodes: list[str], job_name: str) -> None:
        await self.ctx.call(assign_nodes_to_job, AssignNodesToJobInput(assigned_nodes, job_name))
        for node in assigned_nodes:
            self.state.nodes[node] = job_name
        self.state.jobs_assigned.add(job_name)

    async def delete_job(self, input: ClusterManagerDeleteJobInput) -> None:  # update
        await self.ctx.wait_condition(lambda: self.state.cluster_started)
        if self.state.cluster_shutdown:
            raise ApplicationError("Cannot delete a job: Cluster is already shut down")
        async with self.nodes_lock:
            nodes_to_unassign = [k for k, v in self.state.nodes.items() if v == input.job_name]
            await self._unassign_nodes_for_job(nodes_to_unassign, input.job_name)

    async def _unassign_nodes_for_job(self, nodes_to_unassign: list[str], job_name: str) -> None:
        await self.ctx.call(
            unassign_nodes_for_job, UnassignNodesForJobInput(nodes_to_unassign, job_name)
        )
        for node in nodes_to_unassign:
            self.state.nodes[node] = None

    def get_unassigned_nodes(self) -> list[str]:
        return [k for k, v in self.state.nodes.items() if v is None]

    def get_bad_nodes(self) -> set[str]:
        return {k for k, v in self.state.nodes.items() if v == "BAD!"}

    def get_assigned_nodes(self, *, job_name: str | None = None) -> set[str]:
        if job_name:
            return {k for k, v in self.state.nodes.items() if v == job_name}
        return {k for k, v in self.state.nodes.items() if v is not None and v != "BAD!"}

    async def perform_health_checks(self) -> None:
        async with self.nodes_lock:
            assigned_nodes = self.get_assigned_nodes()
            try:
                bad_nodes = await self.ctx.call(find_bad_nodes, FindBadNodesInput(assigned_nodes))
                for node in bad_nodes:
                    self.state.nodes[node] = "BAD!"
            except Exception as e:
                self.ctx.logger.warning("Health check failed with error %s:%s", type(e).__name__, e)

    async def run(self, input: ClusterManagerInput) -> ClusterManagerResult:
        await self.ctx.wait_condition(lambda: self.state.cluster_started)
        # Perform health checks at intervals.
        while True:
            await self.perform_health_checks()
            try:  # noqa: SIM105 (the sample's)
                await self.ctx.wait_condition(
                    lambda: self.state.cluster_shutdown or self.should_continue_as_new(),
                    timeout=timedelta(seconds=self.sleep_interval_seconds),
                )
            except TimeoutError:
                pass
            if self.state.cluster_shutdown:
                break
            if self.should_continue_as_new():
                await self.ctx.wait_condition(self.ctx.all_handlers_finished)
                self.ctx.logger.info("Continuing as new")
                self.ctx.continue_as_new(
                    ClusterManagerInput(
                        state=self.state, test_continue_as_new=input.test_continue_as_new
                    )
                )
        await self.ctx.wait_condition(self.ctx.all_handlers_finished)
        return ClusterManagerResult(len(self.get_assigned_nodes()), len(self.get_bad_nodes()))

    def should_continue_as_new(self) -> bool:
        if self.ctx.continue_as_new_suggested:
            return True
        # This is just for ease-of-testing. In production, we trust the engine to tell us
        # when to continue as new.
        return bool(self.max_history_length and self.ctx.history_length > self.max_history_length)


@app.saga(name="cluster-manager")
async def cluster_manager(ctx: SagaContext, input: ClusterManagerInput) -> ClusterManagerResult:
    wf = ClusterManagerWorkflow(ctx, input)
    ctx.on_event("start_cluster", wf.start_cluster)
    ctx.on_event("shutdown_cluster", wf.shutdown_cluster)
    ctx.on_update(
        "assign_nodes_to_job", wf.assign_nodes_to_job, model=ClusterManagerAssignNodesToJobInput
    )
    ctx.on_update("delete_job", wf.delete_job, model=ClusterManagerDeleteJobInput)
    return await wf.run(input)


# --- workflow_test.py ----------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["replay", "cache"])
def env(request: pytest.FixtureRequest) -> Harness:
    return Harness(app, cache=request.param)


def nodes_assigned(answer: dict[str, Any]) -> set[str]:
    """An update's answer is its result's JSON: ``{"nodes_assigned": [...]}``."""
    return set(answer["nodes_assigned"])


def execute_all(env: Harness, run_id: str, name: str, inputs: list[Any]) -> list[Any]:
    """``asyncio.gather`` of ``execute_update``: every update sent, then every answer read."""
    sent = [env.send_update(run_id, name, dataclasses.asdict(i)) for i in inputs]
    return [env.update(run_id, name, update_id=update_id) for update_id in sent]


def test_safe_message_handlers(env: Harness) -> None:
    run_id = env.start(cluster_manager, ClusterManagerInput())
    env.send_event(run_id, "start_cluster")
    allocation_updates = [
        ClusterManagerAssignNodesToJobInput(total_num_nodes=2, job_name=f"task-{i}")
        for i in range(6)
    ]
    results = execute_all(env, run_id, "assign_nodes_to_job", allocation_updates)
    for result in results:
        assert len(nodes_assigned(result)) == 2
    env.advance(timedelta(seconds=1))  # await asyncio.sleep(1)
    deletion_updates = [ClusterManagerDeleteJobInput(job_name=f"task-{i}") for i in range(6)]
    execute_all(env, run_id, "delete_job", deletion_updates)
    env.send_event(run_id, "shutdown_cluster")
    env.run_until_idle(skip_time=False)
    result = env.result(run_id)
    assert result.num_currently_assigned_nodes == 0
    replay(app, env.history(run_id), run_id=run_id)


def test_update_idempotency(env: Harness) -> None:
    run_id = env.start(cluster_manager, ClusterManagerInput())
    env.send_event(run_id, "start_cluster")
    input = {"total_num_nodes": 5, "job_name": "jobby-job"}
    result_1 = env.update(run_id, "assign_nodes_to_job", input)
    # simulate that in calling it twice, the operation is idempotent
    result_2 = env.update(run_id, "assign_nodes_to_job", input)
    # the second call should not assign more nodes (it may return fewer if the health check
    # finds bad nodes in between the two signals.)
    assert nodes_assigned(result_1) >= nodes_assigned(result_2)


def test_update_failure(env: Harness) -> None:
    run_id = env.start(cluster_manager, ClusterManagerInput())
    env.send_event(run_id, "start_cluster")
    env.update(run_id, "assign_nodes_to_job", {"total_num_nodes": 24, "job_name": "big-task"})
    try:
        # Try to assign too many nodes
        env.update(run_id, "assign_nodes_to_job", {"total_num_nodes": 3, "job_name": "little"})
        raise AssertionError("the update should have failed")  # the sample's try has no else
    except UpdateFailedError as e:
        assert e.error.type == "ApplicationError"
        assert e.error.message == "Cannot assign 3 nodes; have only 1 available"
    finally:
        env.send_event(run_id, "shutdown_cluster")
        env.run_until_idle(skip_time=False)
        result = env.result(run_id)
        assert result.num_currently_assigned_nodes + result.num_bad_nodes == 24


def test_the_starters_life_cycle_continuing_as_new(env: Harness) -> None:
    """starter.py with ``should_test_continue_as_new``: health checks every second, the
    history continued as new past 120 events, the state carried; the jobs deleted after the
    10 s sleep and the cluster shut down."""
    run_id = env.start(cluster_manager, ClusterManagerInput(test_continue_as_new=True))
    env.send_event(run_id, "start_cluster")
    inputs = [ClusterManagerAssignNodesToJobInput(2, f"task-{i}") for i in range(6)]
    assigned = [nodes_assigned(r) for r in execute_all(env, run_id, "assign_nodes_to_job", inputs)]
    assert all(len(nodes) == 2 for nodes in assigned)
    for _ in range(60):  # await asyncio.sleep(delay_seconds): the health checks go on
        env.advance(timedelta(seconds=1))
    started = [e for e in env.history(run_id) if e.kind == "run_started"]
    assert started[0].data.get("epoch", 0) >= 1  # it continued as new
    deletions = [ClusterManagerDeleteJobInput(f"task-{i}") for i in range(6)]
    execute_all(env, run_id, "delete_job", deletions)
    env.send_event(run_id, "shutdown_cluster")
    env.run_until_idle(skip_time=False)
    result = env.result(run_id)
    # nodes 0, 5 and 10 were assigned and found bad by a health check
    bad = {n for nodes in assigned for n in nodes if int(n) % 5 == 0}
    assert (result.num_currently_assigned_nodes, result.num_bad_nodes) == (0, len(bad))
    replay(app, env.history(run_id), run_id=run_id)


def test_the_starters_life_cycle_with_a_running_engine_and_worker(tmp_path: Path) -> None:
    """starter.py against an engine and a worker running beside it, on a SQLite file: the six
    assignments sent at once from six threads (the sample's ``asyncio.gather``), then the
    six deletions, then the shutdown."""
    store = SqlStore(f"sqlite:///{tmp_path / 'cluster.db'}")
    store.upgrade()
    broker = DatabaseBroker(store, lease=timedelta(seconds=5), poll_interval=0.02)
    runtime = Runtime(app, store, broker, poll=0.02, heartbeat=0.5, concurrency=2).start()
    try:
        client = Client(store, app)
        run_id = client.start(cluster_manager, ClusterManagerInput(), run_id="cluster-1")
        client.send_event(run_id, "start_cluster")

        def execute_update(name: str, input: Any) -> Any:
            return client.update(run_id, name, dataclasses.asdict(input), timeout=60)

        with ThreadPoolExecutor(6) as pool:
            allocation = [
                pool.submit(
                    execute_update,
                    "assign_nodes_to_job",
                    ClusterManagerAssignNodesToJobInput(total_num_nodes=2, job_name=f"task-{i}"),
                )
                for i in range(6)
            ]
            results = [f.result() for f in allocation]
            for result in results:
                assert len(nodes_assigned(result)) == 2
            assert len(set.union(*(nodes_assigned(r) for r in results))) == 12  # under the lock
            deletion = [
                pool.submit(execute_update, "delete_job", ClusterManagerDeleteJobInput(f"task-{i}"))
                for i in range(6)
            ]
            assert [f.result() for f in deletion] == [None] * 6
        client.send_event(run_id, "shutdown_cluster")
        result = client.result(run_id, timeout=60)
        assert result.num_currently_assigned_nodes == 0
        replay(app, client.history(run_id), run_id=run_id)
    finally:
        runtime.stop()
        store.close()
