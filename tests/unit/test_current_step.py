"""A function tool run as a step finds its attempt (``sagaloop.current_step()``): the
idempotency key a ``ToolPolicy(reconcile=...)`` looks the effect up by (issue 23)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest
from agents import Agent as OAAgent
from agents import function_tool
from agents.items import ModelResponse as OAResponse
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from agents.usage import Usage
from pydantic_ai import Agent, models
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, SagaContext, StepContext, current_step
from sagaloop.agents import ToolPolicy
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.agents.pydantic_ai import SagaAgent
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False


def test_outside_a_step_there_is_none() -> None:
    assert current_step() is None


def test_a_step_and_the_code_it_calls_see_the_attempt() -> None:
    app = App("cs")
    seen: list[tuple[str, int, bool]] = []

    def helper() -> None:
        step = current_step()
        assert step is not None
        seen.append((step.idempotency_key, step.attempt, step.in_doubt))

    @app.step
    def sync_step(ctx: StepContext) -> str:
        helper()
        return ctx.idempotency_key

    @app.step
    async def async_step(ctx: StepContext) -> str:
        helper()
        return ctx.idempotency_key

    @app.step(timeout=timedelta(seconds=30))  # on the step threads
    async def timed_step(ctx: StepContext) -> str:
        helper()
        return ctx.idempotency_key

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> list[str]:
        return [await ctx.call(x) for x in (sync_step, async_step, timed_step)]

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    keys = env.result(run_id)
    assert seen == [(key, 1, False) for key in keys] and len(set(keys)) == 3
    assert current_step() is None, "not left behind on the thread"


def test_a_pydantic_ai_function_tool_reads_its_steps_key_and_attempt() -> None:
    app = App("cs")
    calls = 0

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("book", {"hotel": "h1"})])
        last = messages[-1]
        returns = [p.content for p in last.parts if isinstance(p, ToolReturnPart)]
        return ModelResponse(parts=[TextPart(json.dumps(returns))])

    agent = Agent(FunctionModel(model), name="trip")

    @agent.tool_plain(metadata={"sagaloop": ToolPolicy(idempotent=True)})
    async def book(hotel: str) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        step = current_step()
        assert step is not None
        if calls == 1:
            raise ConnectionError("the response was lost")
        return {"key": step.idempotency_key, "attempt": step.attempt, "doubt": step.in_doubt}

    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("book it")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    [answer] = json.loads(env.result(run_id))
    line = next(x for x in env.status(run_id).steps if x.step.endswith("__tool__book"))
    assert answer == {"key": line.idempotency_key, "attempt": 2, "doubt": True}


def test_an_openai_agents_function_tool_reads_its_steps_key() -> None:
    app = App("cs")

    @function_tool
    def book(hotel: str) -> str:
        """Book a hotel."""
        step = current_step()
        assert step is not None
        return step.idempotency_key

    def echo(call: Any) -> OAResponse:
        out = [str(i["output"]) for i in call.input if isinstance(i, dict) and "output" in i]
        return OAResponse(output=[assistant_message(out[0])], usage=Usage(), response_id=None)

    model = ScriptedModel(
        [
            OAResponse(
                output=[function_call("book", {"hotel": "h1"}, call_id="c1")],
                usage=Usage(),
                response_id=None,
            ),
            ModelStep.respond(echo),
        ]
    )
    agent: OAAgent[Any] = OAAgent(name="trip", model=model, tools=[book])
    runner = SagaRunner(app, agent)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await runner.run(agent, "book it")).final_output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    line = next(x for x in env.status(run_id).steps if x.step.endswith("__tool__book"))
    assert env.result(run_id) == line.idempotency_key


def _task(step: str) -> Any:
    from sagaloop.engine.messages import Envelope

    return Envelope(
        type="step",
        run_id="r1",
        position=3,
        attempt=2,
        idempotency_key="r1/3/do",
        payload={"step": step, "args": {}},
    )


def test_on_the_step_threads_and_inside_a_running_loop_too() -> None:
    """Not inline: a step with a timeout runs on the pool's threads, and an async step called
    where a loop runs gets a thread of its own; each sees its attempt, and its error keeps its
    own cause chain."""
    import asyncio

    from sagaloop.runtime.steps import StepRunner

    app = App("cs")

    @app.step(timeout=timedelta(seconds=30))
    async def timed(ctx: StepContext) -> str:
        step = current_step()
        assert step is not None
        return f"{step.idempotency_key} {step.attempt}"

    @app.step(timeout=timedelta(seconds=30))
    async def timed_failing(ctx: StepContext) -> str:
        raise ValueError("declined")

    @app.step
    async def plain_failing(ctx: StepContext) -> str:
        assert current_step() is ctx
        raise ValueError("declined")

    runner = StepRunner(app, threads=2)
    assert runner.run(_task("timed")).result == "r1/3/do 2"
    for name in ("timed_failing", "plain_failing"):
        error = runner.run(_task(name)).error
        assert (error["type"], error.get("causes")) == ("ValueError", None), error

    async def in_a_loop() -> dict[str, Any]:
        return runner.run(_task("plain_failing"))

    error = asyncio.run(in_a_loop()).error
    assert (error["type"], error.get("causes")) == ("ValueError", None), error
    assert current_step() is None


def test_a_step_reads_its_runs_history_and_a_childs() -> None:
    """``StepContext.history()``: the public way a step (an agent's model step, a budget
    tree) reads what its run, or another run, recorded."""
    app = App("hist")

    @app.step
    def note(ctx: StepContext, text: str) -> str:
        return text

    @app.step
    def look(ctx: StepContext, child: str) -> dict[str, Any]:
        own = ctx.history()
        other = ctx.history(child)
        return {
            "own": [e.name for e in own if e.kind == "step_completed"],
            "first": own[0].kind,
            "child_done": any(e.kind == "run_finished" for e in other),
        }

    @app.saga(name="kid")
    async def kid(ctx: SagaContext, x: int) -> int:
        return x

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> dict[str, Any]:
        await ctx.call(note, "a")
        await ctx.call(kid, 1, run_id="kid-1")
        return await ctx.call(look, "kid-1")

    env = Harness(app)
    rid = env.start(s, None)
    env.run_until_idle()
    result = env.result(rid)
    assert result == {"own": ["note"], "first": "run_started", "child_done": True}


def test_a_step_called_outside_a_saga_cannot_read_histories() -> None:
    from sagaloop.agents._core import run_plain
    from sagaloop.errors import ValidationError

    app = App("plain")

    @app.step
    def look(ctx: StepContext) -> int:
        return len(ctx.history())

    with pytest.raises(ValidationError, match="cannot read a run's history here"):
        asyncio.run(run_plain(look, {}))
