"""Small primitives that workflows ported from other engines need (issue 25): published values
that survive ``continue_as_new``, the failed step's error type as a field of the run's error, a
timeout on a child call, ``ctx.deprecate_patch`` and ``ctx.started_by``."""

from __future__ import annotations

import pytest

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.errors import ApplicationError, ErrorInfo, SagaFailedError, StepFailedError
from sagaloop.testing import Harness

# --- published values survive continue_as_new ----------------------------------------------------

carried = App("carried")


@carried.saga(name="counter")
async def counter(ctx: SagaContext, n: int) -> int:
    if n == 0:
        ctx.publish("first", "from the first history")
    ctx.publish("n", n)
    if n < 2:
        ctx.continue_as_new(n + 1)
    await ctx.wait_for_event("stop")
    ctx.publish("first", "overwritten")
    return n


def test_published_values_survive_continue_as_new_until_overwritten() -> None:
    env = Harness(carried)
    run_id = env.start(counter, 0)
    env.run_until_idle()
    history = env.history(run_id)
    assert history[0].kind == h.RUN_STARTED and history[0].data["epoch"] == 2
    assert not any(e.kind == h.PUBLISHED and e.name == "first" for e in history)
    assert env.client.get_published(run_id, "first") == "from the first history"
    assert env.client.get_published(run_id, "n") == 2
    assert env.status(run_id).published == {"first": "from the first history", "n": 2}
    env.restart()  # folded from the stored history alone
    assert env.client.get_published(run_id, "first") == "from the first history"
    env.send_event(run_id, "stop")
    env.run_until_idle()
    assert env.result(run_id) == 2
    assert env.client.get_published(run_id, "first") == "overwritten"


# --- the failed step's or child's error as fields of the run's error -----------------------------

failing = App("failing")


class OrderFailed(Exception):
    pass


@failing.step(retry=RetryPolicy(max_attempts=1))
def charge(ctx: StepContext, amount: int) -> int:
    raise ApplicationError(f"card declined for {amount}", type="CardDeclined", non_retryable=True)


@failing.saga(name="pay")
async def pay(ctx: SagaContext, amount: int) -> int:
    try:
        return await ctx.call(charge, amount)
    except StepFailedError as e:
        ctx.publish("seen", [e.step, e.cause_type, e.cause_message])
        if amount > 100:
            raise OrderFailed("the order could not be paid") from e
        raise


@failing.saga(name="checkout")
async def checkout(ctx: SagaContext, amount: int) -> int:
    return await ctx.call(pay, amount)


def test_the_run_error_names_the_failed_step_and_its_error_type() -> None:
    env = Harness(failing)
    run_id = env.start(pay, 5)
    env.run_until_idle()
    assert env.client.get_published(run_id, "seen") == [
        "charge",
        "CardDeclined",
        "card declined for 5",
    ]
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.type == "StepFailedError"
    assert error.step == "charge"
    assert error.cause is not None and error.cause.type == "CardDeclined"
    assert error.cause.message == "card declined for 5" and error.cause.non_retryable
    assert error.cause.traceback is None  # the step's own is in its step_failed event
    assert error.root_cause is error.cause
    stored = env.get(run_id).error
    assert stored is not None and stored["cause"]["type"] == "CardDeclined"


def test_an_error_raised_from_the_step_failure_keeps_it_as_its_cause() -> None:
    env = Harness(failing)
    run_id = env.start(pay, 500)
    env.run_until_idle()
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.type == "OrderFailed"
    assert error.step == "charge" and error.cause is not None
    assert error.cause.type == "CardDeclined"


def test_a_failed_child_run_chains_its_own_error_down_to_the_step() -> None:
    env = Harness(failing)
    run_id = env.start(checkout, 5)
    env.run_until_idle()
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.step == "pay"
    assert error.cause is not None and error.cause.type == "StepFailedError"  # the child's
    assert error.cause.step == "charge"
    assert error.root_cause.type == "CardDeclined"
    assert ErrorInfo.from_json(error.to_json()).root_cause.type == "CardDeclined"
