"""An app whose step hands its attempt to an outside system (``ctx.complete_async()``), for
tests/integration/test_async_completion_processes.py; its body is recorded in itapp's ledger."""

from __future__ import annotations

from datetime import timedelta

from itapp import _record

from sagaloop import App, RetryPolicy, SagaContext, StepContext

app = App("handoffapp")


@app.step(queue="work", timeout=timedelta(hours=1), retry=RetryPolicy(max_attempts=2))
def ask_outside(ctx: StepContext, what: str) -> str:
    _record(ctx, "ask_outside")
    ctx.complete_async()


@app.saga(name="handoff")
async def handoff(ctx: SagaContext, what: str) -> str:
    answer = await ctx.call(ask_outside, what)
    return f"{what}: {answer}"
