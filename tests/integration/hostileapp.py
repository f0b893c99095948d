"""An app whose step produces what no reply can carry (an LLM reply cut mid-emoji, an integer
over Python's digit limit) or raises ``KeyboardInterrupt``; each execution of a body lands in a
ledger outside the engine (a SQLite file named by $LEDGER_PATH)."""

from __future__ import annotations

import os
import sqlite3
from datetime import timedelta
from typing import Any

from sagaloop import App, RetryPolicy, SagaContext, StepContext

app = App("hostileapp")
TWICE = RetryPolicy(max_attempts=2, initial_interval=timedelta(milliseconds=100))


def record(step: str, what: str, attempt: int) -> None:
    with sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60, isolation_level=None) as conn:
        conn.execute("create table if not exists bodies (step text, what text, attempt int)")
        conn.execute("insert into bodies values (?, ?, ?)", (step, what, attempt))


@app.step(queue="work", retry=TWICE)
def book(ctx: StepContext, what: str) -> str:
    record("book", what, ctx.attempt)
    return f"booked {what}"


@book.compensation
def unbook(ctx: StepContext, what: str, result: str | None) -> None:
    record("unbook", what, ctx.attempt)


@app.step(queue="work", retry=TWICE)
def produce(ctx: StepContext, what: str) -> Any:
    record("produce", what, ctx.attempt)
    if what == "lone_surrogate":
        return "the reply was cut mid-emoji \ud83d"
    if what == "huge_int":
        return 10**5000
    if what == "keyboard_interrupt":
        raise KeyboardInterrupt
    return what


@app.saga(name="produce")
async def produce_saga(ctx: SagaContext, what: str) -> Any:
    await ctx.call(book, what)
    return await ctx.call(produce, what)
