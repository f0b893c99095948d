"""Port of Temporal's hello child workflow sample.

Original: github.com/temporalio/samples-python, commit e652a4d0e85042a34ec8fc46a4a03e51681fd7f9,
``hello/hello_child_workflow.py``, tested by ``tests/hello/hello_child_test.py`` (both tests).

What maps to what:

- ``ComposeGreetingWorkflow`` -> the saga ``compose-greeting`` (``ComposeGreetingInput`` a
  pydantic model); ``GreetingWorkflow`` -> the saga ``greeting``;
- ``workflow.execute_child_workflow(..., id="hello-child-workflow-workflow-child-id")`` ->
  ``await ctx.call(compose_greeting, input, run_id="hello-child-workflow-workflow-child-id")``:
  a child run whose output the parent awaits;
- ``client.execute_workflow`` -> ``Harness.start`` then ``run_until_idle`` and ``result``;
- the mocked child (another workflow class registered under the name
  ``ComposeGreetingWorkflow`` on the test's worker) -> an app built with another body for the
  saga named ``compose-greeting``: ``Harness.override`` swaps step bodies only, and
  ``ctx.call`` takes the child's ``SagaDef`` of the app that runs, so the app is built by
  ``make_app(compose)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pydantic import BaseModel

from sagaloop import App, SagaContext
from sagaloop.sagas.app import SagaDef
from sagaloop.testing import Harness

CHILD_ID = "hello-child-workflow-workflow-child-id"


class ComposeGreetingInput(BaseModel):
    greeting: str
    name: str


Compose = Callable[[SagaContext, ComposeGreetingInput], Awaitable[str]]


async def compose_greeting(ctx: SagaContext, input: ComposeGreetingInput) -> str:
    return f"{input.greeting}, {input.name}!"


def make_app(compose: Compose) -> tuple[App, SagaDef[str, str]]:
    """The app, with ``compose`` as the child saga's body; returns it and its parent saga."""
    app = App("port-hello-child")
    child = app.saga(name="compose-greeting")(compose)

    @app.saga(name="greeting")
    async def greeting_workflow(ctx: SagaContext, name: str) -> str:
        return await ctx.call(
            child, ComposeGreetingInput(greeting="Hello", name=name), run_id=CHILD_ID
        )

    return app, greeting_workflow


def test_child_workflow() -> None:
    app, greeting_workflow = make_app(compose_greeting)
    env = Harness(app)
    run_id = env.start(greeting_workflow, "World")
    env.run_until_idle()
    assert env.result(run_id) == "Hello, World!"


async def mocked_compose_greeting(ctx: SagaContext, input: ComposeGreetingInput) -> str:
    return f"{input.greeting}, {input.name} from mocked child!"


def test_mock_child_workflow() -> None:
    app, greeting_workflow = make_app(mocked_compose_greeting)
    env = Harness(app)
    run_id = env.start(greeting_workflow, "World")
    env.run_until_idle()
    assert env.result(run_id) == "Hello, World from mocked child!"
