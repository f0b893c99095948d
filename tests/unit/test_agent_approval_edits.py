"""An approver's edit of an agent's tool call fits the tool's arguments (issue 22): the client
refuses an edit that does not (a required field missing, an extra one, a list), naming the
field, and sends nothing; one that arrives anyway is refused by the run and the approval keeps
waiting. Before, the edit was sent, the tool's step failed five times and the run failed and
compensated the tools that had run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, function_tool

from sagaloop import App
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.errors import ValidationError
from sagaloop.testing import Harness

sys.path.insert(0, str(Path(__file__).parent))

from test_agents_openai import answer_saga, call_then_echo
from test_agents_pydantic_ai import approval_app

BAD_EDITS = [
    ({"order": "o1"}, "amount"),  # a required field missing
    ({"order": "o1", "amount": 5, "iban": "x"}, "iban"),  # an extra field
    (["o1", 5], "arguments"),  # not an object
]


def raw_edit(env: Harness, run_id: str, edit: Any) -> None:
    """The edit sent as a publisher on the broker may: no client's check."""
    [pending] = env.approvals(run_id)
    answer = {
        "approved": True,
        "args_hash": pending.args_hash,
        "request_id": pending.request_id,
        "args": edit,
    }
    env.publish_event(run_id, f"approval:{pending.call_id}", answer)


@pytest.mark.parametrize(("edit", "words"), BAD_EDITS)
def test_pydantic_ai_a_bad_edit_is_refused_by_the_client_then_by_the_run(
    edit: Any, words: str
) -> None:
    app, _, refunds, saga = approval_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    with pytest.raises(ValidationError, match="edited arguments") as refused:
        env.approve(run_id, pending.call_id, args=edit)
    assert words in str(refused.value)
    raw_edit(env, run_id, edit)
    env.run_until_idle()
    assert env.get(run_id).status == "waiting" and refunds == []
    record = env.client.get_published(run_id, f"approval:{pending.call_id}")
    assert "edited arguments" in record["last_refused"]
    env.approve(run_id, pending.call_id, args={"order": "o1", "amount": 50})
    env.run_until_idle()
    assert env.get(run_id).status == "completed" and refunds == ["o1 50"]


def openai_app() -> tuple[App, list[int], Any]:
    model = call_then_echo("refund", {"order": "o1", "amount": 300}, call_id="c1")
    app = App("oa-edits")
    paid: list[int] = []

    @function_tool(needs_approval=True)
    def refund(order: str, amount: int) -> str:
        """Refund an amount."""
        paid.append(amount)
        return f"refunded {amount}"

    agent: Agent[Any] = Agent(name="payer", model=model, tools=[refund])
    answer_saga(app, SagaRunner(app, agent), agent, "pay")
    return app, paid, model


@pytest.mark.parametrize(("edit", "words"), BAD_EDITS)
def test_openai_agents_a_bad_edit_is_refused_by_the_client_then_by_the_run(
    edit: Any, words: str
) -> None:
    app, paid, _ = openai_app()
    env = Harness(app)
    run_id = env.start("pay", "refund 300")
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    with pytest.raises(ValidationError, match="edited arguments") as refused:
        env.approve(run_id, pending.call_id, args=edit)
    assert words in str(refused.value)
    raw_edit(env, run_id, edit)
    env.run_until_idle()
    assert env.get(run_id).status == "waiting" and paid == []
    env.approve(run_id, pending.call_id, args={"order": "o1", "amount": 250})
    env.run_until_idle()
    assert env.get(run_id).status == "completed" and env.result(run_id) == "refunded 250"
    assert paid == [250]


def test_a_budget_raise_sent_before_the_budget_is_reached_does_not_lift_it() -> None:
    """A raise counts only as the answer to the budget's wait: one sent in advance is refused
    (recorded), and the run stops at its budget as if it had not been sent."""
    from test_agents_pydantic_ai import budget_app

    from sagaloop.agents import Budget
    from sagaloop.engine import history as h

    app, script, saga = budget_app(Budget(tool_calls=2, on_exceed="wait"))
    env = Harness(app)
    run_id = env.start(saga)
    env.send_event(run_id, "budget", {"tool_calls": 100})  # in advance
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"
    assert script.requests == 2, "stopped at the budget: the early raise was not used"
    refused = [e for e in env.history(run_id) if e.kind == h.EVENT_REJECTED]
    assert [e.name for e in refused] == ["budget"]
    env.send_event(run_id, "budget", {"tool_calls": 100})  # the answer to the wait
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
