"""An app whose payment waits for a person's approval, run by real `sagaloop engine` and
`sagaloop worker` processes; each charge lands in a ledger outside the engine (a SQLite file
named by $LEDGER_PATH), once per idempotency key."""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from sagaloop import App, SagaContext, StepContext

app = App("approvalapp")


@app.step(queue="work")
def charge(ctx: StepContext, cents: int) -> int:
    conn = sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60, isolation_level=None)
    with conn:
        conn.execute("create table if not exists charges (key text primary key, cents int)")
        conn.execute("insert or ignore into charges values (?, ?)", (ctx.idempotency_key, cents))
    conn.close()
    return cents


@app.saga(name="pay")
async def pay(ctx: SagaContext, cents: int) -> dict[str, Any]:
    ok = await ctx.approval("charge", {"cents": cents}, reason="a customer asked for it")
    if not ok.approved:
        return {"approved": False, "reason": ok.reason, "by": ok.by}
    return {"approved": True, "cents": await ctx.call(charge, **ok.args), "by": ok.by}
