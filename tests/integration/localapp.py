"""An app of in-process steps for tests/integration/test_local_processes.py: a non-idempotent
charge with a reconcile, writing to itapp's ledger; ``HANG_ON`` names an item whose body hangs
after its effect (so that a test can kill the engine running it)."""

from __future__ import annotations

import os
import time

from itapp import FAST, _record, ledger

from sagaloop import App, SagaContext, StepContext

app = App("localapp")


@app.step(local=True, idempotent=False, retry=FAST)
def charge(ctx: StepContext, item: str) -> str:
    _record(ctx, item)
    if os.environ.get("HANG_ON") == item:
        time.sleep(600)  # killed meanwhile
    return f"{item}:charged"


@charge.reconcile
def find_charge(ctx: StepContext, item: str) -> str | None:
    with ledger() as conn:
        row = conn.execute("select 1 from effects where key = ?", (ctx.idempotency_key,)).fetchone()
    return f"{item}:found" if row else None


@app.saga(name="pay")
async def pay(ctx: SagaContext, items: list[str]) -> list[str]:
    return [await ctx.call(charge, item) for item in items]
