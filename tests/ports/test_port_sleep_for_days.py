"""Port of Temporal's sleep-for-days sample.

Original: github.com/temporalio/samples-python, commit e652a4d0e85042a34ec8fc46a4a03e51681fd7f9,
``sleep_for_days/workflows.py`` and ``sleep_for_days/activities.py``, tested by
``tests/sleep_for_days/workflow_test.py``.

What maps to what:

- the ``send_email`` activity -> the ``send_email`` step (``SendEmailInput`` a pydantic model);
- ``workflow.wait([sleep(30 days), wait_condition(is_complete)], FIRST_COMPLETED)`` ->
  ``ctx.wait_for_event("complete", timeout=30 days)``: the event is the ``complete`` signal,
  ``EventTimeoutError`` is the sleep finishing first;
- the activity mock registered on the test worker -> ``Harness.override(send_email, mock)``;
- the time-skipping environment's ``env.sleep(delta)`` -> ``Harness.advance(delta)``, which
  fires each timer at its due time, in order; ``env.get_current_time()`` -> ``env.clock.now()``.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel

from sagaloop import App, EventTimeoutError, SagaContext, StepContext
from sagaloop.testing import Harness

app = App("port-sleep-for-days")
COMPLETE = "complete"


class SendEmailInput(BaseModel):
    email_msg: str


@app.step(timeout=timedelta(seconds=10))
def send_email(ctx: StepContext, input: SendEmailInput) -> str:
    """A stub step for sending an email."""
    result = f"Email message: {input.email_msg}, sent"
    ctx.logger.info(result)
    return result


@app.saga(name="sleep-for-days")
async def sleep_for_days(ctx: SagaContext) -> str:
    is_complete = False
    while not is_complete:
        await ctx.call(send_email, SendEmailInput(email_msg="30 days until the next email"))
        try:
            await ctx.wait_for_event(COMPLETE, timeout=timedelta(days=30))
            is_complete = True
        except EventTimeoutError:
            pass  # thirty days went by: the next email
    return "done!"


def test_sleep_for_days_workflow() -> None:
    num_activity_executions = 0

    def send_email_mock(ctx: StepContext, input: SendEmailInput) -> str:
        nonlocal num_activity_executions
        num_activity_executions += 1
        return input.email_msg

    env = Harness(app)
    env.override(send_email, send_email_mock)
    run_id = env.start(sleep_for_days)

    start_time = env.clock.now()
    # Time-skip 5 minutes.
    env.advance(timedelta(minutes=5))
    # Check that the activity has been called, we're now waiting for the sleep to finish.
    assert num_activity_executions == 1
    # Time-skip 90 days.
    env.advance(timedelta(days=90))
    # Expect 3 more activity calls.
    assert num_activity_executions == 4
    # Send the signal to complete the workflow.
    env.send_event(run_id, COMPLETE)
    env.run_until_idle(skip_time=False)
    # Expect no more activity calls to have been made - workflow is complete.
    assert num_activity_executions == 4
    # Expect more than 90 days to have passed.
    assert (env.clock.now() - start_time) > timedelta(days=90)
    # Not in the original (it does not await the result): the run returned.
    assert env.result(run_id) == "done!"
