"""A Pydantic AI agent run as a saga (offline: FunctionModel, no network).

Each model request and each tool call is a step, recorded once; the harness replays every
activation, so each test also checks that the agent's loop replays deterministically."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, ModelRetry, RunContext, models
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import UsageLimits

from sagaloop import App, SagaContext, StepContext
from sagaloop.agents import Budget, BudgetExceeded
from sagaloop.agents.pydantic_ai import SagaAgent, ToolPolicy, step_as_tool
from sagaloop.agents.pydantic_ai.agent import _RESPONSE
from sagaloop.engine import history as h
from sagaloop.errors import ValidationError
from sagaloop.runtime.assembly import lane_queue
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False  # a test that reached a real provider would fail


@dataclass
class Deps:
    base: int


def tool_results(messages: list[ModelMessage]) -> list[Any]:
    last = messages[-1]
    assert isinstance(last, ModelRequest)
    return [p.content for p in last.parts if isinstance(p, ToolReturnPart)]


class Script:
    """A model that calls the tools ``calls`` in turn, then answers with what they returned;
    counts its requests from outside the engine."""

    def __init__(self, *calls: list[tuple[str, dict[str, Any]]]) -> None:
        self.calls = list(calls)
        self.requests = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        turn = sum(isinstance(m, ModelResponse) for m in messages)
        if turn < len(self.calls):
            parts = [ToolCallPart(name, args) for name, args in self.calls[turn]]
            return ModelResponse(parts=[TextPart(f"turn {turn}"), *parts])
        return ModelResponse(parts=[TextPart(json.dumps(tool_results(messages)))])


def refund_app(
    script: Script, **agent_options: Any
) -> tuple[App, SagaAgent[Any, Any], Counter[str]]:
    app = App("agents")
    effects: Counter[str] = Counter()
    agent = Agent(FunctionModel(script), name="refunds", deps_type=Deps)

    @agent.tool
    def add(ctx: RunContext[Deps], a: int, b: int) -> int:
        """Add two numbers and the base."""
        effects[f"add {a} {b}"] += 1
        return a + b + ctx.deps.base

    @agent.tool_plain
    async def greet(who: str) -> str:
        effects[f"greet {who}"] += 1
        if who == "retry-me" and effects[f"greet {who}"] == 1:
            raise ModelRetry("say it again")
        return f"hi {who}"

    saga_agent = SagaAgent(agent, app=app, **agent_options)

    @app.saga(name="ask")
    async def ask(ctx: SagaContext, prompt: str) -> str:
        result = await saga_agent.run(prompt, deps=Deps(base=10))
        return str(result.output)

    return app, saga_agent, effects


def test_step_names_are_pinned() -> None:
    """Step names are compatibility data: runs in flight find their steps by them."""
    _, saga_agent, _ = refund_app(Script())
    assert saga_agent.step_names == [
        "agent__refunds__model_request",
        "agent__refunds__tool__add",
        "agent__refunds__tool__greet",
    ]
    assert saga_agent.model_step.queue == "model"
    assert saga_agent.app.get_step("agent__refunds__tool__add").queue == "tools"  # type: ignore[union-attr]


def test_model_and_parallel_tools_run_once_each_across_restarts() -> None:
    script = Script([("add", {"a": 1, "b": 2}), ("greet", {"who": "ann"})])
    app, _, effects = refund_app(script)
    env = Harness(app)
    run_id = env.start("ask", "refund please")
    env.step_once()  # the run starts and asks the model
    env.restart()
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert json.loads(env.result(run_id)) == [13, "hi ann"]
    assert script.requests == 2, "no model request paid twice"
    assert effects == Counter({"add 1 2": 1, "greet ann": 1})
    names = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert names.count("agent__refunds__model_request") == 2
    # replaying the whole history from scratch issues the same commands
    env.restart()
    env.run_until_idle()
    assert script.requests == 2


def test_model_retry_crosses_the_step_as_a_value() -> None:
    script = Script([("greet", {"who": "retry-me"})], [("greet", {"who": "retry-me"})])
    app, _, effects = refund_app(script)
    env = Harness(app)
    run_id = env.start("ask", "x")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert effects["greet retry-me"] == 2
    assert script.requests == 3  # the retry prompt went back to the model, which called again
    assert json.loads(env.result(run_id)) == ["hi retry-me"]


def test_deps_that_cannot_be_stored_name_the_field() -> None:
    app = App("agents")

    @dataclass
    class Handle:
        base: int
        conn: object

    agent = Agent(FunctionModel(Script()), name="bad", deps_type=Handle)
    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        result = await saga_agent.run("x", deps=Handle(1, object()))
        return str(result.output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    error = env.get(run_id).error or {}
    assert env.get(run_id).status == "failed"
    assert "field 'conn'" in error["message"] and "object" in error["message"]


def test_outside_a_saga_it_is_the_plain_agent() -> None:
    script = Script([("add", {"a": 2, "b": 3})])
    _, saga_agent, effects = refund_app(script)
    result = saga_agent.run_sync("x", deps=Deps(base=0))
    assert json.loads(result.output) == [5]
    assert effects["add 2 3"] == 1


def test_a_failing_run_compensates_tool_effects_newest_first() -> None:
    app = App("agents")
    ledger: list[str] = []

    @app.step(queue="payments")
    def refund(ctx: StepContext, order: str, amount: int) -> str:
        ledger.append(f"refund {order} {amount}")
        return f"rf-{order}"

    @refund.compensation
    def reverse(ctx: StepContext, order: str, amount: int, result: str) -> None:
        ledger.append(f"reverse {result}")

    def undo_note(ctx: StepContext, args: dict[str, Any], result: Any) -> None:
        ledger.append(f"delete note {result}")

    script = Script(
        [("note", {"text": "a"})],
        [("refund", {"order": "o1", "amount": 5})],
        [("explode", {})],
    )
    agent = Agent(FunctionModel(script), name="ops", tools=[step_as_tool(refund)])

    @agent.tool_plain(metadata={"sagaloop": ToolPolicy(compensation=undo_note)})
    def note(text: str) -> str:
        ledger.append(f"note {text}")
        return f"n-{text}"

    @agent.tool_plain(metadata={"sagaloop": {"retry": {"max_attempts": 1}}})
    def explode() -> str:
        raise RuntimeError("the tool broke")

    saga_agent = SagaAgent(agent, app=app)
    assert "refund" not in [n.rsplit("__", 1)[-1] for n in saga_agent.step_names]

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.get(run_id).status == "compensated"
    assert ledger == ["note a", "refund o1 5", "reverse rf-o1", "delete note n-a"]


def _in_doubt_app(reconcile: bool) -> tuple[App, list[str], Any]:
    app = App("agents")
    attempts: list[str] = []
    provider: dict[str, str] = {}

    def find(ctx: StepContext, args: dict[str, Any]) -> Any:
        return provider.get(args["order"])

    policy = ToolPolicy(idempotent=False, reconcile=find if reconcile else None)
    script = Script([("pay", {"order": "o7"})])
    agent = Agent(FunctionModel(script), name="pay")

    @agent.tool_plain(metadata={"sagaloop": policy})
    def pay(order: str) -> str:
        attempts.append(order)
        provider[order] = f"paid-{order}"
        if len(attempts) == 1:
            raise ConnectionError("the response was lost")  # the effect happened
        return provider[order]

    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x")).output)

    return app, attempts, s


def test_an_in_doubt_non_idempotent_tool_halts() -> None:
    app, attempts, saga = _in_doubt_app(reconcile=False)
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    assert env.get(run_id).status == "needs_attention"
    assert attempts == ["o7"], "never blindly repeated"


def test_an_in_doubt_tool_with_reconcile_is_not_repeated() -> None:
    app, attempts, saga = _in_doubt_app(reconcile=True)
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert attempts == ["o7"]
    assert json.loads(env.result(run_id)) == ["paid-o7"]


def loop_app(turns: int, result_bytes: int = 2048) -> tuple[App, Any, Script]:
    app = App("agents")
    script = Script(*[[("lookup", {"i": i})] for i in range(turns)])
    agent = Agent(FunctionModel(script), name="loop")

    @agent.tool_plain
    def lookup(i: int) -> str:
        return f"{i}:" + "x" * result_bytes

    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> int:
        result = await saga_agent.run("go", usage_limits=UsageLimits(request_limit=None))
        return len(result.all_messages())

    return app, s, script


def history_bytes(env: Harness, run_id: str) -> int:
    return sum(len(json.dumps(e.data)) for e in env.history(run_id))


def test_the_transcript_is_stored_once() -> None:
    """History bytes per turn do not grow with the length of the loop."""
    per_turn = {}
    for turns in (10, 60):
        app, saga, script = loop_app(turns)
        env = Harness(app, cache=True)  # replaying 60 turns on each activation is slow
        run_id = env.start(saga)
        env.run_until_idle()
        assert env.get(run_id).status == "completed"
        assert script.requests == turns + 1
        per_turn[turns] = history_bytes(env, run_id) / turns
    assert per_turn[60] <= 1.25 * per_turn[10], per_turn
    assert per_turn[60] < 3 * 2048 + 4000, "about one tool result per turn, plus framing"


def test_a_worker_without_the_transcript_rebuilds_it_from_the_history() -> None:
    from sagaloop.agents.pydantic_ai import agent as adapter

    app, saga, _script = loop_app(4, result_bytes=10)
    env = Harness(app)
    run_id = env.start(saga)
    for _ in range(6):
        env.step_once()
    adapter._decoder._last.clear()  # another worker, or this one restarted
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert env.result(run_id) == 2 * 5  # request/response pairs, as in a plain run
    plain_script = Script(*[[("lookup", {"i": i})] for i in range(4)])
    agent = Agent(FunctionModel(plain_script), name="plain")

    @agent.tool_plain
    def lookup(i: int) -> str:
        return f"{i}:" + "x" * 10

    assert len(agent.run_sync("go").all_messages()) == env.result(run_id)


def budget_app(budget: Budget) -> tuple[App, Script, Any]:
    app = App("agents")
    script = Script(*[[("lookup", {"i": i})] for i in range(10)])
    agent = Agent(FunctionModel(script), name="spender")

    @agent.tool_plain
    def lookup(i: int) -> int:
        return i

    saga_agent = SagaAgent(agent, app=app, budget=budget)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x")).output)

    return app, script, s


def test_a_budget_stops_the_run_at_the_same_request_on_replay() -> None:
    app, script, saga = budget_app(Budget(requests=3))
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    assert run.error is not None and run.error["type"] == BudgetExceeded.__name__
    assert "requests 3 of 3" in run.error["message"]
    assert script.requests == 3
    env.restart()  # replayed from the history: the same stop, nothing paid again
    env.run_until_idle()
    assert script.requests == 3 and env.get(run_id).status == "failed"


def test_a_budget_can_wait_for_more() -> None:
    app, script, saga = budget_app(Budget(tool_calls=2, on_exceed="wait"))
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"
    assert script.requests == 2, "stopped before the request after the second tool call"
    usage = env.client.get_published(run_id, "agent usage")
    assert usage["tool_calls"] == 2 and usage["budget"]["tool_calls"] == 2
    assert "tool_calls 2 of 2" in str(env.status(run_id).waiting_for)
    env.send_event(run_id, "budget", {"tool_calls": 100})
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert script.requests == 11


def test_budget_rejects_unknown_limits() -> None:
    with pytest.raises(ValueError):
        Budget(requets=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="unknown tools"):
        SagaAgent(
            Agent(FunctionModel(Script()), name="x"),
            app=App("a"),
            tools={"nope": ToolPolicy()},
        )


def test_usage_limits_of_the_framework_count_recorded_usage() -> None:
    app = App("agents")
    script = Script(*[[("lookup", {"i": i})] for i in range(10)])
    agent = Agent(FunctionModel(script), name="limited")

    @agent.tool_plain
    def lookup(i: int) -> int:
        return i

    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        result = await saga_agent.run("x", usage_limits=UsageLimits(request_limit=2))
        return str(result.output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.get(run_id).status == "failed"
    assert "request_limit" in (env.get(run_id).error or {}).get("message", "")
    assert script.requests == 2


def test_wall_clock_budget_uses_recorded_time() -> None:
    app = App("agents")
    script = Script(*[[("nap", {})] for _ in range(5)])
    agent = Agent(FunctionModel(script), name="slow")

    @app.step
    def nap(ctx: StepContext) -> str:
        return "ok"

    agent = Agent(FunctionModel(script), name="slow", tools=[step_as_tool(nap)])
    saga_agent = SagaAgent(agent, app=app, budget=Budget(wall_clock=timedelta(hours=1)))

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        await ctx.sleep(timedelta(hours=2))
        return str((await saga_agent.run("x")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    # the hour counts from the first agent run of the saga run, not from the saga's start
    assert env.get(run_id).status == "completed"


# --- approvals inside the run ----------------------------------------------------------------


def approval_app(amount: int = 500, **agent_options: Any) -> tuple[App, Script, list[str], Any]:
    app = App("agents")
    refunds: list[str] = []
    script = Script([("refund", {"order": "o1", "amount": amount})])
    agent = Agent(FunctionModel(script), name="approver")

    @agent.tool_plain(requires_approval=True)
    def refund(order: str, amount: int) -> str:
        """Refund an order."""
        refunds.append(f"{order} {amount}")
        return f"refunded {amount}"

    saga_agent = SagaAgent(agent, app=app, **agent_options)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("refund o1")).output)

    return app, script, refunds, s


def test_a_tool_that_needs_approval_waits_inside_the_same_run() -> None:
    app, script, refunds, saga = approval_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"
    [pending] = env.approvals(run_id)
    assert pending.action == "refund"
    assert pending.args == {"order": "o1", "amount": 500}
    assert pending.reason == "turn 0", "the model's words before the call"
    env.restart()  # the approval survives a restart: it is history
    env.run_until_idle()
    assert refunds == []
    env.approve(run_id, pending.call_id, by="ops")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert refunds == ["o1 500"]
    assert json.loads(env.result(run_id)) == ["refunded 500"]
    assert script.requests == 2
    with pytest.raises(ValidationError):  # used once
        env.approve(run_id, pending.call_id)


def test_an_approval_with_edited_arguments_runs_the_edited_call() -> None:
    app, _, refunds, saga = approval_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    env.approve(run_id, pending.call_id, args={"order": "o1", "amount": 50})
    env.run_until_idle()
    assert refunds == ["o1 50"]


def test_a_denial_reaches_the_model_as_the_tool_result() -> None:
    app, _script, refunds, saga = approval_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    env.deny(run_id, pending.call_id, reason="over the limit")
    env.run_until_idle()
    assert refunds == []
    assert json.loads(env.result(run_id)) == ["The tool call was denied: over the limit"]


def test_an_approval_deadline_denies_after_two_days() -> None:
    app, _, refunds, saga = approval_app(approval_timeout=timedelta(days=2))
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    env.advance(timedelta(days=1))
    assert env.get(run_id).status == "waiting"
    env.advance(timedelta(days=1, seconds=1))
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert refunds == []
    assert json.loads(env.result(run_id)) == ["The tool call was denied: deadline passed"]


def test_an_answer_for_other_arguments_is_refused() -> None:
    app, _, refunds, saga = approval_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    # an answer that approved other arguments than those asked about is not used
    env.send_event(run_id, f"approval:{pending.call_id}", {"approved": True, "args_hash": "0" * 64})
    env.run_until_idle()
    assert env.get(run_id).status == "waiting" and refunds == []
    env.approve(run_id, pending.call_id)
    env.run_until_idle()
    assert refunds == ["o1 500"]


# --- streaming -------------------------------------------------------------------------------


def test_streamed_deltas_reach_the_runs_channel_and_the_response_is_recorded_once() -> None:
    from collections.abc import AsyncIterator

    app = App("agents")
    streamed: list[int] = []

    async def stream_words(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        streamed.append(1)
        for word in ("refund ", "approved ", "for o1"):
            yield word

    agent = Agent(FunctionModel(stream_function=stream_words), name="talker")
    saga_agent = SagaAgent(agent, app=app, stream=True)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x")).output)

    env = Harness(app)
    run_id = env.start(s)
    live = env.streams.subscribe(run_id)
    env.run_until_idle()
    assert env.result(run_id) == "refund approved for o1"
    items = live.get(0.1)
    texts = [i["data"]["text"] for i in items if i["data"]["text"]]
    assert "".join(texts) == "refund approved for o1"
    assert {i["step"] for i in items} == {"agent__talker__model_request"}
    assert streamed == [1], "the model was asked once"
    completed = [
        e for e in env.history(run_id) if e.kind == h.STEP_COMPLETED and "model" in (e.name or "")
    ]
    assert len(completed) == 1
    # a reader that joins late gets what the history holds
    late = list(env.client.stream(run_id, follow=False))
    assert [i["kind"] for i in late][-1] == h.RUN_FINISHED
    assert all(i["source"] == "history" for i in late)


def test_a_step_that_asks_for_approval_is_asked_once_when_a_tool() -> None:
    app = App("agents")
    paid: list[int] = []

    @app.step(approval=True)
    def pay(ctx: StepContext, cents: int) -> int:
        paid.append(cents)
        return cents

    script = Script([("pay", {"cents": 900})])
    saga_agent = SagaAgent(
        Agent(
            FunctionModel(script), name="payer", tools=[step_as_tool(pay, requires_approval=True)]
        ),
        app=app,
    )

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    env.deny(run_id, pending.call_id, reason="too much")
    env.run_until_idle()
    assert env.approvals(run_id) == [] and paid == []
    assert json.loads(env.result(run_id)) == ["The tool call was denied: too much"]


class RefundRequest(BaseModel):
    order: str
    cents: int


def test_step_as_tool_resolves_postponed_annotations_of_the_steps_module() -> None:
    """This module has `from __future__ import annotations`: the step's types are strings
    naming classes of this module, which the adapter resolves here, not in its own module."""
    app = App("agents")

    @app.step
    def refund(ctx: StepContext, req: RefundRequest) -> RefundRequest:
        return req

    script = Script([("refund", {"req": {"order": "o1", "cents": 5}})])
    saga_agent = SagaAgent(
        Agent(FunctionModel(script), name="typed", tools=[step_as_tool(refund)]), app=app
    )

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert json.loads(env.result(run_id)) == [{"order": "o1", "cents": 5}]


def test_the_engine_needs_neither_the_providers_package_nor_its_key() -> None:
    """`Agent("openai:gpt-5", defer_model_check=True)`: the engine shapes requests without
    building the provider (not installed here); the model step, on a worker that has the
    package and key (here, replaced), answers."""
    app = App("agents")
    agent = Agent("openai:gpt-5", name="remote", defer_model_check=True)
    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("hello")).output)

    def fake_worker(ctx: StepContext, request: dict[str, Any]) -> dict[str, Any]:
        response = ModelResponse(parts=[TextPart("hi from the worker")], model_name="gpt-5")
        return {"response": _RESPONSE.dump_python(response, mode="json"), "cost": None}

    env = Harness(app)
    with env.override(saga_agent.model_step, fake_worker):
        run_id = env.start(s)
        env.run_until_idle()
    assert env.result(run_id) == "hi from the worker"


def test_a_tool_may_ask_for_approval_at_run_time() -> None:
    """`ApprovalRequired` raised by the tool on the worker crosses the step as a value: the run
    asks a person, then runs the tool again with `ctx.tool_call_approved`."""
    from pydantic_ai import ApprovalRequired

    app = App("agents")
    attempts: list[tuple[int, bool]] = []
    script = Script([("refund", {"cents": 50})], [("refund", {"cents": 5000})])
    agent = Agent(FunctionModel(script), name="conditional")

    @agent.tool
    def refund(ctx: RunContext[None], cents: int) -> str:
        attempts.append((cents, ctx.tool_call_approved))
        if cents > 100 and not ctx.tool_call_approved:
            raise ApprovalRequired(metadata={"limit": 100})
        return f"refunded {cents}"

    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("x")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    assert pending.args == {"cents": 5000}
    env.approve(run_id, pending.call_id)
    env.run_until_idle()
    assert json.loads(env.result(run_id)) == ["refunded 5000"]
    assert attempts == [(50, False), (5000, False), (5000, True)]


def test_capabilities_of_the_run_and_the_agent_shape_the_tools_a_saga_offers() -> None:
    """The adapter puts its toolset around the run's as a run capability of its own: a run's
    ``capabilities`` (here ``PrepareTools``, which hides ``greet``) still apply, and a tool the
    model is offered still runs as a step, once."""
    from pydantic_ai.capabilities import PrepareTools
    from pydantic_ai.tools import ToolDefinition

    offered: list[list[str]] = []

    class Offered(Script):
        def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            offered.append(sorted(t.name for t in info.function_tools))
            return super().__call__(messages, info)

    app, saga_agent, effects = refund_app(Offered([("add", {"a": 1, "b": 2})]))

    async def hide_greet(ctx: RunContext[Any], defs: list[ToolDefinition]) -> list[ToolDefinition]:
        return [d for d in defs if d.name != "greet"]

    @app.saga(name="ask_without_greet")
    async def ask_without_greet(ctx: SagaContext, prompt: str) -> str:
        result = await saga_agent.run(
            prompt, deps=Deps(base=10), capabilities=[PrepareTools(hide_greet)]
        )
        return str(result.output)

    env = Harness(app)
    run_id = env.start("ask_without_greet", "refund please")
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert json.loads(env.result(run_id)) == [13]
    assert offered and all(names == ["add"] for names in offered), offered
    assert effects == Counter({"add 1 2": 1})
    steps = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert steps.count("agent__refunds__tool__add") == 1


def test_an_agent_whose_steps_are_local_runs_without_a_worker() -> None:
    """``local=True``: the model requests and the tools are in-process steps, which the engine's
    processes run (here the harness consumes the engine's queue and the in-process lane only,
    so a step sent to a worker's queue would never run); a tool whose policy says
    ``local=False`` keeps its queue. Killed between its steps, the run goes on from its history:
    nothing is paid twice."""
    script = Script([("add", {"a": 1, "b": 2}), ("greet", {"who": "ann"})])
    app, saga_agent, effects = refund_app(
        script, local=True, tools={"greet": ToolPolicy(local=False, queue="io")}
    )
    steps = {name: app.get_step(name) for name in saga_agent.step_names}
    assert {name: (s.local, s.queue) for name, s in steps.items() if s is not None} == {
        "agent__refunds__model_request": (True, "model"),
        "agent__refunds__tool__add": (True, "tools"),
        "agent__refunds__tool__greet": (False, "io"),
    }
    env = Harness(app)
    env.queues = [f"{app.name}.engine", lane_queue(app)]
    run_id = env.start("ask", "refund please")
    env.step_once()
    env.restart()
    env.run_until_idle()
    assert env.get(run_id).status == "running", "greet waits on its queue for a worker"
    env.queues = None  # a worker of queue io comes up
    env.run_until_idle()
    assert json.loads(env.result(run_id)) == [13, "hi ann"]
    assert script.requests == 2 and effects == Counter({"add 1 2": 1, "greet ann": 1})
