"""Port of Temporal's hello async activity completion sample.

Original: github.com/temporalio/samples-python, commit e652a4d0e85042a34ec8fc46a4a03e51681fd7f9,
``hello/hello_async_activity_completion.py`` (``GreetingWorkflow``, ``GreetingComposer``).

What maps to what:

- the activity ``GreetingComposer.compose_greeting`` -> the async step ``compose_greeting``,
  declared with ``timeout=10 s`` (the activity's ``start_to_close_timeout``) and
  ``heartbeat_timeout=2 s``, whose composer holds the client as the sample's does;
- ``activity.info().task_token`` -> ``ctx.task_token`` (text, not bytes);
  ``activity.raise_complete_async()`` -> ``ctx.complete_async()`` (raises ``CompleteAsync``);
- ``asyncio.create_task(self.complete_greeting(...))``, kept referenced -> the same, on the
  process's step loop, which outlives the attempt;
- ``client.get_async_activity_handle(task_token=...)``: ``handle.heartbeat()`` ->
  ``Client.heartbeat_step(token)``; ``handle.complete(result)`` -> ``Client.complete_step(token,
  result)`` (the client is synchronous: called through ``asyncio.to_thread``);
- the worker and ``client.execute_workflow`` -> an engine and a worker on threads beside the
  test (``Runtime`` on a SQLite file) and ``Client.start`` then ``Client.result``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from sagaloop import App, Client, SagaContext, StepAttemptGoneError, StepContext
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine import history as h
from sagaloop.runtime.service import Runtime
from sagaloop.store.sql import SqlStore

app = App("port-hello-async-activity-completion")
printed: list[str] = []


@dataclass
class ComposeGreetingInput:
    greeting: str
    name: str


class GreetingComposer:
    def __init__(self) -> None:
        self.client: Client | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def compose_greeting(self, ctx: StepContext, input: ComposeGreetingInput) -> str:
        # Schedule a task to complete this asynchronously. This could be done in a completely
        # different process or system.
        printed.append("Completing activity asynchronously")
        task = asyncio.create_task(self.complete_greeting(ctx.task_token, input))
        self.tasks.add(task)  # asyncio keeps only weak references to its tasks
        task.add_done_callback(self.tasks.discard)
        # Raise the complete-async error which will complete this function but does not
        # consider the step complete from the saga's perspective
        ctx.complete_async()

    async def complete_greeting(self, task_token: str, input: ComposeGreetingInput) -> None:
        # Wait three seconds, heartbeating each second, through the client.
        assert self.client is not None
        try:
            for _ in range(0, 3):
                printed.append("Waiting one second...")
                await asyncio.to_thread(self.client.heartbeat_step, task_token)
                await asyncio.sleep(1)
            # Complete using the token
            await asyncio.to_thread(
                self.client.complete_step, task_token, f"{input.greeting}, {input.name}!"
            )
        except StepAttemptGoneError:
            # A machine so busy that a heartbeat came past the heartbeat_timeout: that attempt
            # timed out, and the retry hands off again (its own task completes it).
            printed.append("attempt gone")


composer = GreetingComposer()


@app.step(timeout=timedelta(seconds=10), heartbeat_timeout=timedelta(seconds=2))
async def compose_greeting(ctx: StepContext, input: ComposeGreetingInput) -> str:
    return await composer.compose_greeting(ctx, input)


@app.saga(name="greeting")
async def greeting_workflow(ctx: SagaContext, name: str) -> str:
    return await ctx.call(compose_greeting, ComposeGreetingInput("Hello", name))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    """An engine and a worker on their own threads, as ``sagaloop dev`` runs them."""
    store = SqlStore(f"sqlite:///{tmp_path / 'async-completion.db'}")
    store.upgrade()
    broker = DatabaseBroker(store, lease=timedelta(seconds=2), poll_interval=0.02)
    runtime = Runtime(app, store, broker, poll=0.02, heartbeat=0.5, concurrency=2).start()
    composer.client = Client(store, app)
    try:
        yield Client(store, app)
    finally:
        runtime.stop()
        store.close()


def test_async_activity_completion(client: Client) -> None:
    printed.clear()
    run_id = client.start(greeting_workflow, "World", run_id="hello-async-activity-completion")
    assert client.result(run_id, timeout=60) == "Hello, World!"
    assert printed[:2] == ["Completing activity asynchronously", "Waiting one second..."]
    kinds = [e.kind for e in client.history(run_id)]
    assert h.STEP_HANDED_OFF in kinds and h.STEP_HEARTBEAT in kinds
    assert kinds.count(h.STEP_COMPLETED) == 1
