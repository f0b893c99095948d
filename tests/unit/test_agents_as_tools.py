"""Agents as tools (issue 25, item 14): a supervisor agent's sub-agent runs as a CHILD RUN of
the supervisor's run (``saga_as_tool``, ``SagaAgent.as_tool``, ``saga_as_function_tool``,
``SagaRunner.agent_as_tool``), started in saga code: its model requests and tools are steps of
its own run, recorded once; the child's output is the tool's result for the supervisor's
model; a restart mid-way replays without asking any model again; cancelling the supervisor
cancels the child. Offline: Pydantic AI's FunctionModel, the OpenAI Agents SDK's
ScriptedModel."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, models
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, SagaContext
from sagaloop.agents.pydantic_ai import SagaAgent, saga_as_tool
from sagaloop.engine import history as h
from sagaloop.errors import DeclarationError, ValidationError
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False


def last_results(messages: list[ModelMessage]) -> list[Any]:
    last = messages[-1]
    assert isinstance(last, ModelRequest)
    return [p.content for p in last.parts if isinstance(p, ToolReturnPart)]


def prompt_of(messages: list[ModelMessage]) -> str:
    for m in messages:
        if isinstance(m, ModelRequest):
            for p in m.parts:
                if isinstance(p, UserPromptPart):
                    return str(p.content)
    return ""


def supervisor_model(tool: str, args: dict[str, Any], asked: Counter[str]) -> FunctionModel:
    """Calls ``tool`` once, then answers with what it returned."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked["supervisor"] += 1
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart(tool, args, tool_call_id="t1")])
        return ModelResponse(parts=[TextPart(f"boss: {last_results(messages)[0]}")])

    return FunctionModel(respond)


def researcher_model(asked: Counter[str]) -> FunctionModel:
    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked["researcher"] += 1
        return ModelResponse(parts=[TextPart(f"found: {prompt_of(messages)}")])

    return FunctionModel(respond)


def child_of(env: Harness, run_id: str) -> str:
    (started,) = [e for e in env.history(run_id) if e.kind == h.CHILD_STARTED]
    return str(started.data["run_id"])


def stepped_with_restarts(env: Harness) -> None:
    """One message at a time, dropping everything in memory in between: every activation
    replays the saga code of both runs from their histories."""
    for _ in range(500):
        if not env.step_once():
            break
        env.restart()
    env.run_until_idle()


def pydantic_app(asked: Counter[str]) -> tuple[App, SagaAgent[Any, Any]]:
    app = App("supervised")
    researcher = SagaAgent(
        Agent(researcher_model(asked), name="researcher", description="Looks things up."),
        app=app,
    )
    boss = SagaAgent(
        Agent(
            supervisor_model("researcher", {"prompt": "why is the sky blue"}, asked),
            name="boss",
            tools=[researcher.as_tool()],
        ),
        app=app,
    )

    @app.saga(name="supervise")
    async def supervise(ctx: SagaContext, question: str) -> str:
        return str((await boss.run(question)).output)

    return app, boss


def test_a_sub_agent_as_tool_is_a_child_run_whose_output_the_supervisor_reads() -> None:
    asked: Counter[str] = Counter()
    app, boss = pydantic_app(asked)
    env = Harness(app)
    run_id = env.start("supervise", "q")
    stepped_with_restarts(env)
    assert env.result(run_id) == "boss: found: why is the sky blue"
    child = child_of(env, run_id)
    record = env.get(child)
    assert (record.saga, record.status) == ("agent__researcher__as_tool", "completed")
    assert env.result(child) == "found: why is the sky blue"
    # the sub-agent's model request is a step of the child's run, not of the supervisor's
    child_steps = [e.name for e in env.history(child) if e.kind == h.STEP_COMPLETED]
    assert child_steps == ["agent__researcher__model_request"]
    parent_steps = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert parent_steps == ["agent__boss__model_request"] * 2
    assert asked == {"supervisor": 2, "researcher": 1}, "restarts asked no model again"
    assert "researcher" not in boss.tool_steps, "the tool has no step: it runs in saga code"


def test_cancelling_the_supervisor_cancels_the_sub_agents_child_run() -> None:
    asked: Counter[str] = Counter()
    app = App("supervised")

    @app.saga(name="slow-research")
    async def slow_research(ctx: SagaContext, topic: str) -> str:
        """Researches a topic once a person says go."""
        await ctx.wait_for_event("go")
        return f"done {topic}"

    boss = SagaAgent(
        Agent(
            supervisor_model("slow_research", {"topic": "tides"}, asked),
            name="boss",
            tools=[saga_as_tool(slow_research, name="slow_research")],
        ),
        app=app,
    )

    @app.saga(name="supervise")
    async def supervise(ctx: SagaContext, question: str) -> str:
        return str((await boss.run(question)).output)

    env = Harness(app)
    run_id = env.start("supervise", "q")
    env.run_until_idle()
    child = child_of(env, run_id)
    assert env.get(child).status == "waiting"
    assert "slow-research" in str(env.status(run_id)), "status shows the child"
    env.cancel(run_id)
    env.run_until_idle()
    assert env.get(run_id).status == "cancelled"
    assert env.get(child).status == "cancelled"
    assert asked == {"supervisor": 1}


def failing_app(asked: Counter[str], **tool_options: Any) -> App:
    app = App("supervised")

    @app.saga(name="lookup")
    async def lookup(ctx: SagaContext, topic: str) -> str:
        """Looks a topic up."""
        if topic == "nothing":
            raise ValueError("no such topic")
        return f"all about {topic}"

    boss = SagaAgent(
        Agent(
            supervisor_model("lookup", {"topic": "nothing"}, asked),
            name="boss",
            tools=[saga_as_tool(lookup, **tool_options)],
        ),
        app=app,
    )

    @app.saga(name="supervise")
    async def supervise(ctx: SagaContext, question: str) -> str:
        return str((await boss.run(question)).output)

    return app


def test_a_failed_child_fails_the_supervisor_or_with_failures_return_tells_the_model() -> None:
    env = Harness(failing_app(Counter()))
    run_id = env.start("supervise", "q")
    env.run_until_idle()
    assert env.get(run_id).status == "failed"
    assert env.get(child_of(env, run_id)).status == "failed"

    asked: Counter[str] = Counter()
    env = Harness(failing_app(asked, failures="return"))
    run_id = env.start("supervise", "q")
    env.run_until_idle()
    out = env.result(run_id)
    assert out.startswith("boss: the sub-agent 'lookup' failed:") and "no such topic" in out
    assert asked == {"supervisor": 2}


def test_a_sub_agent_tool_that_needs_approval_starts_its_child_only_once_approved() -> None:
    asked: Counter[str] = Counter()
    app = App("supervised")

    @app.saga(name="lookup")
    async def lookup(ctx: SagaContext, topic: str) -> str:
        """Looks a topic up."""
        return f"all about {topic}"

    boss = SagaAgent(
        Agent(
            supervisor_model("lookup", {"topic": "tides"}, asked),
            name="boss",
            tools=[saga_as_tool(lookup, requires_approval=True)],
        ),
        app=app,
    )

    @app.saga(name="supervise")
    async def supervise(ctx: SagaContext, question: str) -> str:
        return str((await boss.run(question)).output)

    env = Harness(app)
    run_id = env.start("supervise", "q")
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    assert not [e for e in env.history(run_id) if e.kind == h.CHILD_STARTED]
    env.approve(run_id, pending.call_id, args={"topic": "moons"})
    env.run_until_idle()
    assert env.result(run_id) == "boss: all about moons", "the edited arguments ran"


class Order(BaseModel):
    order_id: str
    cents: int


def test_a_saga_with_a_model_input_takes_its_fields_as_the_tools_arguments() -> None:
    asked: Counter[str] = Counter()
    app = App("supervised")

    @app.saga(name="refund")
    async def refund(ctx: SagaContext, order: Order) -> dict[str, Any]:
        """Refunds an order."""
        return {"refunded": order.order_id, "cents": order.cents}

    tool = saga_as_tool(refund)
    assert tool.name == "refund" and tool.description == "Refunds an order."
    schema = tool.function_schema.json_schema
    assert set(schema["properties"]) == {"order_id", "cents"}
    boss = SagaAgent(
        Agent(
            supervisor_model("refund", {"order_id": "o1", "cents": 300}, asked),
            name="boss",
            tools=[tool],
        ),
        app=app,
    )

    @app.saga(name="supervise")
    async def supervise(ctx: SagaContext, question: str) -> str:
        return str((await boss.run(question)).output)

    env = Harness(app)
    run_id = env.start("supervise", "q")
    env.run_until_idle()
    assert json.loads(env.result(run_id).removeprefix("boss: ").replace("'", '"')) == {
        "refunded": "o1",
        "cents": 300,
    }


def test_bad_declarations_and_calls_outside_a_saga_are_refused_with_the_fix() -> None:
    app = App("supervised")

    @app.saga(name="no.doc")
    async def no_doc(ctx: SagaContext, topic: str) -> str:
        return topic

    with pytest.raises(DeclarationError, match=r"name=\.\.\."):
        saga_as_tool(no_doc)
    with pytest.raises(DeclarationError, match="description"):
        saga_as_tool(no_doc, name="nodoc")
    with pytest.raises(DeclarationError, match=r"@app\.saga"):
        saga_as_tool(len, name="x", description="y")  # type: ignore[arg-type]
    tool = saga_as_tool(no_doc, name="nodoc", description="Echo.")
    plain = Agent(supervisor_model("nodoc", {"topic": "t"}, Counter()), tools=[tool])
    with pytest.raises(ValidationError, match="child run"):
        plain.run_sync("q")


# --- OpenAI Agents SDK ---------------------------------------------------------------------------


def oa_reply(*items: Any) -> Any:
    from agents.items import ModelResponse as OAResponse
    from agents.usage import Usage

    return OAResponse(
        output=list(items),
        usage=Usage(requests=1, input_tokens=3, output_tokens=2, total_tokens=5),
        response_id=None,
    )


def oa_outputs(call: Any) -> list[str]:
    return [
        str(i["output"])
        for i in call.input
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]


def openai_app() -> tuple[App, Any, Any]:
    from agents import Agent as OAAgent
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from sagaloop.agents.openai_agents import SagaRunner

    app = App("oa-supervised")
    sub_model = ScriptedModel([oa_reply(assistant_message("found: tides follow the moon"))])
    researcher: OAAgent[Any] = OAAgent(
        name="researcher", model=sub_model, handoff_description="Looks things up."
    )
    research = SagaRunner(app, researcher)
    boss_model = ScriptedModel(
        [
            oa_reply(function_call("researcher", {"prompt": "tides"}, call_id="c1")),
            ModelStep.respond(
                lambda call: oa_reply(assistant_message(f"boss: {oa_outputs(call)[0]}"))
            ),
        ]
    )
    boss: OAAgent[Any] = OAAgent(name="boss", model=boss_model, tools=[research.agent_as_tool()])
    runner = SagaRunner(app, boss)

    @app.saga(name="supervise")
    async def supervise(ctx: SagaContext, question: str) -> str:
        return str((await runner.run(boss, question)).final_output)

    return app, boss_model, sub_model


def test_an_openai_agent_as_tool_is_a_child_run_whose_output_the_supervisor_reads() -> None:
    app, boss_model, sub_model = openai_app()
    env = Harness(app)
    run_id = env.start("supervise", "q")
    stepped_with_restarts(env)
    assert env.result(run_id) == "boss: found: tides follow the moon"
    child = child_of(env, run_id)
    assert env.get(child).saga == "agent__researcher__as_tool"
    assert env.result(child) == "found: tides follow the moon"
    child_steps = [e.name for e in env.history(child) if e.kind == h.STEP_COMPLETED]
    assert child_steps == ["agent__researcher__model_request"]
    assert (len(boss_model.calls), len(sub_model.calls)) == (2, 1), "no model asked again"


def test_an_openai_saga_tool_validates_its_arguments_and_cancels_with_its_parent() -> None:
    from agents import Agent as OAAgent
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from sagaloop.agents.openai_agents import SagaRunner, saga_as_function_tool

    app = App("oa-supervised")

    @app.saga(name="slow-research")
    async def slow_research(ctx: SagaContext, order: Order) -> str:
        """Researches an order once a person says go."""
        await ctx.wait_for_event("go")
        return order.order_id

    tool = saga_as_function_tool(slow_research, name="slow_research")
    assert tool.params_json_schema["additionalProperties"] is False
    assert set(tool.params_json_schema["required"]) == {"order_id", "cents"}
    model = ScriptedModel(
        [
            oa_reply(function_call("slow_research", {"order_id": "o1"}, call_id="c0")),
            ModelStep.respond(
                lambda call: oa_reply(
                    function_call("slow_research", {"order_id": "o1", "cents": 5}, call_id="c1")
                )
            ),
            oa_reply(assistant_message("never")),
        ]
    )
    boss: OAAgent[Any] = OAAgent(name="boss", model=model, tools=[tool])
    runner = SagaRunner(app, boss)

    @app.saga(name="supervise")
    async def supervise(ctx: SagaContext, question: str) -> str:
        return str((await runner.run(boss, question)).final_output)

    env = Harness(app)
    run_id = env.start("supervise", "q")
    env.run_until_idle()
    # the first call lacked an argument: the model was told, and no child started for it
    assert "cents" in oa_outputs(model.calls[1])[0]
    child = child_of(env, run_id)
    assert env.get(child).status == "waiting"
    env.cancel(run_id)
    env.run_until_idle()
    assert (env.get(run_id).status, env.get(child).status) == ("cancelled", "cancelled")
