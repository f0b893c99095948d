"""Version 2 of the app of tests/integration/test_deploys.py: a fraud check after the
reservation, for the runs that reach that point with this code (``ctx.patched``). Runs that
passed it with version 1 go on without it."""

from __future__ import annotations

from deploy_v1 import ledger

from sagaloop import App, SagaContext, StepContext

app = App("deploys")


@app.step()
def reserve(ctx: StepContext, order: str) -> str:
    return ledger("reserve", order)


@app.step()
def fraud_check(ctx: StepContext, order: str) -> str:
    return ledger("fraud_check", order)


@app.step()
def ship(ctx: StepContext, order: str) -> str:
    return ledger("ship", order)


@app.saga(name="order")
async def order(ctx: SagaContext, order: str) -> list[str]:
    done = [await ctx.call(reserve, order)]
    if ctx.patched("fraud-check"):
        done.append(await ctx.call(fraud_check, order))
    await ctx.wait_for_event("paid")
    done.append(await ctx.call(ship, order))
    return done
