"""Unlimited retries with a capped backoff, and the cause chain of a step's error: kept as
data, raised into saga code with StepFailedError, shown by `status`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext, StepFailedError
from sagaloop.errors import ErrorInfo
from sagaloop.testing import Harness

app = App("retries")
calls: list[int] = []


@app.step(retry=RetryPolicy(max_attempts=None, maximum_interval=timedelta(seconds=30)))
def flaky(ctx: StepContext, failures: int) -> int:
    calls.append(ctx.attempt)
    if ctx.attempt <= failures:
        raise ConnectionError(f"down (attempt {ctx.attempt})")
    return ctx.attempt


class PaymentDeclined(ApplicationError):
    pass


@app.step(retry=RetryPolicy(max_attempts=1))
def charge(ctx: StepContext) -> None:
    try:
        try:
            raise TimeoutError("the bank did not answer")
        except TimeoutError as e:
            raise ConnectionError("gateway gave up") from e
    except ConnectionError as e:
        raise PaymentDeclined("card refused", type="PaymentDeclined", non_retryable=True) from e


@app.saga(name="persist")
async def persist(ctx: SagaContext, failures: int) -> int:
    return await ctx.call(flaky, failures)


@app.saga(name="pay")
async def pay(ctx: SagaContext) -> dict[str, Any]:
    try:
        await ctx.call(charge)
    except StepFailedError as e:
        return {"type": e.error.type, "causes": e.error.causes, "message": str(e)}
    return {}


def test_unlimited_attempts_retry_past_any_count_with_a_capped_backoff() -> None:
    calls.clear()
    env = Harness(app)
    run_id = env.start(persist, 40)
    started = env.clock.now()
    env.run_until_idle()
    assert env.result(run_id) == 41
    assert calls == list(range(1, 42))
    waited = env.clock.now() - started
    assert waited <= timedelta(seconds=30) * 40, waited  # capped, never growing past 30 s


def test_the_cause_chain_reaches_saga_code_and_status() -> None:
    env = Harness(app)
    run_id = env.start(pay)
    env.run_until_idle()
    out = env.result(run_id)
    assert out["type"] == "PaymentDeclined"
    assert [tuple(c) for c in out["causes"]] == [
        ("ConnectionError", "gateway gave up"),
        ("TimeoutError", "the bank did not answer"),
    ]
    assert "caused by ConnectionError: gateway gave up" in out["message"]
    [line] = env.status(run_id).steps
    assert line.error is not None and "caused by TimeoutError" in line.error


def test_error_info_round_trips_its_causes_and_tolerates_cycles() -> None:
    a = ValueError("a")
    b = KeyError("b")
    a.__cause__, b.__cause__ = b, a  # a cycle: user code can build one
    info = ErrorInfo.from_exception(a)
    assert info.causes == [("KeyError", "'b'")]
    assert ErrorInfo.from_json(info.to_json()).causes == info.causes


@pytest.mark.parametrize("attempts", [0, -1])
def test_max_attempts_must_be_positive_or_none(attempts: int) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=attempts)
