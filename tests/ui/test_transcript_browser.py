"""The transcript page in headless Chromium (Debian's, as tests/ui/test_console.py drives
it): an OpenAI Agents run (the SDK's ScriptedModel, offline) in a Harness on a SQLite file,
its console served on a thread. The approved call is marked where an operator reads it, with
the Content-Security-Policy refusing nothing (the ``page`` fixture fails on any browser
error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agents import Agent, function_tool
from playwright.sync_api import Page, expect

from sagaloop import App
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.testing import Harness
from sagaloop.ui.server import serve_in_thread
from tests.ui.test_console import browser, expected_errors, free_port, page, shots
from tests.unit import test_agents_openai as oa

pytestmark = pytest.mark.browser

__all__ = ["browser", "expected_errors", "page"]  # the fixtures, from test_console


def test_the_transcript_marks_the_call_that_needed_approval(page: Page, tmp_path: Path) -> None:
    app = App("oa")

    @function_tool(needs_approval=True)
    def refund(amount: int) -> list[dict[str, int]]:
        """Refund an amount."""
        return [{"refunded": amount}]

    model = oa.call_then_echo("refund", {"amount": 300}, call_id="call-77")
    agent: Agent[Any] = Agent(name="payer", model=model, tools=[refund], instructions="Pay.")
    oa.answer_saga(app, SagaRunner(app, agent), agent, "pay")
    env = Harness(app, url=f"sqlite:///{tmp_path / 'transcript.db'}")
    port = free_port()
    stop = serve_in_thread(env.client, app, host="127.0.0.1", port=port, token=None)
    try:
        run_id = env.start("pay", "refund 300")
        env.run_until_idle()
        (pending,) = env.approvals(run_id)
        page.goto(f"http://127.0.0.1:{port}/run/transcript?id={run_id}")
        mark = page.locator(".part-tool-call .approval-mark")
        expect(mark).to_have_text("needed approval: pending")
        env.approve(run_id, pending.call_id, args={"amount": 250}, by="maria")
        env.run_until_idle()
        # the page follows the run (its live region): the mark says who approved what
        expect(mark).to_have_text(
            'needed approval: approved by maria, with edited arguments {"amount": 250}',
            timeout=30_000,
        )
        requests = page.locator("section.request")
        expect(requests).to_have_count(2)
        expect(requests.nth(0).locator(".part-system")).to_have_text("system Pay.")
        expect(requests.nth(1).locator(".part-system")).to_have_count(0)
        result = requests.nth(1).locator(".part-tool-result")
        expect(result.locator(".who")).to_have_text("tool result refund")
        # what the model read: the SDK gives it a tool's output as str() of the value
        expect(result.locator("pre")).to_have_text("[{'refunded': 250}]")
        page.screenshot(path=shots(tmp_path) / "transcript-approval.png")
    finally:
        stop()
        env.close()
