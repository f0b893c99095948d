"""The app of the integration tests, run by real `sagaloop engine` and `sagaloop worker`
processes. Effects land in a ledger outside the engine (a SQLite file named by $LEDGER_PATH)
that honours idempotency keys, and every execution of a step body is counted there."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from datetime import timedelta

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext

app = App("itapp")
FAST = RetryPolicy(max_attempts=6, initial_interval=timedelta(milliseconds=100))


def ledger() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60, isolation_level=None)
    conn.execute("pragma journal_mode=wal")
    conn.execute("create table if not exists effects (key text primary key, step text)")
    conn.execute("create table if not exists undos (key text primary key, step text, seq int)")
    conn.execute("create table if not exists bodies (step text, key text, attempt int)")
    return conn


def _record(ctx: StepContext, step: str, *, undo: bool = False) -> None:
    with ledger() as conn:
        conn.execute(
            "insert into bodies values (?, ?, ?)", (step, ctx.idempotency_key, ctx.attempt)
        )
        if undo:
            conn.execute(
                "insert or ignore into undos values (?, ?, (select count(*) from undos))",
                (ctx.idempotency_key, step),
            )
        else:
            conn.execute("insert or ignore into effects values (?, ?)", (ctx.idempotency_key, step))
    delay = float(os.environ.get("STEP_DELAY", "0"))
    if delay:
        time.sleep(delay)


@app.step(queue="work", retry=FAST)
def effect(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    return f"{name}:done"


@effect.compensation
def undo_effect(ctx: StepContext, name: str, result: str) -> None:
    _record(ctx, name, undo=True)


@effect.reconcile
def find_effect(ctx: StepContext, name: str) -> str | None:
    with ledger() as conn:
        row = conn.execute("select 1 from effects where key = ?", (ctx.idempotency_key,)).fetchone()
    return f"{name}:done" if row else None


@app.step(queue="other", retry=FAST)
def refuse(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    raise ApplicationError(f"{name} refused", non_retryable=True)


@app.step(queue="work", retry=FAST)
def audit(ctx: StepContext, name: str) -> str:
    _record(ctx, f"audit-{name}")
    return "audited"


@app.saga(name="sequence")
async def sequence(ctx: SagaContext, names: list[str]) -> list[str]:
    if os.environ.get("ITAPP_CHANGED"):  # a deploy that changed the saga's code in flight
        await ctx.call(audit, names[0])
    return [await ctx.call(effect, n) for n in names]


@app.saga(name="fan-out")
async def fan_out(ctx: SagaContext, names: list[str]) -> list[str]:
    return list(await asyncio.gather(*(ctx.call(effect, n) for n in names)))


@app.saga(name="then-fail")
async def then_fail(ctx: SagaContext, names: list[str]) -> None:
    for n in names:
        await ctx.call(effect, n)
    await ctx.call(refuse, "refuse")


@app.saga(name="waiter")
async def waiter(ctx: SagaContext, name: str) -> str:
    first = await ctx.call(effect, name)
    reply = await ctx.wait_for_event("go", timeout=timedelta(days=2))
    second = await ctx.call(effect, f"{name}-after")
    return f"{first}|{reply}|{second}"


@app.saga(name="loop")
async def loop(ctx: SagaContext, n: int) -> int:
    total = 0
    for i in range(n):
        await ctx.call(effect, f"it{i}")
        total += 1
    return total
