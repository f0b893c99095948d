"""The app of tests/chaos/test_takeover_dev.py: one step on a queue and one in-process step,
each of which hangs on its first delivery (the test SIGKILLs the process there) and records
every run of its body in a ledger outside the engine ($LEDGER_PATH)."""

from __future__ import annotations

import os
import sqlite3
import time

from sagaloop import App, SagaContext, StepContext

app = App("takeoverapp")


def _hang_once(ctx: StepContext, step: str) -> str:
    with sqlite3.connect(os.environ["LEDGER_PATH"], timeout=30, isolation_level=None) as conn:
        conn.execute("create table if not exists bodies (step text, at real, in_doubt int)")
        conn.execute("insert into bodies values (?, ?, ?)", (step, time.time(), ctx.in_doubt))
    if not ctx.in_doubt:
        time.sleep(3600)  # the test SIGKILLs the process here
    return step


@app.step(queue="work")
def remote(ctx: StepContext) -> str:
    return _hang_once(ctx, "remote")


@app.step(local=True)
def inline(ctx: StepContext) -> str:
    return _hang_once(ctx, "inline")


@app.saga(name="remote")
async def remote_saga(ctx: SagaContext) -> str:
    return await ctx.call(remote)


@app.saga(name="inline")
async def inline_saga(ctx: SagaContext) -> str:
    return await ctx.call(inline)
