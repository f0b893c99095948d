"""The app that tests/chaos kills: three steps whose effects land in a ledger outside the engine
(a SQLite file named by $LEDGER_PATH), like a payment provider that honours idempotency keys."""

from __future__ import annotations

import os
import sqlite3
import time
from datetime import timedelta

from sagaloop import App, RetryPolicy, SagaContext, StepContext

app = App("killapp")
FAST = RetryPolicy(max_attempts=5, initial_interval=timedelta(milliseconds=100))


def ledger() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ["LEDGER_PATH"], timeout=30, isolation_level=None)
    conn.execute("create table if not exists effects (key text primary key, step text)")
    conn.execute(
        "create table if not exists runs_of_body (step text, key text, attempt int, in_doubt int)"
    )
    return conn


def _body(ctx: StepContext, step: str) -> None:
    with ledger() as conn:
        conn.execute(
            "insert into runs_of_body values (?, ?, ?, ?)",
            (step, ctx.idempotency_key, ctx.attempt, int(ctx.in_doubt)),
        )


def _effect(ctx: StepContext, step: str) -> None:
    with ledger() as conn:  # the provider honours idempotency keys
        conn.execute("insert or ignore into effects values (?, ?)", (ctx.idempotency_key, step))


def _wait_for_kill(ctx: StepContext, where: str) -> None:
    if os.environ.get("HANG_AT") == where and not ctx.in_doubt:
        time.sleep(3600)  # the test SIGKILLs the process here


@app.step(queue="work", retry=FAST)
def one(ctx: StepContext, order: str) -> str:
    _body(ctx, "one")
    _effect(ctx, "one")
    return f"{order}-1"


@app.step(queue="work", retry=FAST)
def two(ctx: StepContext, order: str) -> str:
    _body(ctx, "two")
    _wait_for_kill(ctx, "two-before-effect")
    _effect(ctx, "two")
    _wait_for_kill(ctx, "two-after-effect")
    return f"{order}-2"


@two.reconcile
def find_two(ctx: StepContext, order: str) -> str | None:
    with ledger() as conn:
        row = conn.execute("select 1 from effects where key = ?", (ctx.idempotency_key,)).fetchone()
    return f"{order}-2" if row else None


@app.step(queue="work", retry=FAST)
def three(ctx: StepContext, order: str) -> str:
    _body(ctx, "three")
    _effect(ctx, "three")
    return f"{order}-3"


@app.saga(name="three-steps")
async def three_steps(ctx: SagaContext, order: str) -> list[str]:
    return [
        await ctx.call(one, order),
        await ctx.call(two, order),
        await ctx.call(three, order),
    ]
