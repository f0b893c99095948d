"""Published events (issue 25 item 1) for real `sagaloop engine` / `sagaloop dev` processes:
runs that wait on a key, on a predicate, that subscribe, and a saga started by an event. No
steps: what the tests check is in the runs' histories and outputs."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sagaloop import App, SagaContext

app = App("publish_app")
WAIT = timedelta(minutes=10)  # never fires in a test


@app.saga(name="waiter")
async def waiter(ctx: SagaContext, order: str) -> Any:
    """Waits for the payment of its order: an event published with the order as its key."""
    return await ctx.wait_for_event("order.paid", key=order, timeout=WAIT)


@app.saga(name="watcher")
async def watcher(ctx: SagaContext, user: str) -> Any:
    """Waits for the sign-up of its user: a predicate on the data, no key."""
    return await ctx.wait_for_event("user.signed_up", match=lambda d: d["user"] == user)


@app.saga(name="collector")
async def collector(ctx: SagaContext, count: int) -> list[Any]:
    """Subscribes, then takes ``count`` events of its subscription."""
    ctx.subscribe("tick", key="clock")
    return [await ctx.wait_for_event("tick", timeout=WAIT) for _ in range(count)]


@app.saga(name="on_order", on_event="order.placed", run_id=lambda e: f"placed-{e.data['id']}")
async def on_order(ctx: SagaContext, order: dict[str, Any]) -> Any:
    """One run per order placed, named after the order."""
    return order
