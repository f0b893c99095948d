"""The saga primitives of issue 11 for real `sagaloop engine` / `sagaloop worker` (and `sagaloop
dev`) processes: child runs, runs that start and message other runs, continue-as-new, waits for
the first of several events, published values, compensate-and-finish, and long steps that
heartbeat and are cancelled. Steps write to itapp's ledger (same file, same tables, same
helpers, $LEDGER_PATH), so effects are counted from outside; what a long step saw (started,
cancelled, cleaned up) goes to the ledger's ``marks`` table."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from itapp import FAST, _record, ledger

from sagaloop import (
    App,
    ApplicationError,
    RetryPolicy,
    SagaContext,
    StepCancelled,
    StepContext,
    StepFailedError,
)

app = App("primitives_app")
WAIT = timedelta(minutes=10)  # event timeouts that never fire in a test
LONG_JOB_LIMIT = 90.0  # seconds: the long step gives up (and says so) if never cancelled


def mark(what: str) -> None:
    with ledger() as conn:
        conn.execute("create table if not exists marks (what text)")
        conn.execute("insert into marks values (?)", (what,))


# --- steps ---------------------------------------------------------------------------------------


@app.step(queue="work", retry=FAST)
def effect(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    return f"{name}:done"


@effect.compensation
def undo_effect(ctx: StepContext, name: str, result: str | None) -> None:
    _record(ctx, name, undo=True)


@effect.reconcile
def find_effect(ctx: StepContext, name: str) -> str | None:
    with ledger() as conn:
        row = conn.execute("select 1 from effects where key = ?", (ctx.idempotency_key,)).fetchone()
    return f"{name}:done" if row else None


@app.step(queue="work", retry=FAST)
def refuse(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    raise ApplicationError(f"{name} refused", type="Refused", non_retryable=True)


@app.step(queue="work", retry=RetryPolicy(max_attempts=1), heartbeat_timeout=timedelta(seconds=30))
def long_job(ctx: StepContext, name: str) -> str:
    """Runs until told to stop through `ctx.heartbeat()` (Temporal's hello_cancellation)."""
    _record(ctx, name)
    mark(f"{name} started")
    try:
        deadline = time.monotonic() + LONG_JOB_LIMIT
        while time.monotonic() < deadline:
            ctx.heartbeat({"name": name})
            time.sleep(0.05)
        mark(f"{name} never cancelled")
        return "never cancelled"
    except StepCancelled:
        mark(f"{name} cancelled")
        raise
    finally:
        mark(f"{name} cleanup")


@long_job.compensation
def undo_long_job(ctx: StepContext, name: str, result: str | None) -> None:
    _record(ctx, name, undo=True)


@app.step(queue="work", retry=FAST, heartbeat_timeout=timedelta(milliseconds=500))
def silent(ctx: StepContext, name: str) -> int:
    """Attempt 1 never heartbeats and outlives its heartbeat timeout: failed in doubt, retried."""
    _record(ctx, name)
    if ctx.attempt == 1:
        time.sleep(4)
    return ctx.attempt


# --- child runs ----------------------------------------------------------------------------------


@app.saga(name="child")
async def child(ctx: SagaContext, name: str) -> str:
    return await ctx.call(effect, name)


@app.saga(name="failing-child")
async def failing_child(ctx: SagaContext, name: str) -> str:
    return await ctx.call(refuse, name)


@app.saga(name="parent")
async def parent(ctx: SagaContext, names: list[str]) -> dict[str, Any]:
    """A child run per name, then one whose failure is this run's StepFailedError."""
    done = [await ctx.call(child, n) for n in names]
    try:
        await ctx.call(failing_child, f"{names[0]}-bad")
    except StepFailedError as e:
        return {"done": done, "failed": e.error.message}
    return {"done": done, "failed": None}


@app.saga(name="sleeper")
async def sleeper(ctx: SagaContext, name: str) -> Any:
    await ctx.call(effect, name)
    return await ctx.wait_for_event("never")


@app.saga(name="waiting-parent")
async def waiting_parent(ctx: SagaContext, name: str) -> Any:
    """Waits on a child that waits for ever: cancelling this run cancels the child."""
    return await ctx.call(sleeper, name)


# --- runs that start and message other runs ------------------------------------------------------


@app.saga(name="helper")
async def helper(ctx: SagaContext, job: str) -> str:
    boss_id = await ctx.wait_for_event("boss", timeout=WAIT)
    result = await ctx.call(effect, job)
    ctx.send_event(boss_id, "done", result)
    return result


@app.saga(name="boss")
async def boss(ctx: SagaContext, jobs: list[str]) -> list[str]:
    """Starts a helper per job (fire-and-forget), tells each who the boss is, collects."""
    for job in jobs:
        ctx.send_event(ctx.start(helper, job), "boss", ctx.run_id)
    ctx.publish("started", len(jobs))
    return sorted([await ctx.wait_for_event("done", timeout=WAIT) for _ in jobs])


# --- continue as new -----------------------------------------------------------------------------


@app.saga(name="looping")
async def looping(ctx: SagaContext, state: dict[str, int]) -> dict[str, int]:
    """One effect per history, then a fresh history under the same run id."""
    n = state["n"]
    ctx.publish("n", n)
    if n >= state["until"]:
        return {"n": n}
    await ctx.call(effect, f"loop{n}")
    ctx.continue_as_new({"n": n + 1, "until": state["until"]})


# --- events in arrival order, published values ---------------------------------------------------


@app.saga(name="review")
async def review(ctx: SagaContext, draft: str) -> dict[str, Any]:
    """Approve, reject or edit a draft (LangGraph's human in the loop), the draft published."""
    edits = 0
    while True:
        ctx.publish("draft", draft)
        got = await ctx.wait_for_any(
            ["approve", "reject", "edit"], timeout=WAIT, prompt={"draft": draft}
        )
        if got.name == "edit":
            draft, edits = str(got.data), edits + 1
            continue
        await ctx.call(effect, f"{got.name}-{draft}")
        ctx.publish("outcome", got.name)
        return {"outcome": got.name, "by": got.data, "draft": draft, "edits": edits}


# --- compensate and still finish -----------------------------------------------------------------


@app.saga(name="trip")
async def trip(ctx: SagaContext, items: list[str]) -> dict[str, str]:
    """Books each item, then a flight that is refused: undo the bookings and answer."""
    try:
        for item in items:
            await ctx.call(effect, item)
        await ctx.call(refuse, "flight")
    except StepFailedError:
        await ctx.compensate()
        ctx.publish("status", "failure")
        return {"status": "failure"}
    return {"status": "success"}


# --- long steps: heartbeats and cancellation -----------------------------------------------------


@app.saga(name="long")
async def long(ctx: SagaContext, name: str) -> str:
    await ctx.call(effect, f"{name}-before")
    ctx.publish("phase", "long job")
    return await ctx.call(long_job, name)


@app.saga(name="silent")
async def silent_saga(ctx: SagaContext, name: str) -> int:
    return await ctx.call(silent, name)


# --- cancellation delivered into saga code (issue 25, item 13) ----------------------------------


def released(name: str) -> bool:
    """Whether the test let the step ``name`` finish (a mark ``<name> release``)."""
    with ledger() as conn:
        conn.execute("create table if not exists marks (what text)")
        row = conn.execute("select 1 from marks where what = ?", (f"{name} release",)).fetchone()
    return row is not None


@app.step(queue="work", retry=FAST)
def held_cleanup(ctx: StepContext, name: str) -> str:
    """A cleanup step that runs until the test releases it (LONG_JOB_LIMIT at most)."""
    _record(ctx, name)
    mark(f"{name} cleaning")
    deadline = time.monotonic() + LONG_JOB_LIMIT
    while not released(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"{name}:cleaned"


@app.saga(name="tidy", cancel_grace=timedelta(minutes=5))
async def tidy(ctx: SagaContext, name: str) -> None:
    """Cleans up in its ``finally`` when cancelled: a step the test holds, then another."""
    await ctx.call(effect, f"{name}-before")
    try:
        await ctx.wait_for_event("never", timeout=WAIT)
    finally:
        await ctx.call(held_cleanup, name)
        await ctx.call(effect, f"{name}-after")
