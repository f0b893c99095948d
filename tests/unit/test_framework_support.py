"""What agent frameworks need from saga code's event loop: the current saga from anywhere in
its tasks, anyio task groups, and framework-internal ids that the sandbox lets through."""

from __future__ import annotations

import asyncio
import sys
import types
import uuid

import anyio

import sagaloop
from sagaloop import App, SagaContext
from sagaloop.engine import sandbox
from sagaloop.testing import Harness


def test_current_saga_is_the_running_sagas_context_in_every_task() -> None:
    app = App("fw")
    seen: list[bool] = []

    async def nested() -> str:
        ctx = sagaloop.current_saga()
        assert ctx is not None
        return ctx.run_id

    @app.saga
    async def s(ctx: SagaContext) -> list[str]:
        seen.append(sagaloop.current_saga() is ctx)
        return list(await asyncio.gather(nested(), nested()))

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.result(run_id) == [run_id, run_id]
    assert seen and all(seen)
    assert sagaloop.current_saga() is None


def test_anyio_task_groups_run_in_saga_code() -> None:
    app = App("fw")

    @app.saga
    async def s(ctx: SagaContext) -> list[int]:
        out: list[int] = []

        async def put(i: int) -> None:
            out.append(i)

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(put, i)
        return out

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.result(run_id) == [0, 1, 2]


def test_a_trusted_framework_may_name_its_objects_but_user_code_it_calls_may_not() -> None:
    framework = types.ModuleType("fakeframework.graph")
    exec(
        "import uuid\n"
        "def node_id():\n    return uuid.uuid4().hex\n"
        "def call_back(fn):\n    return fn()\n",
        framework.__dict__,
    )
    sys.modules["fakeframework.graph"] = framework
    sandbox.trust_framework("fakeframework")
    app = App("fw")

    @app.saga
    async def allowed(ctx: SagaContext) -> int:
        return len(framework.node_id())

    @app.saga
    async def refused(ctx: SagaContext) -> str:
        return str(framework.call_back(lambda: uuid.uuid4()))  # user code, called back

    env = Harness(app)
    ok, bad = env.start(allowed), env.start(refused)
    env.run_until_idle()
    assert env.result(ok) == 32
    error = env.get(bad).error or {}
    assert error.get("type") == "SagaDeterminismViolation", error


def test_saga_code_left_waiting_is_closed_in_its_own_context() -> None:
    """A saga that waits is dropped between activations (the harness replays every one). Its
    suspended code is then closed, and a framework's ``finally: var.reset(token)`` (the
    OpenAI Agents SDK does this for its tracing and run state) must run in the context where
    the token was made, in every task of the saga: never "created in a different Context"."""
    import contextvars
    import gc

    var: contextvars.ContextVar[str] = contextvars.ContextVar("framework_state", default="")
    closed: list[str] = []
    app = App("fw")

    async def framework_call(ctx: SagaContext, label: str) -> None:
        token = var.set(label)
        try:
            await ctx.wait_for_event(f"go-{label}")
        finally:
            var.reset(token)  # raises ValueError when run in another context
            closed.append(label)

    @app.saga
    async def s(ctx: SagaContext) -> None:
        await asyncio.gather(framework_call(ctx, "a"), framework_call(ctx, "b"))

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"
    env.restart()
    gc.collect()
    assert sorted(closed) >= ["a", "b"]
