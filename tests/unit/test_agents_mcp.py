"""A SagaAgent with an MCP server (offline: FunctionModel, and the stdio server of
tests/unit/mcp_server.py, whose tool appends a line to a ledger file counted from here).

Listing the server's tools and calling one are steps, so the server is never asked from saga code
and a recorded call is not made again. Each step starts the server (about a second): these tests
keep the number of steps that reach it small."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent, models
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import AbstractToolset

from sagaloop import App, SagaContext, StepContext
from sagaloop.agents.pydantic_ai import SagaAgent, ToolPolicy
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Delivery
from sagaloop.errors import ValidationError
from sagaloop.runtime.steps import StepRunner
from sagaloop.testing import Crash, Harness

models.ALLOW_MODEL_REQUESTS = False

SERVER = Path(__file__).with_name("mcp_server.py")


class Refunder:
    """A model that asks for one refund through the MCP tool, then answers with what the tool
    returned; it keeps what it saw and counts its requests from outside the engine."""

    def __init__(self) -> None:
        self.requests = 0
        self.tools_offered: list[str] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        self.tools_offered = [t.name for t in info.function_tools]
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart("refund", {"order": "o1", "amount": 5})])
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        results = [p.content for p in last.parts if isinstance(p, ToolReturnPart)]
        return ModelResponse(parts=[TextPart(json.dumps(results))])


def server(ledger: Path, id: str | None = "payments") -> MCPToolset[Any]:
    transport = StdioTransport(sys.executable, [str(SERVER), str(ledger)], keep_alive=False)
    return MCPToolset(transport, id=id)


def mcp_app(
    tmp_path: Path, *, approval_required: bool = False, **agent_options: Any
) -> tuple[App, SagaAgent[Any, Any], Refunder, Path]:
    app = App("agents")
    ledger = tmp_path / "ledger.txt"
    model = Refunder()
    toolset: AbstractToolset[Any] = server(ledger)
    if approval_required:
        toolset = toolset.approval_required()
    agent = Agent(FunctionModel(model), name="refunds", toolsets=[toolset])

    @agent.tool_plain
    def note(text: str) -> str:
        return text

    saga_agent = SagaAgent(agent, app=app, **agent_options)

    @app.saga(name="ask")
    async def ask(ctx: SagaContext, prompt: str) -> str:
        return str((await saga_agent.run(prompt)).output)

    return app, saga_agent, model, ledger


def refunds(ledger: Path) -> list[str]:
    return ledger.read_text().splitlines() if ledger.exists() else []


def test_mcp_step_names_are_pinned(tmp_path: Path) -> None:
    """Step names are compatibility data: runs in flight find their steps by them."""
    app, saga_agent, _, _ = mcp_app(
        tmp_path,
        tools={"refund": ToolPolicy(idempotent=False), "mcp:payments": ToolPolicy(queue="mcp")},
    )
    assert saga_agent.step_names == [
        "agent__refunds__mcp__payments__call_tool",
        "agent__refunds__mcp__payments__call_tool__refund",
        "agent__refunds__mcp__payments__get_tools",
        "agent__refunds__model_request",
        "agent__refunds__tool__note",
    ]
    get_tools = app.get_step("agent__refunds__mcp__payments__get_tools")
    call_tool = app.get_step("agent__refunds__mcp__payments__call_tool")
    refund = app.get_step("agent__refunds__mcp__payments__call_tool__refund")
    assert get_tools is not None and call_tool is not None and refund is not None
    assert (get_tools.queue, get_tools.idempotent) == ("mcp", True)
    assert (call_tool.queue, call_tool.idempotent) == ("mcp", True)
    assert (refund.queue, refund.idempotent) == ("mcp", False)

    _, default, _, _ = mcp_app(tmp_path / "other")
    assert default.app.get_step("agent__refunds__mcp__payments__call_tool").queue == "tools"  # type: ignore[union-attr]


def test_an_mcp_server_needs_an_id(tmp_path: Path) -> None:
    agent = Agent(FunctionModel(Refunder()), name="a", toolsets=[server(tmp_path, id=None)])
    with pytest.raises(ValidationError, match=r"MCPToolset\(\.\.\., id="):
        SagaAgent(agent, app=App("agents"))


def test_unknown_mcp_server_in_tools_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="mcp:nope"):
        mcp_app(tmp_path, tools={"mcp:nope": ToolPolicy()})


def test_mcp_tool_is_called_once_across_restarts(tmp_path: Path) -> None:
    app, _, model, ledger = mcp_app(tmp_path)
    env = Harness(app)
    run_id = env.start("ask", "refund o1")
    for _ in range(100):  # a restart (all memory lost) after every message
        if not env.step_once():
            break
        env.restart()
    assert env.get(run_id).status == "completed"
    assert refunds(ledger) == ["refund o1 5"], "the tool's effect happened once"
    assert json.loads(env.result(run_id)) == ["rf-o1-5"], "its result reached the model"
    assert model.requests == 2
    assert sorted(model.tools_offered) == ["note", "refund"]
    completed = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert completed.count("agent__refunds__mcp__payments__get_tools") == 1  # one listing a run
    assert completed.count("agent__refunds__mcp__payments__call_tool") == 1
    # replaying the whole history again asks neither the server nor the model
    env.restart()
    env.run_until_idle()
    assert refunds(ledger) == ["refund o1 5"] and model.requests == 2


def crash_after_first(env: Harness, step: str) -> list[str]:
    """Kill the worker right after the first attempt of ``step`` ran: its effect happened, its
    result is lost."""
    crashed: list[str] = []

    def hook(role: str, delivery: Delivery) -> None:
        task = Envelope.from_bytes(delivery.body)
        if role != "worker" or crashed or task.payload.get("step") != step:
            return
        crashed.append(task.message_id)
        StepRunner(env.app, worker="doomed", inline=True).run(task)
        raise Crash("killed before commit")

    env.crash_hook = hook
    return crashed


def test_a_lost_mcp_reply_is_reconciled_not_repeated(tmp_path: Path) -> None:
    """``tools={"refund": ToolPolicy(idempotent=False, reconcile=...)}``: the refund has its
    own step; an attempt in doubt is looked up instead of being made again."""
    ledger = tmp_path / "ledger.txt"

    def find(ctx: StepContext, args: dict[str, Any]) -> str | None:
        line = f"refund {args['order']} {args['amount']}"
        return f"rf-{args['order']}-{args['amount']}" if line in refunds(ledger) else None

    policy = ToolPolicy(idempotent=False, reconcile=find)
    app, _, _, _ = mcp_app(tmp_path, tools={"refund": policy})
    env = Harness(app)
    crashed = crash_after_first(env, "agent__refunds__mcp__payments__call_tool__refund")
    run_id = env.start("ask", "refund o1")
    env.run_until_idle()

    assert len(crashed) == 1
    assert env.get(run_id).status == "completed"
    assert refunds(ledger) == ["refund o1 5"], "not refunded twice"
    assert json.loads(env.result(run_id)) == ["rf-o1-5"]
    states = {s.step: s.state for s in env.status(run_id).steps}
    assert states["agent__refunds__mcp__payments__call_tool__refund"] == "reconciled"


@pytest.mark.parametrize("asked_by", ["policy", "toolset"])
def test_an_mcp_tool_that_needs_approval_asks_before_its_step(
    tmp_path: Path, asked_by: str
) -> None:
    """``ToolPolicy(requires_approval=True)``, or the server wrapped in ``approval_required()``:
    the run waits for a person; a denial reaches the model and the tool is not called."""
    if asked_by == "policy":
        options: dict[str, Any] = {"tools": {"refund": ToolPolicy(requires_approval=True)}}
    else:
        options = {"approval_required": True}
    app, _, _, ledger = mcp_app(tmp_path, **options)
    env = Harness(app)
    run_id = env.start("ask", "refund o1")
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"
    [pending] = env.approvals(run_id)
    assert (pending.action, pending.args) == ("refund", {"order": "o1", "amount": 5})
    env.deny(run_id, pending.call_id, reason="over the limit")
    env.run_until_idle()
    assert json.loads(env.result(run_id)) == ["The tool call was denied: over the limit"]
    assert refunds(ledger) == []
    completed = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert not [n for n in completed if n and "call_tool" in n]


def test_outside_a_saga_the_agent_uses_its_server(tmp_path: Path) -> None:
    _, saga_agent, model, ledger = mcp_app(tmp_path)
    result = saga_agent.run_sync("refund o1")
    assert json.loads(result.output) == ["rf-o1-5"]
    assert refunds(ledger) == ["refund o1 5"] and model.requests == 2


def test_an_mcp_server_of_a_local_agent_is_in_process_unless_its_policy_says(
    tmp_path: Path,
) -> None:
    """``local=True`` reaches the server's steps and its tools' (their policy's ``local`` first,
    then the server's, then the agent's)."""
    servers = {"mcp:payments": ToolPolicy(local=False), "refund": ToolPolicy(local=True)}
    for tools, expected in [
        ({}, {"get_tools": True, "call_tool": True}),
        (servers, {"get_tools": False, "call_tool": False, "call_tool__refund": True}),
    ]:
        app, _, _, _ = mcp_app(tmp_path / str(len(tools)), local=True, tools=tools)
        for name, local in expected.items():
            step = app.get_step(f"agent__refunds__mcp__payments__{name}")
            assert step is not None and step.local is local, name
