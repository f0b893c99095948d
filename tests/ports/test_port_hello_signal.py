"""Port of Temporal's hello signal sample.

Original: github.com/temporalio/samples-python, commit e652a4d0e85042a34ec8fc46a4a03e51681fd7f9,
``hello/hello_signal.py`` (``GreetingWorkflow``), tested by ``tests/hello/hello_signal_test.py``.

What maps to what:

- the ``submit_greeting`` and ``exit`` signals -> events of those names;
- the workflow's queue of pending greetings plus ``wait_condition(queue not empty or exit)``
  -> ``ctx.wait_for_any(["submit_greeting", "exit"])``, which returns the events in arrival
  order (events sent before the saga waits are kept, as signals are buffered by Temporal);
- ``handle.describe().status`` -> ``Harness.get(run_id).status``: Temporal's ``RUNNING`` is a
  run that has not finished (here ``waiting``, or ``running`` while a step is in flight),
  ``COMPLETED`` is ``completed``; ``handle.result()`` -> ``Harness.result``.
"""

from __future__ import annotations

from sagaloop import App, SagaContext
from sagaloop.testing import Harness

app = App("port-hello-signal")
SUBMIT_GREETING = "submit_greeting"
EXIT = "exit"
NOT_FINISHED = ("running", "waiting")


@app.saga(name="greeting")
async def greeting_workflow(ctx: SagaContext) -> list[str]:
    greetings: list[str] = []
    while True:
        got = await ctx.wait_for_any([SUBMIT_GREETING, EXIT])
        if got.name == EXIT:
            return greetings
        greetings.append(f"Hello, {got.data}")


def test_signal_workflow() -> None:
    env = Harness(app)
    run_id = env.start(greeting_workflow)

    env.send_event(run_id, SUBMIT_GREETING, "user1")
    env.send_event(run_id, SUBMIT_GREETING, "user2")
    env.run_until_idle()
    assert env.get(run_id).status in NOT_FINISHED

    env.send_event(run_id, EXIT)
    env.run_until_idle()
    assert env.result(run_id) == ["Hello, user1", "Hello, user2"]
    assert env.get(run_id).status == "completed"
