"""Port of Temporal's update-with-start lazy initialization sample: a shopping cart whose
first ``add_item`` update creates it, and whose later updates go to the cart already there.

Original: github.com/temporalio/samples-python,
``message_passing/update_with_start/lazy_initialization/`` (``workflows.py``:
``ShoppingCartWorkflow``; ``activities.py``: ``get_price``; ``starter.py``:
``handle_add_item_request``) and
``tests/message_passing/lazy_initialization/test_lazy_initialization.py`` (its test, with its
assertions).

What maps to what:

- ``execute_update_with_start_workflow(add_item, item, start_workflow_operation=
  WithStartWorkflowOperation(..., id=cart_id, id_conflict_policy=USE_EXISTING))`` ->
  ``Client.start(cart, run_id=cart_id)`` then ``Client.update(cart_id, "add_item", item)``:
  a start is idempotent per run id (it returns the run already there, which is
  ``USE_EXISTING``), and an update sent once the start is written is delivered after the
  start however the two messages are ordered on the broker (proven below by taking the update
  first), so the pair is the atomic operation's equivalent for a client that retries both;
- ``@workflow.update add_item`` (async: it runs the ``get_price`` activity) with its
  ``@validator`` -> ``ctx.on_update("add_item", ..., validator=..., model=ShoppingCartItem)``;
- ``ApplicationError(type="ItemUnavailableError")`` -> the same ``ApplicationError``; the
  client's ``WorkflowUpdateFailedError`` whose cause has that type -> ``UpdateFailedError``
  whose ``error.type`` is it;
- ``@workflow.signal checkout`` -> ``ctx.on_event("checkout", ...)``;
- ``workflow.wait_condition(lambda: workflow.all_handlers_finished() and submitted)`` -> the
  same with ``ctx``; ``workflow.info().workflow_id`` -> ``ctx.run_id``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from sagaloop import App, ApplicationError, SagaContext, StepContext, UpdateFailedError
from sagaloop.engine.messages import engine_queue
from sagaloop.testing import Harness, replay

# --- activities.py -----------------------------------------------------------------------------


@dataclasses.dataclass
class ShoppingCartItem:
    sku: str
    quantity: int


app = App("port-lazy-initialization")


@app.step()
def get_price(ctx: StepContext, item: ShoppingCartItem) -> int | None:
    price = None if item.sku == "sku-456" else 599
    if price is None:
        return None
    return price * item.quantity


# --- workflows.py ------------------------------------------------------------------------------


@dataclasses.dataclass
class FinalizedOrder:
    id: str
    items: list[tuple[ShoppingCartItem, int]]
    total: int


@app.saga(name="shopping-cart")
async def shopping_cart(ctx: SagaContext) -> FinalizedOrder:
    items: list[tuple[ShoppingCartItem, int]] = []
    order_submitted = False

    async def add_item(item: ShoppingCartItem) -> int:
        price = await ctx.call(get_price, item)
        if price is None:
            raise ApplicationError(f"Item unavailable: {item}", type="ItemUnavailableError")
        items.append((item, price))
        return sum(price for _, price in items)

    def validate_add_item(item: ShoppingCartItem) -> None:
        if order_submitted:
            raise ApplicationError("Order already submitted")

    def checkout(_: Any) -> None:
        nonlocal order_submitted
        order_submitted = True

    ctx.on_update("add_item", add_item, validator=validate_add_item, model=ShoppingCartItem)
    ctx.on_event("checkout", checkout)
    await ctx.wait_condition(lambda: ctx.all_handlers_finished() and order_submitted)
    return FinalizedOrder(id=ctx.run_id, items=items, total=sum(p for _, p in items))


# --- starter.py --------------------------------------------------------------------------------


def handle_add_item_request(
    env: Harness, session_id: str, item_id: str, quantity: int
) -> tuple[int | None, str]:
    """Add an item to the cart of the session, creating the cart if it does not exist yet;
    the price is None when the item is unavailable."""
    cart_id = f"cart-{session_id}"
    env.start(shopping_cart, run_id=cart_id)  # USE_EXISTING: the cart already there, if any
    try:
        price = env.update(cart_id, "add_item", ShoppingCartItem(sku=item_id, quantity=quantity))
    except UpdateFailedError as err:
        if err.error.type == "ItemUnavailableError":
            price = None
        else:
            raise
    return price, cart_id


# --- the sample's test -------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["replay", "cache"])
def env(request: pytest.FixtureRequest) -> Harness:
    return Harness(app, cache=request.param)


def test_shopping_cart_workflow(env: Harness) -> None:
    price, cart_id = handle_add_item_request(env, "-session-1234", "item-1", 2)
    assert price == 1198
    price, same_cart = handle_add_item_request(env, "-session-1234", "item-2", 1)
    assert price == 1797
    assert same_cart == cart_id
    env.send_event(cart_id, "checkout")
    env.run_until_idle()
    finalized_order = env.result(cart_id)
    assert finalized_order.items == [
        (ShoppingCartItem(sku="item-1", quantity=2), 1198),
        (ShoppingCartItem(sku="item-2", quantity=1), 599),
    ]
    assert finalized_order.total == 1797
    assert finalized_order.id == cart_id
    replay(app, env.history(cart_id), run_id=cart_id)


def test_the_starter(env: Harness) -> None:
    """``starter.py``: ``sku-456`` is unavailable, so its subtotal is None."""
    subtotal_1, _ = handle_add_item_request(env, "session-x", "sku-123", 1)
    subtotal_2, cart_id = handle_add_item_request(env, "session-x", "sku-456", 1)
    assert [subtotal_1, subtotal_2] == [599, None]
    env.send_event(cart_id, "checkout")
    env.run_until_idle()
    assert env.result(cart_id).total == 599


def test_the_update_may_reach_the_engine_before_the_start(env: Harness) -> None:
    """Not in the original: the start and the update travel on different queues; an engine
    that takes the update first starts the run's code and delivers the update to it."""
    cart_id = env.start(shopping_cart, run_id="cart-early")
    sent = env.send_update(cart_id, "add_item", ShoppingCartItem(sku="a", quantity=1))
    env.queues = [engine_queue(app.name)]  # not the starts' queue: the update goes first
    env.run_until_idle(skip_time=False)
    assert [e.kind for e in env.history(cart_id)][:2] == ["run_started", "update_accepted"]
    env.queues = None
    assert env.update(cart_id, "add_item", update_id=sent) == 599


def test_an_update_after_checkout_is_refused(env: Harness) -> None:
    """Not in the original's test: a cart checked out (its run completed) refuses an
    update, and the start that comes with it does not open another cart."""
    _, cart_id = handle_add_item_request(env, "late", "sku-1", 1)
    env.send_event(cart_id, "checkout")
    env.run_until_idle()
    assert env.get(cart_id).status == "completed"
    with pytest.raises(UpdateFailedError, match="has ended"):
        handle_add_item_request(env, "late", "sku-2", 1)
