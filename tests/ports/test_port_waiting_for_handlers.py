"""Port of Temporal's waiting-for-handlers sample: a workflow that, however it exits (returns,
fails, is cancelled), first waits for its update handlers to finish.

Original: github.com/temporalio/samples-python, ``message_passing/waiting_for_handlers/``
(``workflows.py``: ``WaitingForHandlersWorkflow``; ``activities.py``; ``__init__.py``: the
input and its ``WorkflowExitType``) and
``tests/message_passing/waiting_for_handlers/waiting_for_handlers_test.py`` (its three cases,
with their expectations).

What maps to what:

- ``@workflow.update my_update`` (async: it runs an activity) -> an async ``ctx.on_update``
  handler awaiting ``ctx.call`` of a step;
- ``workflow.wait_condition(workflow.all_handlers_finished)`` -> ``ctx.wait_condition(
  ctx.all_handlers_finished)``, in the same ``try``/``except BaseException`` shape;
- ``is_workflow_exit_exception``: ``asyncio.CancelledError`` (a cancel is delivered into the
  saga code at its pending await, within the saga's ``cancel_grace``) or a failure error
  (``ApplicationError``, which fails the run);
- ``await asyncio.Future()`` (block until cancelled) -> the same;
- ``start_update(..., wait_for_stage=ACCEPTED)`` -> ``Harness.send_update``, then
  ``update_handle.result()`` -> ``Harness.update(..., update_id=...)``; ``wf_handle.cancel()``
  -> ``Harness.cancel``; ``WorkflowFailureError`` from ``wf_handle.result()`` -> the run ends
  ``failed`` or ``cancelled`` and ``Harness.result`` raises.

A difference the cancellation case shows: the cancel is delivered into the saga's main code
only (as Temporal's), and the update handler's step still completes within the saga's
``cancel_grace`` (default 5 minutes); but every step in flight when the cancel arrives, the
handler's included, gets no new attempt if this one fails (``cancel_delivered``'s ``steps``),
where Temporal would retry an update handler's activity.
"""

from __future__ import annotations

import asyncio
import dataclasses
from enum import IntEnum

import pytest

from sagaloop import App, ApplicationError, SagaContext, StepContext
from sagaloop.engine.messages import engine_queue
from sagaloop.testing import Harness, replay

# --- __init__.py -------------------------------------------------------------------------------


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

app = App("port-waiting-for-handlers")


@app.step()
def activity_executed_by_update_handler(ctx: StepContext) -> None:
    return None  # the original sleeps a second: the harness runs the step when it is its turn


# --- workflows.py ------------------------------------------------------------------------------


def is_workflow_exit_exception(e: BaseException) -> bool:
    """True if the exception ends the run (as opposed to one that parks it for a fix)."""
    return isinstance(e, (asyncio.CancelledError, ApplicationError))


@app.saga(name="waiting-for-handlers")
async def waiting_for_handlers(ctx: SagaContext, input: WorkflowInput) -> WorkflowResult:
    update_started = False

    async def my_update(_: object) -> str:
        nonlocal update_started
        update_started = True
        await ctx.call(activity_executed_by_update_handler)
        return "update-result"

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
        await ctx.wait_condition(ctx.all_handlers_finished)
        return result
    except BaseException as e:
        if is_workflow_exit_exception(e):
            await ctx.wait_condition(ctx.all_handlers_finished)
        raise


# --- the sample's test -------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [False, True], ids=["replay", "cache"])
@pytest.mark.parametrize(
    ("exit_type", "run_ends"),
    [
        (WorkflowExitType.SUCCESS, "completed"),
        (WorkflowExitType.FAILURE, "failed"),
        (WorkflowExitType.CANCELLATION, "cancelled"),
    ],
)
def test_waiting_for_handlers(exit_type: WorkflowExitType, run_ends: str, cache: bool) -> None:
    env = Harness(app, cache=cache)
    run_id = env.start(waiting_for_handlers, WorkflowInput(exit_type=exit_type))
    env.run_until_idle()
    env.queues = [engine_queue(app.name)]  # the update's step waits on its queue
    sent = env.send_update(run_id, "my_update")
    env.run_until_idle()
    if exit_type == WorkflowExitType.CANCELLATION:
        env.cancel(run_id)
        env.run_until_idle(skip_time=False)  # within the saga's cancel_grace
    # Not in the original: the run has not ended while the update's step is outstanding.
    assert env.get(run_id).status not in ("completed", "failed", "cancelled")
    env.queues = None
    assert env.update(run_id, "my_update", update_id=sent) == "update-result"
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == run_ends
    if run_ends == "completed":
        assert env.result(run_id) == WorkflowResult(data="workflow-result")
    else:
        with pytest.raises(Exception):  # noqa: B017 - WorkflowFailureError's counterpart
            env.result(run_id)
    replay(app, env.history(run_id), run_id=run_id)
