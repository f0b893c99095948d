"""OpenAI Agents SDK agents run as a saga (offline: the SDK's ScriptedModel, no network).

Each model call and each function tool call is a step, recorded once; the harness replays every
activation, so each test also checks that the SDK's loop replays deterministically."""

from __future__ import annotations

import json
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, GuardrailFunctionOutput, RunContextWrapper, function_tool, handoff
from agents.exceptions import InputGuardrailTripwireTriggered
from agents.guardrail import input_guardrail
from agents.items import ModelResponse
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from agents.usage import Usage
from pydantic import BaseModel

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.agents import USAGE_KEY, Budget, BudgetExceeded, ToolPolicy
from sagaloop.agents.openai_agents import SagaRunner, step_as_function_tool
from sagaloop.engine import history as h
from sagaloop.errors import ValidationError
from sagaloop.runtime.assembly import lane_queue
from sagaloop.testing import Harness

MCP_SERVER = Path(__file__).with_name("mcp_server.py")


class Ctx(BaseModel):
    base: int


class Charge(BaseModel):
    cents: int
    note: str = ""


def usage(i: int = 10, o: int = 5) -> Usage:
    return Usage(requests=1, input_tokens=i, output_tokens=o, total_tokens=i + o)


def reply(*items: Any) -> ModelResponse:
    return ModelResponse(output=list(items), usage=usage(), response_id=None)


def outputs_of(call: Any) -> list[str]:
    """The tool outputs the model was sent in this call."""
    return [
        str(i["output"])
        for i in call.input
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]


def call_then_echo(name: str, args: dict[str, Any], *, call_id: str) -> ScriptedModel:
    """A model that calls one tool, then answers with what it returned."""
    return ScriptedModel(
        [
            reply(function_call(name, args, call_id=call_id)),
            ModelStep.respond(lambda call: reply(assistant_message(outputs_of(call)[0]))),
        ]
    )


def answer_saga(app: App, runner: SagaRunner, agent: Agent[Any], name: str) -> None:
    """Declares the saga ``name``: runs ``agent`` on its input, returns the final output."""

    @app.saga(name=name)
    async def answer(ctx: SagaContext, prompt: str) -> str:
        return str((await runner.run(agent, prompt)).final_output)


def refund_app(
    model: ScriptedModel, **runner_options: Any
) -> tuple[App, SagaRunner, Agent[Any], Counter[str]]:
    app = App("oa")
    effects: Counter[str] = Counter()

    @function_tool
    def add(ctx: RunContextWrapper[Ctx], a: int, b: int) -> int:
        """Add two numbers and the base."""
        effects[f"add {a} {b}"] += 1
        return a + b + ctx.context.base

    @function_tool
    async def greet(who: str) -> str:
        """Greet someone."""
        effects[f"greet {who}"] += 1
        return f"hi {who}"

    agent: Agent[Ctx] = Agent(name="refunds", model=model, tools=[add, greet])
    runner = SagaRunner(app, agent, context_type=Ctx, **runner_options)

    @app.saga(name="ask")
    async def ask(ctx: SagaContext, prompt: str) -> str:
        result = await runner.run(agent, prompt, context=Ctx(base=10))
        return str(result.final_output)

    return app, runner, agent, effects


def two_tools_then_answer() -> ScriptedModel:
    return ScriptedModel(
        [
            reply(
                assistant_message("let me see"),
                function_call("add", {"a": 1, "b": 2}, call_id="c1"),
                function_call("greet", {"who": "ann"}, call_id="c2"),
            ),
            ModelStep.respond(lambda call: reply(assistant_message(json.dumps(outputs_of(call))))),
        ]
    )


def test_step_names_are_pinned() -> None:
    """Step names are compatibility data: runs in flight find their steps by them."""
    _, runner, _, _ = refund_app(two_tools_then_answer())
    assert runner.step_names == [
        "agent__refunds__model_request",
        "agent__refunds__tool__add",
        "agent__refunds__tool__greet",
    ]
    assert runner.model_steps["refunds"].queue == "model"
    assert runner.tool_steps[("refunds", "add")].queue == "tools"


def test_model_and_tools_run_once_each_across_restarts() -> None:
    model = two_tools_then_answer()
    app, _, _, effects = refund_app(model)
    env = Harness(app)
    run_id = env.start("ask", "refund please")
    env.step_once()
    env.restart()
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id)
    assert json.loads(env.result(run_id)) == ["13", "hi ann"]
    model.assert_complete()
    assert len(model.calls) == 2, "no model call paid twice"
    assert effects == Counter({"add 1 2": 1, "greet ann": 1})
    done = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert done.count("agent__refunds__model_request") == 2
    assert sorted(n for n in done if "__tool__" in n) == [
        "agent__refunds__tool__add",
        "agent__refunds__tool__greet",
    ]
    published = env.client._published(run_id)[USAGE_KEY]
    assert published["requests"] == 2 and published["input_tokens"] == 20
    assert published["tool_calls"] == 2


def test_the_second_request_records_only_new_items() -> None:
    model = two_tools_then_answer()
    app, _, _, _ = refund_app(model)
    env = Harness(app)
    run_id = env.start("ask", "refund please")
    env.run_until_idle()
    deltas = [
        e.data["args"]["request"]["transcript"]
        for e in env.history(run_id)
        if e.kind == h.STEP_SCHEDULED and e.name == "agent__refunds__model_request"
    ]
    assert [d["n"] for d in deltas] == [0, 1]
    assert deltas[1]["prev"] == 0 and deltas[1]["keep"] == 1
    assert len(deltas[1]["append"]) == 5  # message, two calls, two outputs


def test_a_tool_that_needs_approval_pauses_the_same_run() -> None:
    model = call_then_echo("refund", {"amount": 300}, call_id="c1")
    app = App("oa")
    paid: list[int] = []

    @function_tool(needs_approval=True)
    def refund(amount: int) -> str:
        """Refund an amount."""
        paid.append(amount)
        return f"refunded {amount}"

    agent: Agent[Any] = Agent(name="payer", model=model, tools=[refund])
    runner = SagaRunner(app, agent)

    answer_saga(app, runner, agent, "pay")

    env = Harness(app)
    run_id = env.start("pay", "refund 300")
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"
    (pending,) = env.approvals(run_id)
    assert (pending.action, pending.args) == ("refund", {"amount": 300})
    assert paid == []
    env.restart()
    env.approve(run_id, pending.call_id, args={"amount": 250}, by="maria")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert env.result(run_id) == "refunded 250"
    assert paid == [250]
    model.assert_complete()


def test_a_denied_tool_call_reaches_the_model_as_its_result() -> None:
    model = call_then_echo("refund", {"amount": 300}, call_id="c1")
    app = App("oa")

    @function_tool
    def refund(amount: int) -> str:
        """Refund an amount."""
        raise AssertionError("a denied call must not run")

    agent: Agent[Any] = Agent(name="payer", model=model, tools=[refund])
    runner = SagaRunner(app, agent, tools={"refund": ToolPolicy(requires_approval=True)})

    answer_saga(app, runner, agent, "pay")

    env = Harness(app)
    run_id = env.start("pay", "refund 300")
    env.run_until_idle()
    (pending,) = env.approvals(run_id)
    env.deny(run_id, pending.call_id, reason="over the limit")
    env.run_until_idle()
    assert env.result(run_id) == "The tool call was denied: over the limit"


def test_handoffs_move_to_the_durable_target_and_replay() -> None:
    triage_model = ScriptedModel([reply(function_call("transfer_to_billing", {}, call_id="h1"))])
    billing_model = ScriptedModel(
        [
            reply(function_call("charge", {"cents": 500}, call_id="c1")),
            reply(assistant_message("billed")),
        ]
    )
    app = App("oa")
    charged: list[int] = []

    @function_tool
    def charge(cents: int) -> str:
        """Charge."""
        charged.append(cents)
        return "ok"

    billing: Agent[Any] = Agent(name="billing", model=billing_model, tools=[charge])
    triage: Agent[Any] = Agent(name="triage", model=triage_model, handoffs=[handoff(billing)])
    runner = SagaRunner(app, triage)
    assert "agent__billing__tool__charge" in runner.step_names

    @app.saga(name="route")
    async def route(ctx: SagaContext, prompt: str) -> str:
        result = await runner.run(triage, prompt)
        return f"{result.last_agent.name}: {result.final_output}"

    env = Harness(app)
    run_id = env.start("route", "I was double charged")
    env.run_until_idle()
    assert env.result(run_id) == "billing: billed"
    assert charged == [500]
    triage_model.assert_complete()
    billing_model.assert_complete()


def test_a_guardrail_agent_run_by_the_runner_is_durable_and_trips() -> None:
    guard_model = ScriptedModel([reply(assistant_message("unsafe"))])
    main_model = ScriptedModel([reply(assistant_message("never sent"))])
    app = App("oa")
    guard: Agent[Any] = Agent(name="guard", model=guard_model)

    @input_guardrail
    async def check(ctx: RunContextWrapper[Any], agent: Agent[Any], text: Any) -> Any:
        verdict = await runner.run(guard, str(text))
        return GuardrailFunctionOutput(
            output_info=verdict.final_output, tripwire_triggered=verdict.final_output == "unsafe"
        )

    main: Agent[Any] = Agent(
        name="main", model=main_model, input_guardrails=[check], tool_use_behavior="run_llm_again"
    )
    runner = SagaRunner(app, main, guard)

    @app.saga(name="guarded")
    async def guarded(ctx: SagaContext, prompt: str) -> str:
        try:
            await runner.run(main, prompt)
        except InputGuardrailTripwireTriggered:
            return "blocked"
        return "passed"

    env = Harness(app)
    run_id = env.start("guarded", "do something bad")
    env.run_until_idle()
    assert env.result(run_id) == "blocked"
    guard_model.assert_complete()


def test_step_as_function_tool_calls_the_step_with_its_policy() -> None:
    app = App("oa")
    charged: list[int] = []

    @app.step(name="billing.charge", idempotent=False)
    def charge(ctx: StepContext, order: str, charge: Charge) -> dict[str, Any]:
        """Charge an order."""
        charged.append(charge.cents)
        return {"order": order, "cents": charge.cents}

    tool = step_as_function_tool(charge, name="charge")
    assert tool.params_json_schema["required"] == ["order", "charge"]
    model = call_then_echo("charge", {"order": "o1", "charge": {"cents": 5}}, call_id="c")
    agent: Agent[Any] = Agent(name="cashier", model=model, tools=[tool])
    runner = SagaRunner(app, agent)
    assert runner.step_names == ["agent__cashier__model_request"]

    answer_saga(app, runner, agent, "sell")

    env = Harness(app)
    run_id = env.start("sell", "charge o1")
    env.run_until_idle()
    assert json.loads(env.result(run_id)) == {"order": "o1", "cents": 5}
    assert charged == [5]
    done = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert "billing.charge" in done


def test_a_budget_stops_the_run_and_it_compensates() -> None:
    model = ScriptedModel(
        [reply(function_call("greet", {"who": f"n{i}"}, call_id=f"c{i}")) for i in range(5)]
    )
    app, _, _, effects = refund_app(model, budget=Budget(requests=2))
    env = Harness(app)
    run_id = env.start("ask", "loop")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert "BudgetExceeded" in str(run.error) or "budget" in str(run.error)
    assert len(model.calls) == 2
    assert effects == Counter({"greet n0": 1, "greet n1": 1})


def test_budget_exceeded_is_the_error_type() -> None:
    assert issubclass(BudgetExceeded, Exception)


def test_declaration_errors_are_clear() -> None:
    app = App("oa")
    a: Agent[Any] = Agent(name="same", model=ScriptedModel())
    b: Agent[Any] = Agent(name="same", model=ScriptedModel(), handoffs=[a])
    with pytest.raises(ValidationError, match="two agents are named 'same'"):
        SagaRunner(app, b)
    with pytest.raises(ValidationError, match="unknown tools"):
        SagaRunner(App("oa2"), Agent(name="x", model=ScriptedModel()), tools={"nope": ToolPolicy()})


def test_the_tool_policy_reaches_the_step() -> None:
    _, runner, _, _ = refund_app(
        two_tools_then_answer(),
        tools={"add": ToolPolicy(queue="math", idempotent=False, timeout=timedelta(seconds=5))},
    )
    step = runner.tool_steps[("refunds", "add")]
    assert (step.queue, step.idempotent, step.timeout) == ("math", False, timedelta(seconds=5))


def test_streamed_events_reach_the_runs_channel_and_the_response_is_recorded_once() -> None:
    model = ScriptedModel([reply(assistant_message("refund approved for o1"))])
    app = App("oa")
    agent: Agent[Any] = Agent(name="talker", model=model)
    runner = SagaRunner(app, agent, stream=True)

    answer_saga(app, runner, agent, "s")

    env = Harness(app)
    run_id = env.start("s", "x")
    live = env.streams.subscribe(run_id)
    env.run_until_idle()
    assert env.result(run_id) == "refund approved for o1"
    items = live.get(0.1)
    texts = [i["data"]["text"] for i in items if i["data"]["text"]]
    assert "".join(texts) == "refund approved for o1"
    assert {i["step"] for i in items} == {"agent__talker__model_request"}
    assert [c.streamed for c in model.calls] == [True], "the model was asked once, streaming"
    events = {i["data"]["event"]["type"] for i in items}
    assert "response.completed" in events


def test_mcp_server_tools_are_listed_and_called_through_steps(tmp_path: Path) -> None:
    from agents.mcp import MCPServerStdio

    ledger = tmp_path / "ledger.txt"
    server = MCPServerStdio(
        {"command": sys.executable, "args": [str(MCP_SERVER), str(ledger)]},
        name="payments",
        client_session_timeout_seconds=30,
    )
    model = call_then_echo("refund", {"order": "o1", "amount": 300}, call_id="m1")
    app = App("oa")
    agent: Agent[Any] = Agent(name="refunder", model=model, mcp_servers=[server])
    runner = SagaRunner(app, agent)
    assert runner.step_names == [
        "agent__refunder__mcp__payments__call_tool",
        "agent__refunder__mcp__payments__list_tools",
        "agent__refunder__model_request",
    ]

    answer_saga(app, runner, agent, "r")

    env = Harness(app)
    run_id = env.start("r", "refund o1")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id)
    assert "rf-o1-300" in str(env.result(run_id))
    assert ledger.read_text().splitlines() == ["refund o1 300"]
    sent_tools = [t.name for t in model.calls[0].tools]
    assert sent_tools == ["refund"]
    done = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert done.count("agent__refunder__mcp__payments__call_tool") == 1


class Verdict(BaseModel):
    refund: bool
    cents: int


def test_a_structured_output_is_validated_in_saga_code_and_replays() -> None:
    model = ScriptedModel([reply(assistant_message('{"refund": true, "cents": 4200}'))])
    app = App("oa")
    agent: Agent[Any] = Agent(name="judge", model=model, output_type=Verdict)
    runner = SagaRunner(app, agent)

    @app.saga(name="judge")
    async def judge(ctx: SagaContext, prompt: str) -> Verdict:
        output = (await runner.run(agent, prompt)).final_output
        assert isinstance(output, Verdict)
        return output

    env = Harness(app)
    run_id = env.start("judge", "decide")
    env.run_until_idle()
    assert env.result(run_id) == Verdict(refund=True, cents=4200)
    (call,) = model.calls
    assert call.output_schema is not None and call.output_schema.name() == "Verdict"


def test_an_approver_edits_the_arguments_of_a_step_tool() -> None:
    app = App("oa")
    refunded: list[int] = []

    @app.step(name="billing.refund", idempotent=False)
    def refund(ctx: StepContext, cents: int) -> str:
        """Refund."""
        refunded.append(cents)
        return f"refunded {cents}"

    model = call_then_echo("refund", {"cents": 900}, call_id="r1")
    agent: Agent[Any] = Agent(
        name="payer",
        model=model,
        tools=[step_as_function_tool(refund, name="refund", needs_approval=True)],
    )
    runner = SagaRunner(app, agent)

    answer_saga(app, runner, agent, "pay")

    env = Harness(app)
    run_id = env.start("pay", "refund")
    env.run_until_idle()
    (pending,) = env.approvals(run_id)
    env.approve(run_id, pending.call_id, args={"cents": 500})
    env.run_until_idle()
    assert refunded == [500]
    assert env.result(run_id) == "refunded 500"


def test_a_context_that_is_not_json_is_refused_with_what_to_do() -> None:
    model = ScriptedModel([reply(assistant_message("x"))])
    app = App("oa")
    agent: Agent[Any] = Agent(name="a", model=model)
    runner = SagaRunner(app, agent)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await runner.run(agent, "x", context=object())).final_output)

    env = Harness(app)
    run_id = env.start("s", "x")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert "pass ids and URLs, not connections" in str(run.error)


def _in_doubt_app(reconcile: bool) -> tuple[App, list[str]]:
    app = App("oa")
    attempts: list[str] = []
    provider: dict[str, str] = {}

    def find(ctx: StepContext, args: dict[str, Any]) -> Any:
        return provider.get(args["order"])

    @function_tool
    def pay(order: str) -> str:
        """Pay an order."""
        attempts.append(order)
        provider[order] = f"paid-{order}"
        if len(attempts) == 1:
            raise ConnectionError("the response was lost")  # the effect happened
        return provider[order]

    model = call_then_echo("pay", {"order": "o7"}, call_id="p1")
    agent: Agent[Any] = Agent(name="payer", model=model, tools=[pay])
    policy = ToolPolicy(idempotent=False, reconcile=find if reconcile else None)
    runner = SagaRunner(app, agent, tools={"pay": policy})

    answer_saga(app, runner, agent, "s")

    return app, attempts


def test_an_in_doubt_non_idempotent_tool_halts() -> None:
    """The SDK would hand the exception to the model as text, and the model would ask again:
    on the worker the exception fails the attempt, which is in doubt."""
    app, attempts = _in_doubt_app(reconcile=False)
    env = Harness(app)
    run_id = env.start("s", "x")
    env.run_until_idle()
    assert env.get(run_id).status == "needs_attention"
    assert attempts == ["o7"], "never blindly repeated"


def test_an_in_doubt_tool_with_reconcile_is_not_repeated() -> None:
    app, attempts = _in_doubt_app(reconcile=True)
    env = Harness(app)
    run_id = env.start("s", "x")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert attempts == ["o7"]
    assert env.result(run_id) == "paid-o7"


def test_a_failing_tool_is_retried_then_told_to_the_model_as_the_sdk_would() -> None:
    app = App("oa")
    calls: list[int] = []

    @function_tool
    def flaky(n: int) -> str:
        """Flaky."""
        calls.append(n)
        raise TimeoutError("upstream timed out")

    model = call_then_echo("flaky", {"n": 1}, call_id="f1")
    agent: Agent[Any] = Agent(name="a", model=model, tools=[flaky])
    retry = RetryPolicy(max_attempts=3, initial_interval=timedelta(seconds=1))
    runner = SagaRunner(app, agent, tools={"flaky": ToolPolicy(retry=retry)})

    answer_saga(app, runner, agent, "s")

    env = Harness(app)
    run_id = env.start("s", "x")
    env.run_until_idle()
    assert calls == [1, 1, 1], "the step's retry policy"
    assert env.result(run_id) == "An error occurred while running the tool. Please try again."


def test_a_known_model_is_priced_on_the_worker_and_a_cost_budget_stops_the_run() -> None:
    usage_1k = Usage(requests=1, input_tokens=1000, output_tokens=500, total_tokens=1500)
    model = ScriptedModel(
        [
            ModelResponse(
                output=[function_call("greet", {"who": f"n{i}"}, call_id=f"c{i}")],
                usage=usage_1k,
                response_id=None,
            )
            for i in range(3)
        ]
    )
    model.model = "gpt-4o"  # type: ignore[attr-defined]  # the name an OpenAI model carries
    app, _, _, effects = refund_app(model, budget=Budget(cost=0.01))
    env = Harness(app)
    run_id = env.start("ask", "loop")
    env.run_until_idle()
    assert env.get(run_id).status == "failed"
    assert "cost" in str(env.get(run_id).error)
    assert len(model.calls) == 2, "0.0075 each: the third request would pass 0.01"
    assert effects == Counter({"greet n0": 1, "greet n1": 1})
    assert env.client._published(run_id)[USAGE_KEY]["cost"] == pytest.approx(0.015)


def test_a_runner_whose_steps_are_local_runs_without_a_worker() -> None:
    """``SagaRunner(..., local=True)``: the model requests and the tools are in-process steps,
    run by the engine's processes (the harness consumes the engine's queue and the in-process
    lane only); ``ToolPolicy(local=False)`` keeps a tool on its queue."""
    model = two_tools_then_answer()
    app, runner, _, effects = refund_app(
        model, local=True, tools={"greet": ToolPolicy(local=False)}
    )
    assert runner.model_steps["refunds"].local and runner.tool_steps[("refunds", "add")].local
    assert not runner.tool_steps[("refunds", "greet")].local
    env = Harness(app)
    env.queues = [f"{app.name}.engine", lane_queue(app)]
    run_id = env.start("ask", "refund please")
    env.run_until_idle()
    assert env.get(run_id).status == "running", "greet waits on its queue for a worker"
    env.queues = None
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id)
    assert effects == Counter({"add 1 2": 1, "greet ann": 1})
