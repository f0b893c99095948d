"""An app of hostile saga code for tests/integration/test_hostile_sagas.py: a saga that never
yields, one that raises a BaseException, and a plain one whose effects a ledger counts."""

from __future__ import annotations

import os
import sqlite3

from sagaloop import App, SagaContext, StepContext

app = App("sagaapp")


def _ledger(what: str) -> None:
    with sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60) as conn:
        conn.execute("create table if not exists effects (step text)")
        conn.execute("insert into effects values (?)", (what,))


@app.step(queue="work")
def effect(ctx: StepContext, name: str) -> str:
    _ledger(name)
    return f"did {name}"


@effect.compensation
def undo_effect(ctx: StepContext, name: str, result: str) -> None:
    _ledger(f"undo {name}")


@app.saga(name="greet")
async def greet(ctx: SagaContext, name: str) -> str:
    return await ctx.call(effect, name)


@app.saga(name="spin")
async def spin(ctx: SagaContext, name: str) -> str:
    await ctx.call(effect, name)
    n = 0
    while True:  # never yields
        n += 1


@app.saga(name="interrupt")
async def interrupt(ctx: SagaContext, name: str) -> str:
    await ctx.call(effect, name)
    raise KeyboardInterrupt("from saga code")


@app.saga(name="stuck")
async def stuck(ctx: SagaContext, seconds: float) -> str:
    import time

    time.sleep(seconds)  # one C call: cannot be interrupted, uses no CPU
    return "woke up"
