"""Updates (``ctx.on_update``) for real `sagaloop engine` / `sagaloop worker` processes: an
account whose ``deposit`` update books the deposit with a step on the ``work`` queue (held
until the test opens its gate: the file named by the step's input) and answers the new
balance. Steps write to itapp's ledger ($LEDGER_PATH), so effects are counted from outside."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from itapp import FAST, _record
from primitives_app import mark

from sagaloop import App, SagaContext, StepContext

app = App("updates_app")
GATE_LIMIT = 90.0  # seconds a booking waits for its gate at most


@app.step(queue="work", retry=FAST)
def book(ctx: StepContext, booking: dict[str, Any]) -> int:
    """Book a deposit once its gate (a file) exists: the test kills the engine meanwhile."""
    mark(f"{booking['id']} booking")
    gate, deadline = Path(booking["gate"]), time.monotonic() + GATE_LIMIT
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    _record(ctx, booking["id"])
    return int(booking["amount"])


@app.saga(name="account")
async def account(ctx: SagaContext, gate: str) -> int:
    balance = [0]
    closed: list[bool] = []

    def positive(d: dict[str, Any]) -> None:
        if d["amount"] <= 0:
            raise ValueError(f"a deposit is positive, not {d['amount']}")

    async def deposit(d: dict[str, Any]) -> int:
        booked = await ctx.call(book, {"id": d["id"], "amount": d["amount"], "gate": gate})
        balance[0] += booked
        return balance[0]

    ctx.on_update("deposit", deposit, validator=positive)
    ctx.on_update("close", lambda _: closed.append(True) or balance[0])
    await ctx.wait_condition(lambda: bool(closed) and ctx.all_handlers_finished())
    return balance[0]
