"""Port of Temporal's waiting-for-handlers-and-compensation sample: a workflow that waits for
its update handler however it exits, and, when it fails or is cancelled, has the handler abort
and compensate its own work, then compensates its own.

Original: github.com/temporalio/samples-python,
``message_passing/waiting_for_handlers_and_compensation/`` (``workflows.py``:
``WaitingForHandlersAndCompensationWorkflow``; ``activities.py``) and
``tests/message_passing/waiting_for_handlers_and_compensation/
waiting_for_handlers_and_compensation_test.py`` (its three cases, with their assertions).

What maps to what:

- the workflow object's attributes -> locals of the saga; the ``workflow_exit`` future -> an
  ``asyncio.Future`` made on the saga's loop (``asyncio.get_running_loop().create_future()``);
- ``workflow.wait([update_task, workflow_exit], return_when=FIRST_EXCEPTION)`` ->
  ``asyncio.wait`` on the saga's deterministic loop (the code only asks ``update_task.done()``,
  never iterates the sets it returns);
- ``@workflow.update my_update`` -> an async ``ctx.on_update`` handler; the activities -> steps;
- the two ``@workflow.query`` flags -> values published with ``ctx.publish`` and read by
  ``@query`` functions;
- ``is_workflow_exit_exception``: ``asyncio.CancelledError`` (a cancel delivered into the saga
  code within its ``cancel_grace``) or ``ApplicationError``;
- ``start_update(..., ACCEPTED)`` -> ``Harness.send_update``, ``up_handle.result()`` ->
  ``Harness.update(..., update_id=)``, ``wf_handle.cancel()`` -> ``Harness.cancel``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from enum import IntEnum
from typing import Any

import pytest

from sagaloop import App, ApplicationError, SagaContext, StepContext, UpdateFailedError
from sagaloop.client import RunView, query
from sagaloop.engine.messages import engine_queue
from sagaloop.testing import Harness, replay


class WorkflowExitType(IntEnum):
    SUCCESS = 0
    FAILURE = 1
    CANCELLATION = 2


@dataclasses.dataclass
class WorkflowInput:
    exit_type: WorkflowExitType


@dataclasses.dataclass
class WorkflowResult:
    data: str


# --- activities.py -----------------------------------------------------------------------------

app = App("port-waiting-for-handlers-and-compensation")


@app.step()
def activity_executed_to_perform_workflow_compensation(ctx: StepContext) -> None:
    return None


@app.step()
def activity_executed_by_update_handler(ctx: StepContext) -> None:
    return None


@app.step()
def activity_executed_by_update_handler_to_perform_compensation(ctx: StepContext) -> None:
    return None


# --- workflows.py ------------------------------------------------------------------------------


def is_workflow_exit_exception(e: BaseException) -> bool:
    return isinstance(e, (asyncio.CancelledError, ApplicationError))


@app.saga(name="waiting-for-handlers-and-compensation")
async def workflow(ctx: SagaContext, input: WorkflowInput) -> WorkflowResult:
    workflow_exit: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    update_started = False
    ctx.publish("update_compensation_done", False)
    ctx.publish("workflow_compensation_done", False)

    async def workflow_compensation() -> None:
        await ctx.call(activity_executed_to_perform_workflow_compensation)
        ctx.publish("update_compensation_done", True)  # as the original does

    async def my_update_compensation() -> None:
        await ctx.call(activity_executed_by_update_handler_to_perform_compensation)
        ctx.publish("update_compensation_done", True)

    async def my_update_application_logic() -> str:
        nonlocal update_started
        update_started = True
        await ctx.call(activity_executed_by_update_handler)
        return "update-result"

    async def my_update(_: Any) -> str:
        update_task = asyncio.create_task(my_update_application_logic())
        await asyncio.wait([update_task, workflow_exit], return_when=asyncio.FIRST_EXCEPTION)
        try:
            if update_task.done():
                return await update_task
            else:
                raise ApplicationError(
                    "The update failed because the workflow run exited"
                ) from workflow_exit.exception()
        except BaseException as e:
            if is_workflow_exit_exception(e):
                try:
                    await my_update_compensation()
                except BaseException as e:
                    raise ApplicationError("Update compensation failed") from e
            raise

    async def my_workflow_application_logic() -> WorkflowResult:
        await ctx.wait_condition(lambda: update_started)
        if input.exit_type == WorkflowExitType.SUCCESS:
            return WorkflowResult(data="workflow-result")
        elif input.exit_type == WorkflowExitType.FAILURE:
            raise ApplicationError("deliberately failing workflow")
        elif input.exit_type == WorkflowExitType.CANCELLATION:
            await asyncio.Future()  # block until cancelled
        raise AssertionError("unreachable")

    ctx.on_update("my_update", my_update)
    try:
        result = await my_workflow_application_logic()
        workflow_exit.set_result(None)
        await ctx.wait_condition(ctx.all_handlers_finished)
        return result
    except BaseException as e:
        if is_workflow_exit_exception(e):
            workflow_exit.set_exception(e)
            await ctx.wait_condition(ctx.all_handlers_finished)
            await workflow_compensation()
            ctx.publish("workflow_compensation_done", True)
        raise


@query(workflow)
def workflow_compensation_done(run: RunView) -> bool:
    return bool(run.published["workflow_compensation_done"])


@query(workflow)
def update_compensation_done(run: RunView) -> bool:
    return bool(run.published["update_compensation_done"])


# --- the sample's test -------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [False, True], ids=["replay", "cache"])
@pytest.mark.parametrize(
    ("exit_type", "update_succeeds", "run_ends"),
    [
        (WorkflowExitType.SUCCESS, True, "completed"),
        (WorkflowExitType.FAILURE, False, "failed"),
        (WorkflowExitType.CANCELLATION, False, "cancelled"),
    ],
)
def test_waiting_for_handlers_and_compensation(
    exit_type: WorkflowExitType, update_succeeds: bool, run_ends: str, cache: bool
) -> None:
    env = Harness(app, cache=cache)
    run_id = env.start(workflow, WorkflowInput(exit_type=exit_type))
    env.run_until_idle()
    env.queues = [engine_queue(app.name)]  # the update's step waits on its queue
    sent = env.send_update(run_id, "my_update")
    env.run_until_idle()
    if exit_type == WorkflowExitType.CANCELLATION:
        env.cancel(run_id)
        env.run_until_idle(skip_time=False)  # within the saga's cancel_grace
    env.queues = None

    if update_succeeds:
        assert env.update(run_id, "my_update", update_id=sent) == "update-result"
        assert not env.query(run_id, update_compensation_done)
    else:
        with pytest.raises(UpdateFailedError):
            env.update(run_id, "my_update", update_id=sent)
        assert env.query(run_id, update_compensation_done)

    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == run_ends
    if run_ends == "completed":
        assert env.result(run_id) == WorkflowResult(data="workflow-result")
        assert not env.query(run_id, workflow_compensation_done)
    else:
        with pytest.raises(Exception):  # noqa: B017 - WorkflowFailureError's counterpart
            env.result(run_id)
        assert env.query(run_id, workflow_compensation_done)
    replay(app, env.history(run_id), run_id=run_id)
