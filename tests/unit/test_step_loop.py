"""Async step bodies share one long-lived event loop per process. A model client (``openai``'s,
through Pydantic AI) keeps connections bound to the loop that opened them; with a loop per
attempt, closed after it, every model request after the first of a process failed with
``RuntimeError: Event loop is closed`` (found by tests/chaos/test_provider_outage_dev.py)."""

from __future__ import annotations

import asyncio
import contextvars
from datetime import timedelta
from typing import Any

from sagaloop import App, StepContext
from sagaloop.engine.messages import Envelope
from sagaloop.runtime.steps import StepRunner

app = App("step-loop")
seen: dict[str, Any] = {}
who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


class Pool:
    """What an HTTP client's connection pool does: a transport opened on the first loop, used
    again by the next request."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None

    async def request(self) -> str:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        done = self.loop.create_future()  # raises once that loop is closed
        self.loop.call_soon_threadsafe(done.set_result, "ok")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_wait(done), self.loop))


async def _wait(future: asyncio.Future[str]) -> str:
    return await future


pool = Pool()


@app.step(timeout=timedelta(seconds=30))  # on the step threads
async def ask(ctx: StepContext, n: int) -> str:
    return await pool.request()


@app.step()  # inline
async def ask_inline(ctx: StepContext, n: int) -> str:
    return f"{await pool.request()} {who.get()}"


def task(step: str, n: int) -> Envelope:
    payload = {"step": step, "args": {"n": n}}
    return Envelope(type="step", run_id="r", position=n, attempt=1, payload=payload)


def test_requests_of_several_attempts_share_a_client_bound_to_its_loop() -> None:
    runner = StepRunner(app, threads=2)
    try:
        replies = [runner.run(task("ask", n)) for n in range(4)]
        replies.append(runner.run(task("ask_inline", 9), inline=True))
    finally:
        runner.close()
    assert [r.outcome for r in replies] == ["completed"] * 5, replies


def test_an_async_body_sees_the_callers_context_variables() -> None:
    runner = StepRunner(app, threads=1)
    try:
        token = who.set("the caller")
        reply = runner.run(task("ask_inline", 1), inline=True)
        who.reset(token)
    finally:
        runner.close()
    assert reply.result == "ok the caller", reply
