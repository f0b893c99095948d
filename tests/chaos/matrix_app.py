"""The sagas the crash matrix needs that tests/integration/itapp.py lacks: effects with durable
sleeps between them, so that the timer scheduler has timers to fire; in-process versions
(``local=True``: run by the engine's ``local-N`` threads) of itapp's ``effect`` and ``refuse``
and of its "sequence" and "then-fail" sagas, for the ``local.*`` crash points; and the
primitives of issue 11 (child runs, runs started and messaged by a run, continue-as-new, a long
step cancelled through its heartbeats), driven by matrix_primitives.py. Their steps write to
itapp's ledger (same file, same tables) with itapp's helpers, so effects are counted from
outside; what the long step saw goes to the ledger's ``marks`` table."""

from __future__ import annotations

import time
from datetime import timedelta

from itapp import FAST, _record, ledger

from sagaloop import (
    App,
    ApplicationError,
    Debounce,
    RetryPolicy,
    SagaContext,
    StepCancelled,
    StepContext,
)

app = App("matrix_app")
NAP = timedelta(seconds=0.5)


@app.step(queue="work", retry=FAST)
def effect(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    return f"{name}:done"


@effect.reconcile
def find_effect(ctx: StepContext, name: str) -> str | None:
    with ledger() as conn:
        row = conn.execute("select 1 from effects where key = ?", (ctx.idempotency_key,)).fetchone()
    return f"{name}:done" if row else None


@app.saga(name="naps")
async def naps(ctx: SagaContext, names: list[str]) -> list[str]:
    """``effect(names[0])``, then a durable sleep before each further effect."""
    done = [await ctx.call(effect, names[0])]
    for name in names[1:]:
        await ctx.sleep(NAP)
        done.append(await ctx.call(effect, name))
    return done


# --- in-process steps (the local.* crash points): itapp's effect, refuse and sagas, local=True --


@app.step(local=True, retry=FAST)
def local_effect(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    return f"{name}:done"


@local_effect.compensation
def undo_local_effect(ctx: StepContext, name: str, result: str) -> None:
    _record(ctx, name, undo=True)


@local_effect.reconcile
def find_local_effect(ctx: StepContext, name: str) -> str | None:
    with ledger() as conn:
        row = conn.execute("select 1 from effects where key = ?", (ctx.idempotency_key,)).fetchone()
    return f"{name}:done" if row else None


@app.step(local=True, retry=FAST)
def local_refuse(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    raise ApplicationError(f"{name} refused", non_retryable=True)


@app.saga(name="local-sequence")
async def local_sequence(ctx: SagaContext, names: list[str]) -> list[str]:
    return [await ctx.call(local_effect, n) for n in names]


@app.saga(name="local-then-fail")
async def local_then_fail(ctx: SagaContext, names: list[str]) -> None:
    for n in names:
        await ctx.call(local_effect, n)
    await ctx.call(local_refuse, "refuse")


# --- the primitives of issue 11 (tests/chaos/matrix_primitives.py) ------------------------------

WAIT = timedelta(minutes=10)  # event timeouts that never fire in a test
LONG_JOB_LIMIT = 90.0  # seconds: the long step gives up (and says so) if never cancelled


def mark(what: str) -> None:
    with ledger() as conn:
        conn.execute("create table if not exists marks (what text)")
        conn.execute("insert into marks values (?)", (what,))


@app.saga(name="kid")
async def kid(ctx: SagaContext, name: str) -> str:
    return await ctx.call(effect, name)


@app.saga(name="family")
async def family(ctx: SagaContext, names: list[str]) -> list[str]:
    """A child run per name, one after the other."""
    return [await ctx.call(kid, n) for n in names]


@app.saga(name="helper")
async def helper(ctx: SagaContext, job: str) -> str:
    boss_id = await ctx.wait_for_event("boss", timeout=WAIT)
    result = await ctx.call(effect, job)
    ctx.send_event(boss_id, "done", result)
    return result


@app.saga(name="boss")
async def boss(ctx: SagaContext, jobs: list[str]) -> list[str]:
    """Starts a helper run per job and tells it who the boss is; collects their answers."""
    for job in jobs:
        ctx.send_event(ctx.start(helper, job), "boss", ctx.run_id)
    return sorted([await ctx.wait_for_event("done", timeout=WAIT) for _ in jobs])


@app.saga(name="cycle")
async def cycle(ctx: SagaContext, names: list[str]) -> str:
    """One effect per history: continue as new with the names left."""
    done = await ctx.call(effect, names[0])
    if len(names) == 1:
        return done
    ctx.continue_as_new(names[1:])


@app.step(queue="work", retry=FAST)
def reserve(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    return f"{name}:done"


@reserve.compensation
def release(ctx: StepContext, name: str, result: str | None) -> None:
    _record(ctx, name, undo=True)


@reserve.reconcile
def find_reserve(ctx: StepContext, name: str) -> str | None:
    with ledger() as conn:
        row = conn.execute("select 1 from effects where key = ?", (ctx.idempotency_key,)).fetchone()
    return f"{name}:done" if row else None


@app.step(queue="work", retry=RetryPolicy(max_attempts=1), heartbeat_timeout=timedelta(seconds=30))
def long_job(ctx: StepContext, name: str) -> str:
    """Runs until told to stop through `ctx.heartbeat()`; its `finally` runs."""
    _record(ctx, name)
    mark(f"{name} started")
    try:
        deadline = time.monotonic() + LONG_JOB_LIMIT
        while time.monotonic() < deadline:
            ctx.heartbeat()
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


@app.saga(name="long")
async def long(ctx: SagaContext, name: str) -> str:
    """A reservation, then a long step that runs until the run is cancelled."""
    await ctx.call(reserve, f"{name}-before")
    return await ctx.call(long_job, name)


# --- debounce (issue 25): the crash point debounce.before_commit ------------------------------


@app.saga(name="debounced", debounce=Debounce(timedelta(seconds=0.5)))
async def debounced(ctx: SagaContext, names: list[str]) -> list[str]:
    """itapp's sequence, its starts debounced: a burst of starts makes one run, the last's."""
    return [await ctx.call(effect, n) for n in names]


@app.saga(name="tidy")
async def tidy(ctx: SagaContext, name: str) -> str:
    """``long`` with a ``finally`` that calls a step: the cancel is delivered into the code,
    which tidies up before the run is compensated (issue 25, item 13)."""
    await ctx.call(reserve, f"{name}-before")
    try:
        return await ctx.call(long_job, name)
    finally:
        await ctx.call(reserve, f"{name}-tidied")
