"""The app of the rate-limit process test: a fan-out of calls to a "provider" limited to 10
starts per second. Each body records when it started, in which process, and whether its
attempt was in doubt, in a ledger outside the engine (a SQLite file named by $LEDGER_PATH)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time

from sagaloop import App, RetryPolicy, SagaContext, StepContext

app = App("rateapp")


def ledger() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60, isolation_level=None)
    conn.execute("pragma journal_mode=wal")
    conn.execute(
        "create table if not exists starts (key text, at real, pid int, in_doubt int, attempt int)"
    )
    return conn


# idempotent=False without a reconcile: an attempt in doubt would halt its run, so a run that
# completes shows that no give-back of its message was taken for a delivery that died.
@app.step(
    queue="limited", rate_limit="10/s", rate_key="provider", idempotent=False,
    retry=RetryPolicy(max_attempts=1),
)  # fmt: skip
def call_provider(ctx: StepContext, i: int) -> int:
    at = time.time()
    with ledger() as conn:
        conn.execute(
            "insert into starts values (?, ?, ?, ?, ?)",
            (ctx.idempotency_key, at, os.getpid(), int(ctx.in_doubt), ctx.attempt),
        )
    return i


@app.saga(name="burst")
async def burst(ctx: SagaContext, n: int) -> int:
    """``n`` calls at once."""
    return sum(await asyncio.gather(*[ctx.call(call_provider, i) for i in range(n)]))
