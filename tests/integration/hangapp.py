"""An app of in-process steps for tests/integration/test_step_timeouts_processes.py: ``hang``
ignores its timeout of 1 s (a sync body that sleeps for 10 minutes), ``canary`` is a quick
timed step; both record their bodies in itapp's ledger."""

from __future__ import annotations

import time
from datetime import timedelta

from itapp import FAST, _record

from sagaloop import App, RetryPolicy, SagaContext, StepContext

app = App("hangapp")


@app.step(local=True, timeout=timedelta(seconds=1), retry=RetryPolicy(max_attempts=1))
def hang(ctx: StepContext, tag: str) -> str:
    _record(ctx, f"hang-{tag}")
    time.sleep(600)  # past its timeout: abandoned, never killed
    return tag


@app.step(local=True, timeout=timedelta(seconds=2), retry=FAST)
def canary(ctx: StepContext, tag: str) -> str:
    _record(ctx, f"canary-{tag}")
    return f"{tag}:sung"


@app.saga(name="hang")
async def hang_saga(ctx: SagaContext, tag: str) -> str:
    return await ctx.call(hang, tag)


@app.saga(name="canary")
async def canary_saga(ctx: SagaContext, tag: str) -> str:
    return await ctx.call(canary, tag)
