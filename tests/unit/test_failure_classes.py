"""Failures have classes, and only a business failure compensates (issue 23, item 1).

A provider that is down or busy is ridden out (backoff, its Retry-After, for hours by
default); a failure a person must fix (a revoked key, an unknown model, a bug) parks the run in
``needs_attention`` with nothing undone, and ``retry`` asks the same request again; any step
may park instead of failing (``RetryPolicy(give_up="park")``,
``ApplicationError(needs_attention=True)``). Before, a 4-second 503 failed the run for good
and compensated its tools, and ``retry`` answered that the run was failed."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from pydantic_ai import Agent, models
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext
from sagaloop.agents.providers import MODEL_DEADLINE, failure_class, retry_after
from sagaloop.agents.pydantic_ai import SagaAgent, ToolPolicy
from sagaloop.engine import history as h
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False


class Provider:
    """A model that books once, then answers; ``fail`` decides, per request, what the
    provider raises instead (None: it answers)."""

    def __init__(self, fail: Callable[[int], BaseException | None]) -> None:
        self.fail = fail
        self.requests = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        error = self.fail(self.requests)
        if error is not None:
            raise error
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart("book", {"trip": "lisbon"})])
        return ModelResponse(parts=[TextPart("booked")])


def travel_app(provider: Provider) -> tuple[App, list[str], Any]:
    app = App("travel")
    ledger: list[str] = []

    def cancel(ctx: StepContext, args: dict[str, Any], value: Any) -> None:
        ledger.append(f"cancelled {args['trip']}")

    agent = Agent(FunctionModel(provider), name="agent")

    @agent.tool_plain
    def book(trip: str) -> str:
        ledger.append(f"booked {trip}")
        return "ok"

    saga_agent = SagaAgent(agent, app=app, tools={"book": ToolPolicy(compensation=cancel)})

    @app.saga(name="trip")
    async def trip(ctx: SagaContext) -> str:
        return str((await saga_agent.run("book lisbon")).output)

    return app, ledger, trip


def outage(until: int, status: int = 503, **kw: Any) -> Callable[[int], BaseException | None]:
    """The second request (after the booking) fails with ``status`` until request ``until``."""
    return lambda n: ModelHTTPError(status, "m", **kw) if 2 <= n < until else None


def test_a_provider_outage_is_ridden_out_and_the_tools_stay_done() -> None:
    provider = Provider(outage(until=12))  # ten 503s: minutes of backoff
    app, ledger, trip = travel_app(provider)
    env = Harness(app)
    run_id = env.start(trip)
    env.run_until_idle(skip_time=False)
    [why] = [w for w in env.status(run_id).waiting_for if "failing" in w]
    assert "ModelProviderUnavailable: provider 503 failed, to be asked again" in why, why
    env.advance(timedelta(hours=1))
    assert env.result(run_id) == "booked"
    assert ledger == ["booked lisbon"], "nothing was undone"
    assert provider.requests == 12


def test_a_provider_rate_limit_waits_at_least_its_retry_after() -> None:
    provider = Provider(outage(until=3, status=429, retry_after=90))
    app, _, trip = travel_app(provider)
    env = Harness(app)
    run_id = env.start(trip)
    env.run_until_idle(skip_time=False)
    [retrying] = [e for e in env.history(run_id) if e.kind == h.STEP_RETRYING]
    wait = retrying.data["retry_at"]
    assert wait >= (retrying.at + timedelta(seconds=90)).isoformat()
    env.advance(timedelta(minutes=2))
    assert env.result(run_id) == "booked"


def test_an_outage_past_the_deadline_parks_the_run_with_nothing_undone() -> None:
    provider = Provider(outage(until=10**9))
    app, ledger, trip = travel_app(provider)
    env = Harness(app)
    run_id = env.start(trip)
    env.advance(MODEL_DEADLINE + timedelta(hours=1))
    run = env.get(run_id)
    assert run.status == "needs_attention" and ledger == ["booked lisbon"]
    assert run.reason is not None and "sagaloop retry" in run.reason


@pytest.mark.parametrize("status", [401, 403, 404, 400])
def test_a_refused_request_parks_the_run_and_retry_asks_it_again(status: int) -> None:
    fixed = False
    provider = Provider(lambda n: ModelHTTPError(status, "m") if n == 2 and not fixed else None)
    app, ledger, trip = travel_app(provider)
    env = Harness(app)
    run_id = env.start(trip)
    env.run_until_idle(skip_time=False)
    run = env.get(run_id)
    assert run.status == "needs_attention", run.status
    assert run.reason is not None and f"provider {status}" in run.reason
    assert ledger == ["booked lisbon"], "parked: nothing undone"
    assert provider.requests == 2, "not retried: waiting cannot fix it"
    fixed = True  # the operator rotates the key
    env.retry(run_id)
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == "booked" and ledger == ["booked lisbon"]
    halted = [e for e in env.history(run_id) if e.kind == h.STEP_HALTED]
    assert halted and halted[0].data["in_doubt"] is False, "a refused request took no effect"


def test_a_model_bug_parks_too_and_cancelling_a_parked_run_undoes_its_tools() -> None:
    provider = Provider(lambda n: ValueError("bad model output") if n == 2 else None)
    app, ledger, trip = travel_app(provider)
    env = Harness(app)
    run_id = env.start(trip)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "needs_attention"
    env.cancel(run_id, "giving up")  # the operator decides: now it compensates
    env.run_until_idle()
    assert env.get(run_id).status == "cancelled"
    assert ledger == ["booked lisbon", "cancelled lisbon"]


def test_any_step_may_park_instead_of_failing() -> None:
    app = App("park")
    done: list[str] = []
    state = {"broken": True}

    @app.step()
    def reserve(ctx: StepContext) -> None:
        done.append("reserved")

    @app.step(retry=RetryPolicy(max_attempts=2, give_up="park"))
    def pay(ctx: StepContext) -> str:
        if state["broken"]:
            raise RuntimeError("gateway misconfigured")
        return "paid"

    @app.step()
    def audit(ctx: StepContext) -> str:
        if state["broken"]:
            raise ApplicationError("the audit key was revoked", needs_attention=True)
        return "audited"

    @app.saga(name="order")
    async def order(ctx: SagaContext) -> list[str]:
        await ctx.call(reserve)
        return [await ctx.call(pay), await ctx.call(audit)]

    env = Harness(app)
    run_id = env.start(order)
    env.advance(timedelta(minutes=5))
    run = env.get(run_id)
    assert run.status == "needs_attention" and "failed for good" in (run.reason or "")
    state["broken"] = False
    env.retry(run_id)
    env.advance(timedelta(minutes=5))
    assert env.result(run_id) == ["paid", "audited"]


def test_a_step_that_needs_a_person_parks_at_its_first_attempt() -> None:
    app = App("attention")
    attempts: list[int] = []
    state = {"revoked": True}

    @app.step()
    def audit(ctx: StepContext) -> str:
        attempts.append(ctx.attempt)
        if state["revoked"]:
            raise ApplicationError("the audit key was revoked", needs_attention=True)
        return "audited"

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str(await ctx.call(audit))

    env = Harness(app)
    run_id = env.start(s)
    env.advance(timedelta(minutes=5))
    run = env.get(run_id)
    assert run.status == "needs_attention" and attempts == [1]
    assert "needs a person" in (run.reason or "") and "revoked" in (run.reason or "")
    state["revoked"] = False
    env.retry(run_id)
    env.run_until_idle()
    assert env.result(run_id) == "audited" and attempts == [1, 2]


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ModelHTTPError(503, "m"), "transient"),
        (ModelHTTPError(529, "m"), "transient"),
        (ModelHTTPError(429, "m"), "transient"),
        (ModelHTTPError(408, "m"), "transient"),
        (ModelHTTPError(401, "m"), "attention"),
        (ModelHTTPError(404, "m"), "attention"),
        (ConnectionResetError("reset"), "transient"),
        (TimeoutError(), "transient"),
        (ValueError("bug"), "attention"),
    ],
)
def test_failure_classes_of_provider_errors(error: BaseException, kind: str) -> None:
    assert failure_class(error) == kind


def test_retry_after_is_read_from_headers_too() -> None:
    class Response:
        headers = {"retry-after": "7"}

    class RateLimitError(Exception):
        status_code = 429
        response = Response()

    assert failure_class(RateLimitError()) == "transient"
    assert retry_after(RateLimitError()) == 7.0
