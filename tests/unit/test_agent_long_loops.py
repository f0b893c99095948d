"""Long agent loops (issue 23): Pydantic AI's default ``UsageLimits(request_limit=50)`` does not
silently cap a SagaAgent run whose Budget limits requests; without one, it still applies."""

from __future__ import annotations

from typing import Any

from pydantic_ai import Agent, models
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import UsageLimits

from sagaloop import App, SagaContext
from sagaloop.agents import Budget
from sagaloop.agents.pydantic_ai import SagaAgent
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False


def looping_app(turns: int, **options: Any) -> tuple[Harness, Any, list[int]]:
    """An agent whose model calls a tool ``turns`` times, then answers."""
    app = App("long")
    requests: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        requests.append(len(messages))
        if len(requests) <= turns:
            return ModelResponse(parts=[ToolCallPart("tick", {"i": len(requests)})])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(model), name="looper")

    @agent.tool_plain
    def tick(i: int) -> int:
        return i

    usage_limits = options.pop("usage_limits", None)
    saga_agent = SagaAgent(agent, app=app, **options)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("go", usage_limits=usage_limits)).output)

    env = Harness(app)
    return env, env.start(s), requests


def test_a_budget_on_requests_replaces_the_frameworks_default_of_50() -> None:
    env, run_id, requests = looping_app(60, budget=Budget(requests=100))
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert len(requests) == 61


def test_the_budget_still_stops_the_loop_at_its_own_limit() -> None:
    env, run_id, requests = looping_app(60, budget=Budget(requests=55))
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert (run.error or {}).get("type") == "BudgetExceeded"
    assert len(requests) == 55


def test_without_a_request_budget_the_frameworks_default_applies() -> None:
    env, run_id, requests = looping_app(60, budget=Budget(cost=5.0))
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert "request_limit" in (run.error or {}).get("message", "")
    assert len(requests) == 50


def test_usage_limits_given_to_the_run_win() -> None:
    limits = UsageLimits(request_limit=3)
    env, run_id, requests = looping_app(60, budget=Budget(requests=100), usage_limits=limits)
    env.run_until_idle()
    assert env.get(run_id).status == "failed"
    assert len(requests) == 3
