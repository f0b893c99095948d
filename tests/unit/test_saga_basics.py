"""Basic saga behaviour: typed results, compensation, concurrency, local steps, deterministic
helpers across restarts, retries with backoff, declaration errors and input validation."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

import sagaloop
from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness

# --- models ----------------------------------------------------------------------------------


class Order(BaseModel):
    order_id: str
    amount: int


class Reservation(BaseModel):
    reservation_id: str
    order_id: str


class Payment(BaseModel):
    payment_id: str
    amount: int


class Shipment(BaseModel):
    tracking: str


class Receipt(BaseModel):
    reservation: Reservation
    payment: Payment
    shipment: Shipment
    types: list[str]


def kinds(env: Harness, run_id: str, kind: str) -> list[Any]:
    return [e for e in env.history(run_id) if e.kind == kind]


# --- a three-step saga -----------------------------------------------------------------------


def order_app(*, ship_fails: bool) -> tuple[App, Any, list[str]]:
    app = App("orders")
    calls: list[str] = []

    @app.step()
    def reserve(ctx: StepContext, order: Order) -> Reservation:
        calls.append("reserve")
        return Reservation(reservation_id=f"r-{order.order_id}", order_id=order.order_id)

    @reserve.compensation
    def release(ctx: StepContext, order: Order, result: Reservation) -> None:
        assert isinstance(result, Reservation)
        calls.append(f"release:{result.reservation_id}")

    @app.step()
    def charge(ctx: StepContext, order: Order, reservation: Reservation) -> Payment:
        calls.append("charge")
        return Payment(payment_id=f"p-{reservation.reservation_id}", amount=order.amount)

    @charge.compensation
    def refund(ctx: StepContext, order: Order, reservation: Reservation, result: Payment) -> None:
        assert isinstance(result, Payment) and isinstance(reservation, Reservation)
        calls.append(f"refund:{result.payment_id}")

    @app.step(retry=RetryPolicy(max_attempts=3, initial_interval=timedelta(seconds=1)))
    def ship(ctx: StepContext, order: Order, payment: Payment) -> Shipment:
        calls.append("ship")
        if ship_fails:
            raise ApplicationError("no courier", non_retryable=True)
        return Shipment(tracking=f"t-{payment.payment_id}")

    @app.saga(name="order")
    async def order_saga(ctx: SagaContext, order: Order) -> Receipt:
        reservation = await ctx.call(reserve, order)
        payment = await ctx.call(charge, order, reservation)
        shipment = await ctx.call(ship, order, payment)
        return Receipt(
            reservation=reservation,
            payment=payment,
            shipment=shipment,
            types=[type(x).__name__ for x in (reservation, payment, shipment)],
        )

    return app, order_saga, calls


def test_three_steps_complete_with_typed_results_each_recorded_once() -> None:
    app, saga, calls = order_app(ship_fails=False)
    env = Harness(app)
    run_id = env.start(saga, Order(order_id="o1", amount=42))
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "completed"
    assert run.output == {
        "reservation": {"reservation_id": "r-o1", "order_id": "o1"},
        "payment": {"payment_id": "p-r-o1", "amount": 42},
        "shipment": {"tracking": "t-p-r-o1"},
        "types": ["Reservation", "Payment", "Shipment"],
    }
    assert env.result(run_id) == Receipt.model_validate(run.output)  # the declared type
    assert calls == ["reserve", "charge", "ship"]

    scheduled = kinds(env, run_id, h.STEP_SCHEDULED)
    completed = kinds(env, run_id, h.STEP_COMPLETED)
    assert [(e.pos, e.name) for e in scheduled] == [(0, "reserve"), (1, "charge"), (2, "ship")]
    assert [(e.pos, e.name) for e in completed] == [(0, "reserve"), (1, "charge"), (2, "ship")]
    assert completed[1].data["result"] == {"payment_id": "p-r-o1", "amount": 42}
    # the arguments are stored as JSON, the pydantic models dumped
    assert scheduled[1].data["args"] == {
        "order": {"order_id": "o1", "amount": 42},
        "reservation": {"reservation_id": "r-o1", "order_id": "o1"},
    }
    assert not kinds(env, run_id, h.COMPENSATION_SCHEDULED)
    assert [e.data["status"] for e in kinds(env, run_id, h.RUN_FINISHED)] == ["completed"]


def test_last_step_failing_compensates_earlier_steps_once_newest_first() -> None:
    app, saga, calls = order_app(ship_fails=True)
    env = Harness(app)
    run_id = env.start(saga, Order(order_id="o2", amount=7))
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "compensated"
    assert run.error is not None and run.error["type"] == "StepFailedError"
    assert "no courier" in run.error["message"]
    # ship failed at once (non-retryable): a single attempt
    assert calls == ["reserve", "charge", "ship", "refund:p-r-o2", "release:r-o2"]
    comp = kinds(env, run_id, h.COMPENSATION_SCHEDULED)
    assert [(e.pos, e.name) for e in comp] == [(1, "charge"), (0, "reserve")]
    assert Counter(e.pos for e in kinds(env, run_id, h.COMPENSATION_COMPLETED)) == {1: 1, 0: 1}
    lines = {line.step: line for line in env.status(run_id).steps}
    assert lines["ship"].state == "failed"
    assert lines["charge"].compensation == "compensated"
    assert lines["reserve"].compensation == "compensated"
    with pytest.raises(sagaloop.SagaFailedError) as info:
        env.result(run_id)
    assert info.value.status == "compensated"

    # running the harness again does nothing more
    env.restart()
    env.run_until_idle()
    assert calls.count("refund:p-r-o2") == 1 and calls.count("release:r-o2") == 1


# --- concurrency -----------------------------------------------------------------------------


@pytest.mark.parametrize("use_ctx_gather", [False, True])
def test_gather_schedules_calls_concurrently(use_ctx_gather: bool) -> None:
    app = App("fanout")
    ran: list[int] = []

    @app.step()
    def square(ctx: StepContext, x: int) -> int:
        ran.append(x)
        return x * x

    @app.saga(name="fanout")
    async def fanout(ctx: SagaContext, xs: list[int]) -> list[int]:
        calls = [ctx.call(square, x) for x in xs]
        if use_ctx_gather:
            return await ctx.gather(*calls)
        return list(await asyncio.gather(*calls))

    env = Harness(app)
    run_id = env.start(fanout, [2, 3, 4])
    env.run_until_idle()

    assert env.get(run_id).output == [4, 9, 16]
    assert sorted(ran) == [2, 3, 4]
    events = env.history(run_id)
    scheduled = [e.seq for e in events if e.kind == h.STEP_SCHEDULED]
    completed = [e.seq for e in events if e.kind == h.STEP_COMPLETED]
    assert len(scheduled) == 3 and len(completed) == 3
    assert max(scheduled) < min(completed), "all three calls are issued before any completes"
    assert [e.pos for e in events if e.kind == h.STEP_SCHEDULED] == [0, 1, 2]


# --- local steps -----------------------------------------------------------------------------


def test_local_step_result_is_recorded_like_a_remote_one() -> None:
    app = App("local")
    ran: list[int] = []

    @app.step(local=True)
    def double(ctx: StepContext, x: int) -> int:
        ran.append(x)
        return 2 * x

    @app.step()
    def remote(ctx: StepContext, x: int) -> int:
        return x + 1

    @app.saga(name="local")
    async def saga(ctx: SagaContext, x: int) -> int:
        y = await ctx.call(double, x)
        z = await ctx.call(remote, y)
        await ctx.wait_for_event("go")
        return await ctx.call(double, z)

    assert app.queues == ["default"]  # only the remote step needs a worker queue
    env = Harness(app)
    run_id = env.start(saga, 5)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    env.restart()  # the local result must come from the history, not from re-running it
    env.send_event(run_id, "go")
    env.run_until_idle()

    assert env.get(run_id).output == 22
    assert ran == [5, 11]
    completed = kinds(env, run_id, h.STEP_COMPLETED)
    assert [(e.pos, e.name, e.data["result"]) for e in completed] == [
        (0, "double", 10),
        (1, "remote", 11),
        (3, "double", 22),
    ]
    assert [(e.pos, e.name) for e in kinds(env, run_id, h.STEP_SCHEDULED)] == [
        (0, "double"),
        (1, "remote"),
        (3, "double"),
    ]
    lines = env.status(run_id).steps
    assert [(line.step, line.state, line.attempts) for line in lines] == [
        ("double", "completed", 1),
        ("remote", "completed", 1),
        ("double", "completed", 1),
    ]


# --- deterministic helpers -------------------------------------------------------------------


def test_uuid_random_and_now_are_the_same_after_restart_and_replay() -> None:
    app = App("helpers")
    seen: list[dict[str, Any]] = []

    @app.step()
    def record(ctx: StepContext, values: dict[str, Any]) -> None:
        seen.append(values)

    def sample(ctx: SagaContext) -> dict[str, Any]:
        return {"uuid": str(ctx.uuid4()), "random": ctx.random(), "now": ctx.now().isoformat()}

    @app.saga(name="helpers")
    async def saga(ctx: SagaContext) -> dict[str, Any]:
        before = sample(ctx)
        await ctx.call(record, before)
        await ctx.wait_for_event("go")
        after = sample(ctx)
        return {"before": before, "after": after}

    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    assert len(seen) == 1
    captured = seen[0]
    started = env.history(run_id)[0].at

    env.advance(timedelta(hours=5))
    env.restart()
    env.send_event(run_id, "go")
    env.run_until_idle()

    output = env.get(run_id).output
    assert env.get(run_id).status == "completed"
    assert output["before"] == captured, "replay regenerated the same values"
    assert len(seen) == 1
    after = output["after"]
    assert after["uuid"] != captured["uuid"] and after["random"] != captured["random"]
    assert 0.0 <= after["random"] < 1.0
    assert datetime.fromisoformat(captured["now"]) == started
    arrived = kinds(env, run_id, h.EVENT_ARRIVED)[0].at
    assert datetime.fromisoformat(after["now"]) == arrived == started + timedelta(hours=5)

    # the values depend on the run only, not on the process: a second run differs
    other = env.start(saga)
    env.run_until_idle(skip_time=False)
    assert env.get(other).status == "waiting"
    assert len(seen) == 2 and seen[1]["uuid"] != captured["uuid"]
    assert seen[1]["random"] != captured["random"]


# --- retries ---------------------------------------------------------------------------------


def test_retry_policy_backoff_and_stable_idempotency_key() -> None:
    app = App("retries")
    attempts: list[tuple[int, str, bool, datetime]] = []
    env_holder: list[Harness] = []

    policy = RetryPolicy(
        max_attempts=5, initial_interval=timedelta(seconds=10), backoff_coefficient=3.0
    )

    @app.step(retry=policy)
    def flaky(ctx: StepContext, x: int) -> int:
        attempts.append((ctx.attempt, ctx.idempotency_key, ctx.in_doubt, env_holder[0].clock.now()))
        if len(attempts) < 3:
            raise ConnectionError("flaky network")
        return x * 10

    @app.saga(name="retries")
    async def saga(ctx: SagaContext, x: int) -> int:
        return await ctx.call(flaky, x)

    env = Harness(app)
    env_holder.append(env)
    t0 = env.clock.now()
    run_id = env.start(saga, 4)
    env.run_until_idle()

    assert env.get(run_id).output == 40
    assert [a[0] for a in attempts] == [1, 2, 3]
    keys = {a[1] for a in attempts}
    assert keys == {f"{run_id}/0/do"}
    assert [a[2] for a in attempts] == [False, True, True]  # a lost response is in doubt
    # 10 s after the first failure, then 30 s after the second
    assert [a[3] - t0 for a in attempts] == [
        timedelta(0),
        timedelta(seconds=10),
        timedelta(seconds=40),
    ]
    retrying = kinds(env, run_id, h.STEP_RETRYING)
    assert [datetime.fromisoformat(e.data["retry_at"]) - e.at for e in retrying] == [
        timedelta(seconds=10),
        timedelta(seconds=30),
    ]
    dispatched = kinds(env, run_id, h.STEP_DISPATCHED)
    assert [(e.data["attempt"], e.at - t0) for e in dispatched] == [
        (2, timedelta(seconds=10)),
        (3, timedelta(seconds=40)),
    ]
    line = env.status(run_id).steps[0]
    assert (line.state, line.attempts, line.idempotency_key) == ("completed", 3, f"{run_id}/0/do")


def test_retry_delay_is_capped_by_maximum_interval() -> None:
    policy = RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=10.0,
        maximum_interval=timedelta(seconds=50),
    )
    assert [policy.delay(n).total_seconds() for n in (1, 2, 3)] == [1.0, 10.0, 50.0]


def test_retries_exhausted_fail_the_step_for_good() -> None:
    app = App("exhaust")
    tries: list[int] = []

    @app.step(retry=RetryPolicy(max_attempts=3, initial_interval=timedelta(seconds=1)))
    def always(ctx: StepContext) -> None:
        tries.append(ctx.attempt)
        raise RuntimeError("down")

    @app.saga(name="exhaust")
    async def saga(ctx: SagaContext) -> str:
        try:
            await ctx.call(always)
        except sagaloop.StepFailedError as e:
            return f"{e.step}: {e.error.type}: {e.error.message}"
        return "unreachable"

    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    assert tries == [1, 2, 3]
    assert env.get(run_id).output == "always: RuntimeError: down"


@pytest.mark.parametrize("raise_as", ["builtin", "application_type"])
def test_non_retryable_errors_by_type_name_fail_at_once(raise_as: str) -> None:
    app = App("nonretry")
    tries: list[int] = []

    policy = RetryPolicy(max_attempts=5, non_retryable_errors=("KeyError", "CardDeclined"))

    @app.step(retry=policy)
    def lookup(ctx: StepContext) -> None:
        tries.append(ctx.attempt)
        if raise_as == "builtin":
            raise KeyError("missing")
        raise ApplicationError("declined", type="CardDeclined")

    @app.saga(name="nonretry")
    async def saga(ctx: SagaContext) -> str:
        try:
            await ctx.call(lookup)
        except sagaloop.StepFailedError as e:
            return e.error.type
        return "unreachable"

    env = Harness(app)
    t0 = env.clock.now()
    run_id = env.start(saga)
    env.run_until_idle()
    assert tries == [1]
    assert env.get(run_id).output == ("KeyError" if raise_as == "builtin" else "CardDeclined")
    assert not kinds(env, run_id, h.STEP_RETRYING)
    assert env.clock.now() == t0  # no retry timer was waited for


# --- declaration errors ----------------------------------------------------------------------


def test_duplicate_saga_name_is_rejected() -> None:
    app = App("dup-saga")

    @app.saga(name="same")
    async def first(ctx: SagaContext) -> None:
        return None

    with pytest.raises(sagaloop.DeclarationError, match="same"):

        @app.saga(name="same")
        async def second(ctx: SagaContext) -> None:
            return None

    assert app.sagas["same"] is first


def test_duplicate_step_name_is_rejected() -> None:
    app = App("dup-step")

    @app.step(name="work")
    def first(ctx: StepContext) -> None:
        return None

    with pytest.raises(sagaloop.DeclarationError, match="work"):

        @app.step(name="work")
        def second(ctx: StepContext) -> None:
            return None

    with pytest.raises(sagaloop.DeclarationError, match="work"):

        @app.step(name="other", aliases=["work"])
        def third(ctx: StepContext) -> None:
            return None

    assert app.steps["work"] is first and "other" not in app.steps


def test_sync_saga_function_is_rejected() -> None:
    app = App("sync-saga")
    with pytest.raises(sagaloop.DeclarationError, match="async def"):

        @app.saga(name="sync")
        def sync_saga(ctx: SagaContext) -> None:  # type: ignore[arg-type]
            return None

    assert "sync" not in app.sagas


def test_compensation_with_wrong_arity_is_rejected() -> None:
    app = App("arity")

    @app.step()
    def pay(ctx: StepContext, amount: int, currency: str) -> str:
        return "p1"

    with pytest.raises(sagaloop.DeclarationError, match="4 parameters"):

        @pay.compensation
        def refund_missing_result(ctx: StepContext, amount: int, currency: str) -> None:
            return None

    with pytest.raises(sagaloop.DeclarationError, match="3 parameters"):

        @pay.reconcile
        def find_too_many(ctx: StepContext, amount: int, currency: str, extra: str) -> None:
            return None

    @pay.compensation
    def refund(ctx: StepContext, amount: int, currency: str, result: str) -> None:
        return None

    assert pay.compensation_fn is refund


# --- input validation ------------------------------------------------------------------------


def test_invalid_input_raises_and_writes_no_run() -> None:
    app = App("validate")

    @app.saga(name="typed")
    async def typed(ctx: SagaContext, order: Order) -> int:
        return order.amount

    env = Harness(app)
    with pytest.raises(sagaloop.ValidationError, match="amount"):
        env.start(typed, {"order_id": "x", "amount": "not a number"}, run_id="bad")
    with pytest.raises(sagaloop.ValidationError):
        env.start("typed", {"nothing": True}, run_id="bad2")
    assert env.client.list() == []
    with pytest.raises(sagaloop.RunNotFoundError):
        env.get("bad")
    assert env.run_until_idle() == 0  # nothing was queued either

    run_id = env.start(typed, {"order_id": "x", "amount": "5"})  # coerced by pydantic
    env.run_until_idle()
    assert env.get(run_id).output == 5
