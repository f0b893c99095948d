"""The transcript as people read it (``sagaloop.ui.transcript``), on real histories: runs of
Pydantic AI (FunctionModel) and OpenAI Agents (the SDK's ScriptedModel) agents, and a raw
Chat Completions loop against a local OpenAI-compatible server, in a Harness, offline. Each
message is shown once, results are named by their tool and keep their JSON, the calls that
needed an approval say how it was answered, and the agent's instructions are shown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, function_tool
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.function import FunctionModel

from examples.raw_openai_loop import app as loop
from examples.raw_openai_loop.shop import Shop
from sagaloop import App, SagaContext
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.agents.pydantic_ai import SagaAgent
from sagaloop.testing import Harness
from sagaloop.ui.transcript import Part, Request, requests_of
from tests.unit import test_agents_openai as oa
from tests.unit import test_agents_pydantic_ai as pa
from tests.unit import test_raw_openai_loop as raw


def shown(requests: list[Request]) -> list[tuple[str, str, str]]:
    """Every part the page shows, in order: (kind, label, text)."""
    return [(p.kind, p.label, p.text) for r in requests for p in (*r.new, *r.response)]


def calls(requests: list[Request]) -> list[Part]:
    return [p for r in requests for p in (*r.new, *r.response) if p.kind == "tool call"]


def pydantic_ai_three_turns() -> list[Request]:
    app, _, _ = pa.refund_app(pa.Script([("add", {"a": 1, "b": 2})], [("greet", {"who": "x"})]))
    env = Harness(app)
    run_id = env.start("ask", "go")
    env.run_until_idle()
    return requests_of(env.history(run_id))


def openai_three_turns() -> list[Request]:
    model = ScriptedModel(
        [
            oa.reply(
                assistant_message("let me see"),
                function_call("add", {"a": 1, "b": 2}, call_id="c1"),
            ),
            oa.reply(function_call("greet", {"who": "ann"}, call_id="c2")),
            ModelStep.respond(lambda call: oa.reply(assistant_message("done"))),
        ]
    )
    app, _, _, _ = oa.refund_app(model)
    env = Harness(app)
    run_id = env.start("ask", "go")
    env.run_until_idle()
    return requests_of(env.history(run_id))


def test_from_the_third_request_on_the_previous_answer_is_not_shown_again() -> None:
    for requests in (pydantic_ai_three_turns(), openai_three_turns()):
        assert len(requests) == 3
        assert [p.label for p in calls(requests)] == ["add", "greet"], shown(requests)
        third = requests[2]
        assert third.after_answer
        assert [p.kind for p in third.new] == ["tool result"], shown(requests)
        assert "hi" in third.new[0].text


def test_tool_results_are_named_by_their_tool() -> None:
    for requests in (pydantic_ai_three_turns(), openai_three_turns()):
        results = [p.label for r in requests for p in r.new if p.kind == "tool result"]
        assert results == ["add", "greet"], shown(requests)


def test_a_list_result_is_shown_as_its_json() -> None:
    app = App("agents")
    script = pa.Script([("orders", {})])
    agent = PydanticAgent(FunctionModel(script), name="lister")
    rows = [{"order": "o1", "cents": 100}, {"order": "o2", "cents": 250}]

    @agent.tool_plain
    def orders() -> list[dict[str, Any]]:
        """The open orders."""
        return rows

    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("list")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    (result,) = [
        p for r in requests_of(env.history(run_id)) for p in r.new if p.kind == "tool result"
    ]
    assert json.loads(result.text) == rows
    assert (result.label, result.text.startswith("[")) == ("orders", True)


def pydantic_ai_approval(answer: str) -> list[Request]:
    app, _, _, saga = pa.approval_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    if answer == "approve":
        env.approve(run_id, pending.call_id, by="ops")
    elif answer == "deny":
        env.deny(run_id, pending.call_id, reason="over the limit", by="ops")
    env.run_until_idle()
    return requests_of(env.history(run_id))


def test_the_call_that_needed_an_approval_says_how_it_was_answered() -> None:
    (call,) = calls(pydantic_ai_approval("approve"))
    assert call.approval is not None
    assert (call.approval.status, call.approval.by) == ("approved", "ops")
    (call,) = calls(pydantic_ai_approval("deny"))
    assert call.approval is not None
    assert (call.approval.status, call.approval.reason) == ("denied", "over the limit")
    (call,) = calls(pydantic_ai_approval("none"))
    assert call.approval is not None and call.approval.status == "pending"
    # a call that needed none has no mark
    assert all(p.approval is None for p in calls(pydantic_ai_three_turns()))


def openai_approval_run() -> list[Request]:
    model = oa.call_then_echo("refund", {"amount": 300}, call_id="c1")
    app = App("oa")

    @function_tool(needs_approval=True)
    def refund(amount: int) -> str:
        """Refund an amount."""
        return f"refunded {amount}"

    agent: Agent[Any] = Agent(
        name="payer", model=model, tools=[refund], instructions="Pay refunds under 500."
    )
    runner = SagaRunner(app, agent)
    oa.answer_saga(app, runner, agent, "pay")
    env = Harness(app)
    run_id = env.start("pay", "refund 300")
    env.run_until_idle()
    (pending,) = env.approvals(run_id)
    env.approve(run_id, pending.call_id, args={"amount": 250}, by="maria")
    env.run_until_idle()
    return requests_of(env.history(run_id))


def test_openai_agents_an_edited_approval_is_marked_on_its_call() -> None:
    requests = openai_approval_run()
    (call,) = calls(requests)
    assert call.approval is not None
    assert (call.approval.status, call.approval.by) == ("approved", "maria")
    assert call.approval.edited_args == {"amount": 250}
    (result,) = [p for r in requests for p in r.new if p.kind == "tool result"]
    assert (result.label, result.text) == ("refund", "refunded 250")


def test_openai_agents_instructions_are_shown_once() -> None:
    requests = openai_approval_run()
    systems = [(i, p.text) for i, r in enumerate(requests) for p in r.new if p.kind == "system"]
    assert systems == [(0, "Pay refunds under 500.")]
    assert [p.kind for p in requests[0].new] == ["system", "user"]


def test_a_chat_completions_loop_shows_each_message_once_and_names_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The raw ``openai`` loop of examples/raw_openai_loop (its transcript kept by a
    ``Conversation``), against the local OpenAI-compatible server: three requests."""
    monkeypatch.setenv("RAW_LOOP_DATA", str(tmp_path))
    monkeypatch.setenv("RAW_LOOP_MODEL", raw.MODEL)
    monkeypatch.setenv("OPENAI_API_KEY", raw.API_KEY)
    Shop()
    env = Harness(loop.app)
    try:
        with raw.serve(monkeypatch, raw.SCRIPT):
            run_id = env.start(loop.support, "Order o-17 arrived broken.")
            env.run_until_idle()
        requests = requests_of(env.history(run_id))
    finally:
        env.close()
    assert [p.label for p in calls(requests)] == ["lookup_order", "issue_refund", "mail_customer"]
    assert [[p.label for p in r.new if p.kind == "tool result"] for r in requests] == [
        [],
        ["lookup_order"],
        ["issue_refund", "mail_customer"],
    ]
    assert [p.kind for p in requests[0].new] == ["system", "user"]
    assert all(r.after_answer for r in requests[1:])
