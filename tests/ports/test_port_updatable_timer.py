"""Port of Temporal's updatable timer sample.

Original: github.com/temporalio/samples-python, commit e652a4d0e85042a34ec8fc46a4a03e51681fd7f9,
``updatable_timer/updatable_timer_lib.py`` and ``updatable_timer/workflow.py``, tested by
``tests/updatable_timer/updatable_timer_test.py``.

What maps to what:

- the workflow's input (a wake-up time as a POSIX timestamp) -> the saga's input;
- ``workflow.wait_condition(lambda: updated, timeout=interval)`` -> ``ctx.wait_for_event(
  "update_wake_up_time", timeout=interval)``; ``asyncio.TimeoutError`` -> ``EventTimeoutError``;
- the ``update_wake_up_time`` signal -> an event of that name (``Harness.send_event``);
- the ``get_wake_up_time`` query -> ``ctx.publish("wake_up_time", ...)`` read back with
  ``Client.get_published``. A Temporal query runs the workflow object's ``__init__`` at once;
  here the value is published by the run's first activation, so the test lets the harness do
  the work that needs no time before reading it;
- ``workflow.now()`` -> ``ctx.now()``; the time-skipping test environment -> the harness's
  virtual clock (``run_until_idle`` skips to the next timer).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from sagaloop import App, EventTimeoutError, SagaContext
from sagaloop.testing import Harness

app = App("port-updatable-timer")
WAKE_UP_TIME = "wake_up_time"
UPDATE = "update_wake_up_time"


@app.saga(name="updatable-timer")
async def updatable_timer(ctx: SagaContext, wake_up_time: float) -> None:
    wake_up = datetime.fromtimestamp(wake_up_time, tz=UTC)
    ctx.publish(WAKE_UP_TIME, wake_up.timestamp())
    ctx.logger.info("sleep_until: %s", wake_up)
    while True:
        sleep_interval = wake_up - ctx.now()
        if sleep_interval <= timedelta(0):
            break
        ctx.logger.info("going to sleep for %s", sleep_interval)
        try:
            new_time = await ctx.wait_for_event(UPDATE, timeout=sleep_interval)
        except EventTimeoutError:
            continue  # the condition is checked at the top of the loop
        wake_up = datetime.fromtimestamp(float(new_time), tz=UTC)
        ctx.logger.info("update_wake_up_time: %s", wake_up)
        ctx.publish(WAKE_UP_TIME, wake_up.timestamp())
    ctx.logger.info("sleep_until completed")


def test_updatable_timer_workflow() -> None:
    env = Harness(app)
    now = env.clock.now()
    in_a_day = float((now + timedelta(days=1)).timestamp())
    in_an_hour = float((now + timedelta(hours=1)).timestamp())

    run_id = env.start(updatable_timer, in_a_day)
    env.run_until_idle(skip_time=False)  # the first activation: no time passes
    wake_up_time1 = env.client.get_published(run_id, WAKE_UP_TIME)
    assert math.isclose(wake_up_time1, in_a_day)

    env.send_event(run_id, UPDATE, in_an_hour)
    env.run_until_idle(skip_time=False)
    wake_up_time2 = env.client.get_published(run_id, WAKE_UP_TIME)
    assert math.isclose(wake_up_time2, in_an_hour)

    env.run_until_idle()  # `await handle.result()`: the clock skips to the updated time
    assert env.result(run_id) is None
    # Not in the original: the timer went off at the updated time, not a day later.
    assert env.clock.now() == datetime.fromtimestamp(in_an_hour, tz=UTC)
