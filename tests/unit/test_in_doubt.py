"""In-doubt attempts: a lost response or a crash leaves the engine unsure whether a step took
effect. Reconcile functions, idempotency keys and ``idempotent=False`` decide what happens next;
the effects are counted in a fake provider outside the engine."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Literal

import pytest

import sagaloop
from sagaloop import App, ApplicationError, NotAppliedError, RetryPolicy, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope, step_queue
from sagaloop.engine.ports import Delivery
from sagaloop.runtime import crashpoints
from sagaloop.runtime.crashpoints import CrashPointRaised
from sagaloop.runtime.steps import StepRunner
from sagaloop.testing import Crash, Harness

FAST = RetryPolicy(max_attempts=4, initial_interval=timedelta(seconds=1))


class Provider:
    """A payment provider that honours idempotency keys: a repeated key returns the first
    charge instead of charging again."""

    def __init__(self) -> None:
        self.charges: dict[str, dict[str, Any]] = {}
        self.requests: list[str] = []

    def charge(self, key: str, amount: int) -> str:
        self.requests.append(key)
        if key not in self.charges:
            self.charges[key] = {"id": f"ch_{len(self.charges) + 1}", "amount": amount}
        return str(self.charges[key]["id"])

    def find(self, key: str) -> str | None:
        found = self.charges.get(key)
        return None if found is None else str(found["id"])


@dataclasses.dataclass
class Attempt:
    attempt: int
    in_doubt: bool
    key: str


@dataclasses.dataclass
class World:
    app: App
    saga: Any
    provider: Provider
    attempts: list[Attempt]
    reconciles: list[Attempt]


def payment_app(
    *,
    reconcile: bool,
    idempotent: bool = True,
    lose_first_response: bool = True,
    not_applied_first: bool = False,
) -> World:
    app = App("payments")
    provider = Provider()
    attempts: list[Attempt] = []
    reconciles: list[Attempt] = []

    @app.step(retry=FAST, idempotent=idempotent)
    def charge(ctx: StepContext, amount: int) -> str:
        attempts.append(Attempt(ctx.attempt, ctx.in_doubt, ctx.idempotency_key))
        if not_applied_first and len(attempts) == 1:
            raise NotAppliedError("connection refused before the request was sent")
        charge_id = provider.charge(ctx.idempotency_key, amount)
        if lose_first_response and len(attempts) == 1:
            raise ConnectionError("connection reset: the response was lost")
        return charge_id

    if reconcile:

        @charge.reconcile
        def find_charge(ctx: StepContext, amount: int) -> str | None:
            reconciles.append(Attempt(ctx.attempt, ctx.in_doubt, ctx.idempotency_key))
            return provider.find(ctx.idempotency_key)

    @app.saga(name="pay")
    async def pay(ctx: SagaContext, amount: int) -> str:
        return await ctx.call(charge, amount)

    return World(app, pay, provider, attempts, reconciles)


def kinds(env: Harness, run_id: str, kind: str) -> list[Any]:
    return [e for e in env.history(run_id) if e.kind == kind]


# --- a lost response -------------------------------------------------------------------------


def test_lost_response_with_reconcile_is_reconciled_not_rerun() -> None:
    w = payment_app(reconcile=True)
    env = Harness(w.app)
    run_id = env.start(w.saga, 100)
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "completed"
    assert run.output == "ch_1"
    assert len(w.provider.charges) == 1, "exactly one effect"
    assert len(w.attempts) == 1, "the step body ran once"
    assert [(r.attempt, r.in_doubt) for r in w.reconciles] == [(2, True)]
    assert w.reconciles[0].key == w.attempts[0].key == f"{run_id}/0/do"
    line = env.status(run_id).steps[0]
    assert line.state == "reconciled"
    assert line.attempts == 2
    completed = kinds(env, run_id, h.STEP_COMPLETED)
    assert len(completed) == 1 and completed[0].data["reconciled"] is True


def test_reconcile_finding_nothing_runs_the_step_again() -> None:
    w = payment_app(reconcile=True, lose_first_response=False, not_applied_first=False)
    env = Harness(w.app)

    # the first attempt fails before reaching the provider, with an error that proves nothing
    original = w.provider.charge
    failed: list[bool] = []

    def flaky_charge(key: str, amount: int) -> str:
        if not failed:
            failed.append(True)
            raise TimeoutError("read timed out")
        return original(key, amount)

    w.provider.charge = flaky_charge  # type: ignore[method-assign]
    run_id = env.start(w.saga, 100)
    env.run_until_idle()
    assert env.get(run_id).output == "ch_1"
    assert [(a.attempt, a.in_doubt) for a in w.attempts] == [(1, False), (2, True)]
    assert [r.attempt for r in w.reconciles] == [2]
    assert env.status(run_id).steps[0].state == "completed"
    assert len(w.provider.charges) == 1


def test_lost_response_without_reconcile_retries_with_the_same_key() -> None:
    w = payment_app(reconcile=False, idempotent=True)
    env = Harness(w.app)
    run_id = env.start(w.saga, 100)
    env.run_until_idle()

    assert env.get(run_id).status == "completed"
    assert env.get(run_id).output == "ch_1"
    assert [(a.attempt, a.in_doubt) for a in w.attempts] == [(1, False), (2, True)]
    assert {a.key for a in w.attempts} == {f"{run_id}/0/do"}
    assert w.provider.requests == [f"{run_id}/0/do"] * 2
    assert len(w.provider.charges) == 1, "the provider deduplicated the retry by its key"
    assert env.status(run_id).steps[0].state == "completed"


def test_non_idempotent_step_in_doubt_halts_until_retried() -> None:
    w = payment_app(reconcile=False, idempotent=False)
    env = Harness(w.app)
    run_id = env.start(w.saga, 100)
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "needs_attention"
    assert run.reason is not None and "idempotent=False" in run.reason
    assert "charge" in run.reason
    assert len(w.attempts) == 1, "not re-attempted while in doubt"
    line = env.status(run_id).steps[0]
    assert line.state == "in doubt (halted)"
    assert env.status(run_id).waiting_for[0].startswith("needs attention: ")
    env.restart()
    env.run_until_idle()
    assert len(w.attempts) == 1 and env.get(run_id).status == "needs_attention"

    # the operator checked the effect and asks for the step to be run again
    env.retry(run_id)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "completed"
    assert run.output == "ch_1"
    assert len(w.attempts) == 2, "retry forces one more attempt"
    assert w.attempts[1].attempt == 2 and w.attempts[1].key == w.attempts[0].key
    assert len(w.provider.charges) == 1
    assert len(kinds(env, run_id, h.RUN_RESUMED)) == 1


def test_retry_of_a_run_that_does_not_need_attention_is_refused() -> None:
    w = payment_app(reconcile=False, lose_first_response=False)
    env = Harness(w.app)
    run_id = env.start(w.saga, 5)
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    with pytest.raises(sagaloop.SagaloopError, match="not needs_attention"):
        env.retry(run_id)


# --- not applied -----------------------------------------------------------------------------


@pytest.mark.parametrize("reconcile", [False, True])
def test_not_applied_error_makes_the_next_attempt_not_in_doubt(reconcile: bool) -> None:
    w = payment_app(
        reconcile=reconcile, idempotent=False, lose_first_response=False, not_applied_first=True
    )
    env = Harness(w.app)
    run_id = env.start(w.saga, 100)
    env.run_until_idle()

    assert env.get(run_id).status == "completed", "a step that certainly did not run retries"
    assert [(a.attempt, a.in_doubt) for a in w.attempts] == [(1, False), (2, False)]
    assert w.reconciles == [], "nothing to reconcile"
    retrying = kinds(env, run_id, h.STEP_RETRYING)
    assert [e.data["in_doubt"] for e in retrying] == [False]
    assert len(w.provider.charges) == 1


# --- crashes ---------------------------------------------------------------------------------


def crash_first_worker_delivery(env: Harness, *, run_it: bool = False) -> list[str]:
    """Kill the worker at its first step message. With ``run_it``, the step's attempt runs
    (its effect happens) before the kill, so only the commit of its result is lost."""
    crashed: list[str] = []

    def hook(role: str, delivery: Delivery) -> None:
        if role != "worker" or crashed:
            return
        task = Envelope.from_bytes(delivery.body)
        crashed.append(task.message_id)
        assert delivery.deliveries == 1
        if run_it:
            StepRunner(env.app, worker="doomed", inline=True).run(task)
        raise Crash("killed before commit")

    env.crash_hook = hook
    return crashed


def test_crash_makes_the_redelivered_attempt_in_doubt() -> None:
    w = payment_app(reconcile=False, lose_first_response=False)
    env = Harness(w.app)
    crashed = crash_first_worker_delivery(env)
    started = env.clock.now()
    run_id = env.start(w.saga, 100)
    env.run_until_idle()

    assert len(crashed) == 1
    assert env.get(run_id).status == "completed"
    assert [(a.attempt, a.in_doubt) for a in w.attempts] == [(1, True)]
    assert env.clock.now() >= started + env.lease, "redelivered once the lease expired"
    assert len(w.provider.charges) == 1


def test_crash_after_the_effect_is_reconciled_exactly_once() -> None:
    w = payment_app(reconcile=True, lose_first_response=False)
    env = Harness(w.app)
    crash_first_worker_delivery(env, run_it=True)
    run_id = env.start(w.saga, 100)
    env.run_until_idle()

    assert env.get(run_id).status == "completed"
    assert env.get(run_id).output == "ch_1"
    assert [(a.attempt, a.in_doubt) for a in w.attempts] == [(1, False)]  # the killed one
    assert [(r.attempt, r.in_doubt) for r in w.reconciles] == [(1, True)]
    assert len(w.provider.charges) == 1 and len(w.provider.requests) == 1
    assert env.status(run_id).steps[0].state == "reconciled"


def test_crash_of_a_non_idempotent_step_halts_the_run() -> None:
    w = payment_app(reconcile=False, idempotent=False, lose_first_response=False)
    env = Harness(w.app)
    crash_first_worker_delivery(env)
    run_id = env.start(w.saga, 100)
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "needs_attention"
    assert run.reason is not None and "idempotent=False" in run.reason
    assert w.attempts == []

    env.retry(run_id)
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert len(w.attempts) == 1 and len(w.provider.charges) == 1


# --- a compensation failing for good ---------------------------------------------------------


def test_compensation_failing_for_good_needs_attention_then_retry_compensates() -> None:
    app = App("undo")
    log: list[str] = []
    undo_keys: list[str] = []
    broken = [True]

    @app.step()
    def reserve(ctx: StepContext, item: str) -> str:
        log.append(f"reserve:{item}")
        return f"res-{item}"

    @reserve.compensation
    def release(ctx: StepContext, item: str, result: str) -> None:
        log.append(f"release:{result}")

    @app.step(retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(seconds=1)))
    def charge(ctx: StepContext, amount: int) -> str:
        log.append(f"charge:{amount}")
        return "ch_1"

    @charge.compensation
    def refund(ctx: StepContext, amount: int, result: str) -> None:
        undo_keys.append(ctx.idempotency_key)
        if broken[0]:
            raise RuntimeError("refund API down")
        log.append(f"refund:{result}")

    @app.step()
    def ship(ctx: StepContext) -> None:
        raise ApplicationError("address invalid", non_retryable=True)

    @app.saga(name="undo")
    async def undo(ctx: SagaContext) -> None:
        await ctx.call(reserve, "book")
        await ctx.call(charge, 30)
        await ctx.call(ship)

    env = Harness(app)
    run_id = env.start(undo)
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "needs_attention"
    assert run.reason is not None
    assert "compensation of step 'charge' failed for good" in run.reason
    assert "refund API down" in run.reason
    assert log == ["reserve:book", "charge:30"], "one at a time: reserve is not undone yet"
    assert undo_keys == [f"{run_id}/1/undo"] * 2  # two attempts, one key
    lines = {line.step: line for line in env.status(run_id).steps}
    assert lines["charge"].compensation == "compensation failed"
    assert lines["reserve"].compensation is None

    broken[0] = False
    env.retry(run_id)
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "compensated"
    assert log == ["reserve:book", "charge:30", "refund:ch_1", "release:res-book"]
    assert undo_keys == [f"{run_id}/1/undo"] * 3
    completed = kinds(env, run_id, h.COMPENSATION_COMPLETED)
    assert [e.pos for e in completed] == [1, 0]


# --- compensating a step that failed in doubt --------------------------------------------------


@pytest.mark.parametrize("took_effect", [True, False])
def test_compensation_of_a_step_failed_in_doubt_reconciles_with_the_steps_key(
    took_effect: bool,
) -> None:
    """The step's last attempt lost its response (no retries left): the step failed for good
    *in doubt*. Compensating it first asks the reconcile whether the charge happened, under the
    key the step used, and refunds exactly what was found."""
    app = App("undo-in-doubt")
    provider = Provider()
    reconciles: list[str] = []
    refunds: list[tuple[str | None, str]] = []

    @app.step(retry=RetryPolicy(max_attempts=1))
    def charge(ctx: StepContext, amount: int) -> str:
        if took_effect:
            provider.charge(ctx.idempotency_key, amount)
        raise ConnectionError("connection reset: the response was lost")

    @charge.reconcile
    def find_charge(ctx: StepContext, amount: int) -> str | None:
        reconciles.append(ctx.idempotency_key)
        return provider.find(ctx.idempotency_key)

    @charge.compensation
    def refund(ctx: StepContext, amount: int, result: str | None) -> None:
        refunds.append((result, ctx.idempotency_key))

    @app.saga(name="pay")
    async def pay(ctx: SagaContext, amount: int) -> str:
        return await ctx.call(charge, amount)

    env = Harness(app)
    run_id = env.start(pay, 100)
    env.run_until_idle()

    status = env.get(run_id).status
    if took_effect:
        assert status == "compensated"
    else:  # the compensation found nothing to undo; the run still ends undone, not completed
        assert status in ("compensated", "failed")
    assert reconciles == [f"{run_id}/0/do"], "the reconcile looks for the step's own effect"
    if took_effect:
        assert refunds == [("ch_1", f"{run_id}/0/undo")], "the found charge is refunded once"
    else:
        assert refunds == [], "nothing happened, so nothing is undone"


# --- a copy of a step message ------------------------------------------------------------------


@pytest.mark.parametrize("broker", ["database", "memory"])
@pytest.mark.parametrize("reconcile", [True, False])
def test_a_copy_of_a_step_message_is_in_doubt_after_the_first_copy_ran(
    broker: Literal["database", "memory"], reconcile: bool
) -> None:
    """A relay that dies after publishing a step message and before deleting its outbox row
    publishes it again: two copies of one attempt. The first copy's body charges and its worker
    dies before the commit; the second copy must be in doubt (reconciled, or halted for a
    non-idempotent step), never a first attempt that charges again."""
    charges: list[tuple[int, bool]] = []  # the provider: it does not deduplicate
    app = App("dup")
    state = {"kill": True}

    @app.step(queue="pay", idempotent=False)
    def charge(ctx: StepContext, order: str) -> str:
        charges.append((ctx.attempt, ctx.in_doubt))
        if state["kill"]:
            state["kill"] = False
            raise CrashPointRaised("the worker dies after the charge, before its commit")
        return f"charged {order}"

    if reconcile:

        @charge.reconcile
        def find(ctx: StepContext, order: str) -> str | None:
            return f"charged {order}" if charges else None

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return await ctx.call(charge, "o-1")

    env = Harness(app, broker=broker)
    copied: list[bytes] = []

    def publish_a_copy(role: str, delivery: Delivery) -> None:
        if role == "worker" and not copied:
            copied.append(delivery.body)
            env.broker.publish_raw(step_queue("dup", "pay"), delivery.body, trusted=True)  # type: ignore[attr-defined]

    env.crash_hook = publish_a_copy
    run_id = env.start(s)
    while True:
        try:
            env.run_until_idle()
            break
        except CrashPointRaised:
            env.restart()  # the worker's process died
    assert len(charges) == 1, f"charged again: {charges}"
    if reconcile:
        assert env.get(run_id).status == "completed"
        assert env.status(run_id).steps[0].state == "reconciled"
    else:
        assert env.get(run_id).status == "needs_attention"


def test_worker_before_commit_is_passed_only_by_a_delivery_that_ran_the_body() -> None:
    """``worker.before_commit`` means "the step ran (its effect happened), its result is not
    committed". A copy of a step message whose reply is stored already (the relay published it
    again) only settles: it runs nothing, so it must not pass that crash point. Were it
    counted, a test arming ``worker.before_commit:N`` could kill a worker that cut off no
    effect at all, and its in-doubt check would prove nothing."""
    ran: list[int] = []
    app = App("dup2")

    @app.step(queue="pay")
    def charge(ctx: StepContext, order: str) -> str:
        ran.append(ctx.attempt)
        return f"charged {order}"

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return await ctx.call(charge, "o-1")

    env = Harness(app, broker="database")
    first: list[bytes] = []

    def keep(role: str, delivery: Delivery) -> None:
        if role == "worker" and not first:
            first.append(delivery.body)

    env.crash_hook = keep
    run_id = env.start(s)
    env.run_until_idle()
    assert env.get(run_id).status == "completed" and ran == [1]

    crashpoints.arm("worker.before_commit:raise")
    try:
        env.broker.publish_raw(step_queue("dup2", "pay"), first[0], trusted=True)  # type: ignore[attr-defined]
        env.run_until_idle()  # the copy only settles: no body ran, no crash point passed
    finally:
        crashpoints.disarm()
    assert ran == [1]
