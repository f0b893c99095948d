"""Version 1 of the app of tests/integration/test_deploys.py: reserve, wait to be paid, ship.
Each step writes a row to the ledger at LEDGER_PATH, so the test counts what ran."""

from __future__ import annotations

import os
import sqlite3

from sagaloop import App, SagaContext, StepContext

app = App("deploys")


def ledger(step: str, order: str) -> str:
    with sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60) as conn:
        conn.execute("create table if not exists effects (step text, order_id text)")
        conn.execute("insert into effects values (?, ?)", (step, order))
    return f"{step} {order}"


@app.step()
def reserve(ctx: StepContext, order: str) -> str:
    return ledger("reserve", order)


@app.step()
def ship(ctx: StepContext, order: str) -> str:
    return ledger("ship", order)


@app.saga(name="order")
async def order(ctx: SagaContext, order: str) -> list[str]:
    done = [await ctx.call(reserve, order)]
    await ctx.wait_for_event("paid")
    done.append(await ctx.call(ship, order))
    return done
