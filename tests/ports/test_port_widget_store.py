"""Port of DBOS's widget store (its checkout and order dispatch workflows).

Original: github.com/dbos-inc/dbos-demo-apps, commit 90064b85b5838e403c006c077afdc09bea70f348,
``python/widget-store/widget_store/main.py``, tested by
``python/widget-store/tests/test_widget_store.py`` (``test_checkout_workflow``).

What maps to what:

- each database transaction run by ``ds.run_tx_step`` (``create_order``,
  ``reserve_inventory``, ``undo_reserve_inventory``, ``update_order_status``,
  ``update_order_progress``) -> a step; the database itself -> the ``Shop`` object below, in
  memory (the original's test replaces every transaction with a mock anyway);
- ``DBOS.set_event(key, value)`` -> ``ctx.publish(key, value)``; ``DBOS.get_event`` (what the
  checkout and payment endpoints wait for) -> ``Client.get_published``;
- ``DBOS.recv("payment_status")`` and ``DBOS.send(payment_id, status, "payment_status")`` ->
  ``ctx.wait_for_event("payment_status")`` and ``Client.send_event``; the payment id is the
  run id, as the workflow id is in the original;
- ``DBOS.start_workflow(dispatch_order_workflow, order_id)`` -> ``ctx.start(dispatch_order,
  order_id)`` (fire-and-forget), ``DBOS.sleep(1)`` -> ``ctx.sleep``;
- ``SetWorkflowID(idempotency_key)`` -> ``Client.start(..., run_id=idempotency_key)``;
- the test's ``MagicMock`` per transaction -> the same mocks, put in place with
  ``Harness.override``; the patched ``DBOS.recv`` returning ``"paid"`` -> the event sent by the
  test; the patched ``DBOS.start_workflow`` -> the run the saga started, read from the store.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from enum import IntEnum
from typing import Any
from unittest.mock import MagicMock

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness

app = App("port-widget-store")

PAYMENT_STATUS = "payment_status"
PAYMENT_ID = "payment_id"
ORDER_ID = "order_id"


class OrderStatus(IntEnum):
    CANCELLED = -1
    PENDING = 0
    DISPATCHED = 1
    PAID = 2


class Shop:
    """The widget store's two tables, in memory: one product's inventory, and the orders."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inventory = 100
        self.orders: dict[int, dict[str, int]] = {}


shop = Shop()


@app.step()
def create_order(ctx: StepContext) -> int:
    with shop.lock:
        order_id = len(shop.orders) + 1
        shop.orders[order_id] = {
            "order_status": OrderStatus.PENDING.value,
            "progress_remaining": 10,
        }
        return order_id


@app.step()
def reserve_inventory(ctx: StepContext) -> bool:
    with shop.lock:
        if shop.inventory <= 0:
            return False
        shop.inventory -= 1
        return True


@app.step()
def undo_reserve_inventory(ctx: StepContext) -> None:
    with shop.lock:
        shop.inventory += 1


@app.step()
def update_order_status(ctx: StepContext, order_id: int, status: int) -> None:
    with shop.lock:
        shop.orders[order_id]["order_status"] = status


@app.step()
def update_order_progress(ctx: StepContext, order_id: int) -> None:
    with shop.lock:
        order = shop.orders[order_id]
        order["progress_remaining"] -= 1
        if order["progress_remaining"] == 0:  # dispatch the fully-progressed order
            order["order_status"] = OrderStatus.DISPATCHED.value


@app.saga(name="dispatch-order")
async def dispatch_order(ctx: SagaContext, order_id: int) -> None:
    for _ in range(10):
        await ctx.sleep(timedelta(seconds=1))
        await ctx.call(update_order_progress, order_id)


@app.saga(name="checkout")
async def checkout(ctx: SagaContext) -> None:
    order_id = await ctx.call(create_order)

    # Reserve inventory, cancelling the order if none remains.
    if not await ctx.call(reserve_inventory):
        ctx.logger.error("failed to reserve inventory for order %s", order_id)
        await ctx.call(update_order_status, order_id=order_id, status=OrderStatus.CANCELLED.value)
        ctx.publish(PAYMENT_ID, None)
        return

    # The checkout endpoint redirects the customer to the payment page of this id.
    ctx.publish(PAYMENT_ID, ctx.run_id)
    payment_status = await ctx.wait_for_event(PAYMENT_STATUS)

    if payment_status == "paid":
        ctx.logger.info("payment successful for order %s", order_id)
        await ctx.call(update_order_status, order_id=order_id, status=OrderStatus.PAID.value)
        ctx.start(dispatch_order, order_id)
    else:
        ctx.logger.warning("payment failed for order %s", order_id)
        await ctx.call(undo_reserve_inventory)
        await ctx.call(update_order_status, order_id=order_id, status=OrderStatus.CANCELLED.value)

    # The payment endpoint redirects the customer to the status page of this order.
    ctx.publish(ORDER_ID, str(order_id))


def test_checkout_workflow() -> None:
    """Use mocks to test that the checkout saga correctly handles a checkout whose payment
    succeeds."""
    order_id = 123

    # A mock for each of the saga's database transactions.
    mock_create_order = MagicMock(return_value=order_id)
    mock_reserve_inventory = MagicMock(return_value=True)
    # (a step's result is validated against its annotation: these return None, not a mock)
    mock_undo_reserve_inventory = MagicMock(return_value=None)
    mock_update_order_status = MagicMock(return_value=None)

    def mocked(mock: MagicMock) -> Any:
        return lambda ctx, **kwargs: mock(**kwargs)

    env = Harness(app)
    env.override(create_order, mocked(mock_create_order))
    env.override(reserve_inventory, mocked(mock_reserve_inventory))
    env.override(undo_reserve_inventory, mocked(mock_undo_reserve_inventory))
    env.override(update_order_status, mocked(mock_update_order_status))

    run_id = env.start(checkout, run_id="idempotency-key-1")
    env.run_until_idle(skip_time=False)
    # The run waits for the payment webhook (the original patches DBOS.recv to answer it).
    assert env.get(run_id).status == "waiting"
    waits = [e.name for e in env.history(run_id) if e.kind == h.EVENT_WAITING]
    assert waits == [PAYMENT_STATUS]
    assert env.client.get_published(run_id, PAYMENT_ID) == run_id
    env.send_event(env.client.get_published(run_id, PAYMENT_ID), PAYMENT_STATUS, "paid")
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) is None
    assert env.client.get_published(run_id, ORDER_ID) == str(order_id)

    # Verify an order was created and inventory was reserved for it
    mock_create_order.assert_called_once_with()
    mock_reserve_inventory.assert_called_once_with()

    # Verify the saga waited for the payment webhook, once
    waits = [e.name for e in env.history(run_id) if e.kind == h.EVENT_WAITING]
    assert waits == [PAYMENT_STATUS]

    # Verify the paid order was marked paid and handed to the dispatch saga
    mock_update_order_status.assert_called_once_with(
        order_id=order_id, status=OrderStatus.PAID.value
    )
    started = [e for e in env.history(run_id) if e.kind == h.RUN_SPAWNED]
    assert len(started) == 1
    dispatches = env.client.list(saga="dispatch-order")
    assert [(r.run_id, r.input) for r in dispatches] == [(started[0].data["run_id"], order_id)]

    # Verify that because payment succeeded, inventory was never returned
    mock_undo_reserve_inventory.assert_not_called()
