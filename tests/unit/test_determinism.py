"""Replay checks saga code against the history: a changed order of calls parks the run with a
readable diff, ``ctx.patched`` lets new code take a new path only where the run did not pass,
and the saga logger is silent while replaying."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness


def kinds(env: Harness, run_id: str, kind: str) -> list[Any]:
    return [e for e in env.history(run_id) if e.kind == kind]


def deploy(env: Harness, app: App, saga_name: str, fn: Any) -> None:
    """Simulate deploying new saga code: swap the function and restart the process."""
    app.sagas[saga_name].fn = fn
    env.restart()


# --- a changed order of calls ----------------------------------------------------------------


def test_reordered_calls_park_the_run_and_fixing_the_code_resumes_it() -> None:
    app = App("reorder")
    ran: list[str] = []

    @app.step()
    def a(ctx: StepContext) -> str:
        ran.append("a")
        return "A"

    @app.step()
    def b(ctx: StepContext) -> str:
        ran.append("b")
        return "B"

    async def original(ctx: SagaContext) -> list[str]:
        first = await ctx.call(a)
        await ctx.wait_for_event("go")
        second = await ctx.call(b)
        return [first, second]

    async def reordered(ctx: SagaContext) -> list[str]:
        second = await ctx.call(b)
        first = await ctx.call(a)
        await ctx.wait_for_event("go")
        return [first, second]

    app.saga(name="reorder")(original)
    env = Harness(app)
    run_id = env.start("reorder")
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    assert ran == ["a"]

    deploy(env, app, "reorder", reordered)
    env.send_event(run_id, "go")
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "needs_attention"
    assert run.reason is not None
    assert "call('a') at position 0" in run.reason  # what the history recorded
    assert "call('b') at position 0" in run.reason  # what the code now issues
    assert run.reason.index("call('a')") < run.reason.index("call('b')")
    assert "non-deterministic" in run.reason
    assert ran == ["a"], "nothing of the new code's commands was executed"
    parked = kinds(env, run_id, h.RUN_PARKED)
    assert len(parked) == 1 and parked[0].data.get("nondeterminism") is True
    timeline = env.status(run_id)
    assert timeline.waiting_for[0] == f"needs attention: {run.reason}"

    # retrying with the code still wrong parks it again, without running anything
    env.retry(run_id)
    env.run_until_idle()
    assert env.get(run_id).status == "needs_attention"
    assert ran == ["a"]

    # fixing the code back and retrying resumes from where the run was
    deploy(env, app, "reorder", original)
    env.retry(run_id)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "completed"
    assert run.output == ["A", "B"]
    assert ran == ["a", "b"], "the recorded call is not run again"
    assert len(kinds(env, run_id, h.EVENT_ARRIVED)) == 1


def test_a_removed_command_is_reported_too() -> None:
    app = App("removed")

    @app.step()
    def a(ctx: StepContext) -> str:
        return "A"

    async def original(ctx: SagaContext) -> str:
        await ctx.call(a)
        await ctx.wait_for_event("go")
        return "v1"

    async def without_call(ctx: SagaContext) -> str:
        await ctx.wait_for_event("go")
        return "v2"

    app.saga(name="removed")(original)
    env = Harness(app)
    run_id = env.start("removed")
    env.run_until_idle(skip_time=False)

    deploy(env, app, "removed", without_call)
    env.send_event(run_id, "go")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "needs_attention"
    assert run.reason is not None
    assert "call('a') at position 0" in run.reason
    assert "wait_for_event('go') at position 0" in run.reason


# --- patched ---------------------------------------------------------------------------------


def test_patched_keeps_old_path_for_runs_that_passed_and_new_path_otherwise() -> None:
    app = App("patching")
    ran: list[tuple[str, int]] = []

    @app.step()
    def old(ctx: StepContext, n: int) -> str:
        ran.append(("old", n))
        return f"old{n}"

    @app.step()
    def new(ctx: StepContext, n: int) -> str:
        ran.append(("new", n))
        return f"new{n}"

    async def v1(ctx: SagaContext) -> list[str]:
        first = await ctx.call(old, 1)
        await ctx.wait_for_event("go")
        second = await ctx.call(old, 2)
        return [first, second]

    async def v2(ctx: SagaContext) -> list[str]:
        if ctx.patched("v2-first"):
            first = await ctx.call(new, 1)
        else:
            first = await ctx.call(old, 1)
        await ctx.wait_for_event("go")
        if ctx.patched("v2-second"):
            second = await ctx.call(new, 2)
        else:
            second = await ctx.call(old, 2)
        return [first, second]

    app.saga(name="patching")(v1)
    env = Harness(app)
    in_flight = env.start("patching", run_id="in-flight")
    env.run_until_idle(skip_time=False)
    assert env.get(in_flight).status == "waiting"

    deploy(env, app, "patching", v2)
    fresh = env.start("patching", run_id="fresh")
    env.run_until_idle(skip_time=False)
    env.send_event(in_flight, "go")
    env.send_event(fresh, "go")
    env.run_until_idle()

    # passed the first point with old code: old path there; reached the second with new code
    assert env.get(in_flight).status == "completed"
    assert env.get(in_flight).output == ["old1", "new2"]
    assert env.get(fresh).status == "completed"
    assert env.get(fresh).output == ["new1", "new2"]
    assert [m.name for m in kinds(env, in_flight, h.MARKER)] == ["v2-second"]
    assert [m.name for m in kinds(env, fresh, h.MARKER)] == ["v2-first", "v2-second"]
    assert sorted(ran) == sorted([("old", 1), ("new", 2), ("new", 1), ("new", 2)])

    # both histories replay cleanly with the new code
    env.restart()
    for run_id in (in_flight, fresh):
        assert env.get(run_id).status == "completed"


def test_removing_a_patch_marker_from_code_is_a_non_determinism() -> None:
    """A run that recorded the marker cannot replay against code without the patch call."""
    app = App("unpatch")

    @app.step()
    def work(ctx: StepContext) -> int:
        return 1

    async def patched(ctx: SagaContext) -> int:
        if ctx.patched("fix"):
            await ctx.call(work)
        await ctx.wait_for_event("go")
        return 1

    async def unpatched(ctx: SagaContext) -> int:
        await ctx.call(work)
        await ctx.wait_for_event("go")
        return 2

    app.saga(name="unpatch")(patched)
    env = Harness(app)
    run_id = env.start("unpatch")
    env.run_until_idle(skip_time=False)
    deploy(env, app, "unpatch", unpatched)
    env.send_event(run_id, "go")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "needs_attention"
    assert run.reason is not None and "patched('fix') at position 0" in run.reason


# --- asyncio timers are durable timers (tests/unit/test_asyncio_timers.py) ---------------------


# --- the saga logger -------------------------------------------------------------------------


def test_saga_logger_is_silent_during_replay(caplog: pytest.LogCaptureFixture) -> None:
    app = App("logging")
    replaying: list[tuple[str, bool]] = []

    @app.step()
    def work(ctx: StepContext, n: int) -> int:
        return n

    @app.saga(name="logging")
    async def logging_saga(ctx: SagaContext) -> int:
        ctx.logger.info("phase one begins")
        replaying.append(("one", ctx.is_replaying))
        await ctx.call(work, 1)
        ctx.logger.info("phase one done")
        await ctx.wait_for_event("go")
        ctx.logger.info("phase two begins")
        replaying.append(("two", ctx.is_replaying))
        await ctx.call(work, 2)
        ctx.logger.warning("phase two done")
        return 2

    caplog.set_level(logging.DEBUG, logger="sagaloop.saga")

    def saga_messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "sagaloop.saga"]

    env = Harness(app, cache=True)  # replays once after the restart, then cached
    run_id = env.start(logging_saga)
    env.run_until_idle(skip_time=False)
    assert saga_messages() == ["phase one begins", "phase one done"]
    assert all(r.run_id == run_id for r in caplog.records if r.name == "sagaloop.saga")

    caplog.clear()
    env.restart()  # the next activation replays phase one from the history
    env.send_event(run_id, "go")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert saga_messages() == ["phase two begins", "phase two done"]
    assert replaying == [("one", False), ("one", True), ("two", False)]
