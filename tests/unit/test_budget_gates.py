"""Budgets as gates (issue 22, section 2): a batch of parallel tool calls is checked against
what is left before any of it runs, in both adapters and in ``StepTools.dispatch``; every tool
kind counts; every documented entry point takes ``budget=``. Offline: FunctionModel and the
Agents SDK's ScriptedModel; the harness replays every activation."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from agents import Agent as OAAgent
from agents import function_tool
from agents.items import ModelResponse as OAResponse
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from agents.usage import Usage as OAUsage
from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent, models
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, SagaContext, StepContext
from sagaloop.agents import USAGE_KEY, Budget
from sagaloop.agents.openai_agents import SagaRunner, step_as_function_tool
from sagaloop.agents.pydantic_ai import SagaAgent, step_as_tool
from sagaloop.agents.tools import StepTools
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False

BATCH = 5


class Fanout:
    """A model that asks for ``BATCH`` parallel calls of ``tool`` once, then answers with the
    texts of what came back; counts its requests from outside the engine."""

    def __init__(self, tool: str = "ping") -> None:
        self.tool = tool
        self.requests = 0
        self.seen: list[str] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if self.requests == 1:
            calls = [ToolCallPart(self.tool, {"i": i}, tool_call_id=f"c{i}") for i in range(BATCH)]
            return ModelResponse(parts=calls)
        returns = [
            str(p.content)
            for p in messages[-1].parts
            if getattr(p, "part_kind", "") in ("tool-return", "retry-prompt")
        ]
        self.seen = returns
        return ModelResponse(parts=[TextPart(f"{len(returns)} answers")])


def fanout_agent(budget: Budget, *, step_tool: bool = False) -> tuple[App, Fanout, Counter[str]]:
    app = App("gates")
    effects: Counter[str] = Counter()
    model = Fanout()
    agent = Agent(FunctionModel(model), name="fan")
    if step_tool:

        @app.step
        def ping(ctx: StepContext, i: int) -> str:
            effects["ping"] += 1
            return f"pong {i}"

        agent = Agent(FunctionModel(model), name="fan", tools=[step_as_tool(ping)])
    else:

        @agent.tool_plain
        def ping(i: int) -> str:
            effects["ping"] += 1
            return f"pong {i}"

    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("go", budget=budget)).output)

    return app, model, effects


@pytest.mark.parametrize("step_tool", [False, True])
def test_pydantic_ai_a_batch_over_the_tool_call_budget_runs_none_of_it(step_tool: bool) -> None:
    app, model, effects = fanout_agent(Budget(tool_calls=3), step_tool=step_tool)
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert run.error is not None and run.error["type"] == "BudgetExceeded"
    assert f"tool_calls 0+{BATCH} of 3" in run.error["message"]
    assert effects["ping"] == 0, "no call of the refused batch ran"
    assert model.requests == 1


def test_pydantic_ai_a_refused_batch_can_be_told_to_the_model() -> None:
    app, model, effects = fanout_agent(Budget(tool_calls=3, on_exceed="tell_model"))
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert effects["ping"] == 0
    assert len(model.seen) == BATCH
    assert all("budget" in text and "3 more" in text for text in model.seen), model.seen
    env.restart()
    env.run_until_idle()
    assert env.get(run_id).status == "completed" and model.requests == 2


def test_pydantic_ai_a_batch_waits_for_a_raise_before_any_of_it_runs() -> None:
    app, _, effects = fanout_agent(Budget(tool_calls=3, on_exceed="wait"))
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"
    assert effects["ping"] == 0
    env.send_event(run_id, "budget", {"tool_calls": 10})
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert effects["ping"] == BATCH
    assert env.client.get_published(run_id, USAGE_KEY)["tool_calls"] == BATCH


def test_pydantic_ai_a_batch_within_the_budget_runs() -> None:
    app, _, effects = fanout_agent(Budget(tool_calls=BATCH + 1))
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert effects["ping"] == BATCH


def test_pydantic_ai_budget_is_taken_by_run_run_stream_and_iter() -> None:
    app = App("gates")
    agent = Agent(FunctionModel(lambda m, i: ModelResponse(parts=[TextPart("hi")])), name="a")
    saga_agent = SagaAgent(agent, app=app)
    spent = Budget(requests=0)

    @app.saga(name="run")
    async def run(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x", budget=spent)).output)

    @app.saga(name="stream")
    async def stream(ctx: SagaContext) -> str:
        async with saga_agent.run_stream("x", budget=spent) as streamed:
            return str(await streamed.get_output())

    @app.saga(name="iter")
    async def iterate(ctx: SagaContext) -> str:
        async with saga_agent.iter("x", budget=spent) as agent_run:
            async for _ in agent_run:
                pass
        return "done"

    @app.saga(name="free")
    async def free(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x")).output)

    env = Harness(app)
    for saga in ("run", "stream", "iter"):
        run_id = env.start(saga)
        env.run_until_idle()
        error = env.get(run_id).error
        assert error is not None and error["type"] == "BudgetExceeded", (saga, error)
    run_id = env.start("free")
    env.run_until_idle()
    assert env.result(run_id) == "hi", "the budget of one run is not the next one's"

    @app.saga(name="stream-free")
    async def stream_free(ctx: SagaContext) -> str:
        async with saga_agent.run_stream("x") as streamed:
            return str(await streamed.get_output())

    run_id = env.start("stream-free")
    env.run_until_idle()
    assert env.result(run_id) == "hi"
    steps = [e.name for e in env.history(run_id) if e.kind == "step_completed"]
    assert steps == ["agent__a__model_request"], "run_stream's request is the model step"
    assert saga_agent.run_sync("x", budget=spent).output == "hi"  # outside a saga: plain


# --- OpenAI Agents ---------------------------------------------------------------------------


def oa_reply(*items: Any) -> OAResponse:
    return OAResponse(output=list(items), usage=OAUsage(requests=1), response_id=None)


def outputs_of(call: Any) -> list[str]:
    return [
        str(i["output"])
        for i in call.input
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]


def oa_app(
    budget: Budget | None, calls: list[tuple[str, dict[str, Any]]]
) -> tuple[App, ScriptedModel, Counter[str]]:
    app = App("oa-gates")
    effects: Counter[str] = Counter()

    @function_tool
    def ping(i: int) -> str:
        """Ping."""
        effects["ping"] += 1
        return f"pong {i}"

    @app.step
    def charge(ctx: StepContext, i: int) -> str:
        """Charge."""
        effects["charge"] += 1
        return f"charged {i}"

    model = ScriptedModel(
        [
            oa_reply(*[function_call(n, a, call_id=f"c{k}") for k, (n, a) in enumerate(calls)]),
            ModelStep.respond(
                lambda call: oa_reply(assistant_message(json.dumps(outputs_of(call))))
            ),
        ]
    )
    agent: OAAgent[Any] = OAAgent(
        name="fan", model=model, tools=[ping, step_as_function_tool(charge)]
    )
    runner = SagaRunner(app, agent, budget=budget)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await runner.run(agent, "go")).final_output)

    return app, model, effects


def test_openai_step_tools_count_as_tool_calls() -> None:
    app, _, effects = oa_app(None, [("ping", {"i": 1}), ("charge", {"i": 2})])
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert effects == Counter({"ping": 1, "charge": 1})
    assert env.client.get_published(run_id, USAGE_KEY)["tool_calls"] == 2


@pytest.mark.parametrize("tool", ["ping", "charge"])
def test_openai_a_batch_over_the_tool_call_budget_runs_none_of_it(tool: str) -> None:
    app, model, effects = oa_app(Budget(tool_calls=3), [(tool, {"i": i}) for i in range(BATCH)])
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert run.error is not None and run.error["type"] == "BudgetExceeded"
    assert f"tool_calls 0+{BATCH} of 3" in run.error["message"]
    assert not effects, "no call of the refused batch ran"
    assert len(model.calls) == 1


def test_openai_a_refused_batch_can_be_told_to_the_model() -> None:
    calls = [("ping", {"i": 0}), ("charge", {"i": 1}), ("ping", {"i": 2})]
    app, _, effects = oa_app(Budget(tool_calls=2, on_exceed="tell_model"), calls)
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert not effects
    told = json.loads(env.result(run_id))
    assert len(told) == 3 and all("2 more" in t for t in told), told


# --- StepTools.dispatch ----------------------------------------------------------------------


def dispatch_app(budget: Budget) -> tuple[App, Counter[str]]:
    app = App("loop")
    effects: Counter[str] = Counter()

    @app.step
    def ping(ctx: StepContext, i: int) -> str:
        """Ping."""
        effects["ping"] += 1
        return f"pong {i}"

    tools = StepTools(ping)
    calls = [
        {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "ping", "arguments": f'{{"i": {i}}}'},
        }
        for i in range(BATCH)
    ]

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> list[str]:
        results = await tools.dispatch(ctx, calls, budget=budget)
        return [r.content for r in results]

    return app, effects


def test_dispatch_checks_the_batch_before_any_of_it_runs() -> None:
    app, effects = dispatch_app(Budget(tool_calls=3))
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    error = env.get(run_id).error
    assert error is not None and error["type"] == "BudgetExceeded", error
    assert not effects


def test_dispatch_can_tell_the_model_and_counts_what_runs() -> None:
    app, effects = dispatch_app(Budget(tool_calls=3, on_exceed="tell_model"))
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    told = env.result(run_id)
    assert len(told) == BATCH and all("3 more" in t for t in told), told
    assert not effects
    app, effects = dispatch_app(Budget(tool_calls=BATCH))
    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    assert env.result(run_id) == [f"pong {i}" for i in range(BATCH)]
    assert env.client.get_published(run_id, USAGE_KEY)["tool_calls"] == BATCH


def test_agent_runs_at_once_in_one_saga_run_are_not_let_through_with_the_same_calls() -> None:
    """Two agent runs of one saga run, gathered: each response asks for 5 calls under
    Budget(tool_calls=7), calls that wait for a person's approval before they run (and are
    counted); the first batch let through counts as spent until it has run."""
    app = App("gates")
    effects: Counter[str] = Counter()
    models_ = [Fanout(), Fanout()]
    budget = Budget(tool_calls=7, on_exceed="tell_model")
    agents = []
    for n, model in enumerate(models_):
        agent = Agent(FunctionModel(model), name=f"fan{n}")

        @agent.tool_plain(requires_approval=True)
        def ping(i: int) -> str:
            effects["ping"] += 1
            return f"pong {i}"

        agents.append(SagaAgent(agent, app=app, budget=budget))

    @app.saga(name="both")
    async def both(ctx: SagaContext) -> list[str]:
        results = await ctx.gather(*(a.run("go") for a in agents))
        return [str(r.output) for r in results]

    env = Harness(app)
    run_id = env.start("both")
    env.run_until_idle()
    for pending in env.approvals(run_id):
        env.approve(run_id, pending.call_id, by="ops")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert effects["ping"] == BATCH, "one batch ran, the other was refused"
    refused = [m for m in models_ if all("2 more" in t for t in m.seen)]
    assert len(refused) == 1, [m.seen for m in models_]
    assert env.client.get_published(run_id, USAGE_KEY)["tool_calls"] == BATCH


def test_pydantic_ai_mcp_tool_calls_are_gated_too(tmp_path: Path) -> None:
    """An MCP server's tool calls are a batch like any other: refused before any runs."""
    app = App("gates")
    ledger = tmp_path / "ledger.txt"
    transport = StdioTransport(
        sys.executable,
        [str(Path(__file__).with_name("mcp_server.py")), str(ledger)],
        keep_alive=False,
    )
    model = Fanout("refund")

    def refunds(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if model.requests == 0:
            model.requests += 1
            calls = [ToolCallPart("refund", {"order": f"o{i}", "amount": 5}) for i in range(3)]
            return ModelResponse(parts=calls)
        return model(messages, info)

    agent = Agent(FunctionModel(refunds), name="mcp", toolsets=[MCPToolset(transport, id="pay")])
    saga_agent = SagaAgent(agent, app=app, budget=Budget(tool_calls=2, on_exceed="tell_model"))

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("go")).output)

    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert not ledger.exists(), "no refund of the refused batch ran"
    assert len(model.seen) == 3 and all("2 more" in t for t in model.seen), model.seen


def test_openai_nobody_is_asked_to_approve_a_refused_batch() -> None:
    app = App("oa-gates")
    effects: Counter[str] = Counter()

    @function_tool(needs_approval=True)
    def pay(i: int) -> str:
        """Pay."""
        effects["pay"] += 1
        return f"paid {i}"

    model = ScriptedModel(
        [
            oa_reply(*[function_call("pay", {"i": i}, call_id=f"c{i}") for i in range(3)]),
            ModelStep.respond(
                lambda call: oa_reply(assistant_message(json.dumps(outputs_of(call))))
            ),
        ]
    )
    agent: OAAgent[Any] = OAAgent(name="payer", model=model, tools=[pay])
    runner = SagaRunner(app, agent, budget=Budget(tool_calls=2, on_exceed="tell_model"))

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await runner.run(agent, "go")).final_output)

    env = Harness(app)
    run_id = env.start("s")
    env.run_until_idle()
    assert env.approvals(run_id) == []
    assert env.get(run_id).status == "completed", env.get(run_id).error
    told = json.loads(env.result(run_id))
    assert len(told) == 3 and all("2 more" in t for t in told), told
    assert not effects


def test_openai_parallel_calls_that_need_approval_are_each_answered() -> None:
    """Three calls of one response, each needing approval: recorded responses kept the field
    ``async_`` under its name, so the SDK could not tell the pending approvals apart."""
    app = App("oa-gates")
    effects: Counter[str] = Counter()

    @function_tool(needs_approval=True)
    def pay(i: int) -> str:
        """Pay."""
        effects[f"pay {i}"] += 1
        return f"paid {i}"

    model = ScriptedModel(
        [
            oa_reply(*[function_call("pay", {"i": i}, call_id=f"c{i}") for i in range(3)]),
            ModelStep.respond(
                lambda call: oa_reply(assistant_message(json.dumps(outputs_of(call))))
            ),
        ]
    )
    agent: OAAgent[Any] = OAAgent(name="payer", model=model, tools=[pay])
    runner = SagaRunner(app, agent, budget=Budget(tool_calls=4))

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await runner.run(agent, "go")).final_output)

    env = Harness(app)
    run_id = env.start("s")
    for _ in range(3):
        env.run_until_idle()
        [pending] = env.approvals(run_id)
        env.approve(run_id, pending.call_id, by="ops")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert json.loads(env.result(run_id)) == ["paid 0", "paid 1", "paid 2"]
    assert effects == Counter({"pay 0": 1, "pay 1": 1, "pay 2": 1})
