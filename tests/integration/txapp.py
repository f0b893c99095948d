"""The app of the transactional-step process tests: its steps write to the app's own table
(``tx_orders``) in the store's PostgreSQL database through ``ctx.transaction``. Each run of a
step body is also counted in a ledger outside that database (a SQLite file named by
$LEDGER_PATH), so that a test sees a body that ran but whose writes were rolled back."""

from __future__ import annotations

import os
import sqlite3
from datetime import timedelta

import sqlalchemy as sa

from sagaloop import App, RetryPolicy, SagaContext, StepContext

app = App("txapp")
FAST = RetryPolicy(max_attempts=6, initial_interval=timedelta(milliseconds=100))
meta = sa.MetaData()
orders = sa.Table(
    "tx_orders",
    meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("item", sa.String, nullable=False),
)


def count_body(step: str, item: str) -> None:
    with sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60, isolation_level=None) as conn:
        conn.execute("create table if not exists bodies (step text, item text)")
        conn.execute("insert into bodies values (?, ?)", (step, item))


@app.step(queue="work", retry=FAST, transactional=True)
def reserve(ctx: StepContext, item: str) -> int:
    assert ctx.transaction is not None
    count_body("reserve", item)
    inserted = ctx.transaction.execute(orders.insert(), {"item": item})
    return int(inserted.inserted_primary_key[0])


@app.step(
    queue="work",
    retry=RetryPolicy(max_attempts=1),
    transactional=True,
    timeout=timedelta(seconds=1),
)
def slow_reserve(ctx: StepContext, item: str) -> int:
    assert ctx.transaction is not None
    count_body("slow_reserve", item)
    inserted = ctx.transaction.execute(orders.insert(), {"item": item})
    ctx.transaction.execute(sa.text("select pg_sleep(30)"))
    return int(inserted.inserted_primary_key[0])


@app.saga(name="reserve-all")
async def reserve_all(ctx: SagaContext, items: list[str]) -> list[int]:
    return [await ctx.call(reserve, item) for item in items]


@app.saga(name="reserve-slowly")
async def reserve_slowly(ctx: SagaContext, item: str) -> int:
    return await ctx.call(slow_reserve, item)
