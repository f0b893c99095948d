"""The transcript page of an OpenAI Agents run (the SDK's ScriptedModel, offline) whose tool
call needed an approval: the instructions once, the call marked with who approved it and the
edited arguments, the result named by its tool, each message once."""

from __future__ import annotations

from typing import Any

from agents import Agent, function_tool
from starlette.testclient import TestClient

from sagaloop import App
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.testing import Harness
from sagaloop.ui import create_app
from tests.unit import test_agents_openai as oa


def test_the_transcript_page_marks_the_approved_call_and_names_its_result() -> None:
    app = App("oa")

    @function_tool(needs_approval=True)
    def refund(amount: int) -> list[dict[str, int]]:
        """Refund an amount."""
        return [{"refunded": amount}]

    model = oa.call_then_echo("refund", {"amount": 300}, call_id="call-77")
    agent: Agent[Any] = Agent(name="payer", model=model, tools=[refund], instructions="Pay.")
    oa.answer_saga(app, SagaRunner(app, agent), agent, "pay")
    env = Harness(app)
    try:
        run_id = env.start("pay", "refund 300")
        env.run_until_idle()
        (pending,) = env.approvals(run_id)
        client = TestClient(create_app(env.client, app, None), base_url="http://127.0.0.1:8765")
        page = client.get(f"/run/transcript?id={run_id}").text
        assert "needed approval: pending" in page
        env.approve(run_id, pending.call_id, args={"amount": 250}, by="maria")
        env.run_until_idle()
        page = client.get(f"/run/transcript?id={run_id}").text
    finally:
        env.close()
    assert (
        "needed approval: approved by maria, with edited arguments {&#34;amount&#34;: 250}" in page
    )
    assert page.count("tool call <code>refund</code>") == 1
    assert "tool result <code>refund</code>" in page and "call-77" not in page
    assert page.count("Pay.</div>") == 1
