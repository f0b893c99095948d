"""The refund agent example (examples/refund_agent) in the in-process harness: a Pydantic AI agent
whose model is the offline FunctionModel policy. The happy path refunds once; a refund whose
response is lost, or whose worker dies after the provider accepted it, is reconciled instead of
issued again; a ledger that refuses the posting for good gets the refund reversed once; a refund
above the approval limit waits for a person; the budget stops a model that never ends."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from examples.refund_agent import app as refunds
from examples.refund_agent import model as refund_model
from examples.refund_agent.provider import Mailbox, PaymentProvider
from sagaloop.cli import demo
from sagaloop.engine import history as h
from sagaloop.engine.ports import Delivery
from sagaloop.testing import Crash, Harness

DISPUTE = {
    "dispute_id": "D-1001",
    "customer_id": "cus_ada",
    "transaction_id": "txn_5001",
    "amount_cents": 12999,
    "reason": "headphones never arrived",
}
SMALL = {
    "dispute_id": "D-1002",
    "customer_id": "cus_grace",
    "transaction_id": "txn_5002",
    "amount_cents": 2500,
    "reason": "damaged book",
}
LARGE = {
    "dispute_id": "D-1003",
    "customer_id": "cus_linus",
    "transaction_id": "txn_5003",
    "amount_cents": 48900,
    "reason": "standing desk arrived broken",
}
REPLY = {"message": "The parcel never arrived; the tracking page stopped on Jan 4."}
MODEL_STEP = "agent__refunds__model_request"
Policy = Callable[[list[ModelMessage], AgentInfo], ModelResponse]


@pytest.fixture
def provider(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PaymentProvider:
    monkeypatch.setenv("REFUNDS_PROVIDER_DB", str(tmp_path / "provider.db"))
    monkeypatch.setenv("REFUNDS_PROVIDER_IDEMPOTENCY", "off")  # only the reconcile protects
    monkeypatch.delenv("REFUNDS_HANG_AFTER_ACCEPT", raising=False)
    return PaymentProvider()


@pytest.fixture
def env(provider: PaymentProvider) -> Iterator[Harness]:
    harness = Harness(refunds.app)
    yield harness
    harness.close()


@pytest.fixture
def use_policy(monkeypatch: pytest.MonkeyPatch) -> Callable[[Policy], None]:
    """Make the agent's FunctionModel answer with another function for this test."""
    model = refunds.agent.wrapped.model
    if not isinstance(model, FunctionModel):
        pytest.skip("REFUNDS_MODEL names a real model: these tests drive the offline policy")

    def use(policy: Policy) -> None:
        monkeypatch.setattr(model, "function", policy)

    return use


def states(env: Harness, run_id: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in env.status(run_id).steps:
        out.setdefault(line.step, []).append(line.state)
    return out


def model_calls(env: Harness, run_id: str) -> list[list[str]]:
    """The tools (and outputs) each recorded model response called, in order."""
    return [
        [p["tool_name"] for p in e.data["result"]["response"]["parts"] if "tool_name" in p]
        for e in env.history(run_id)
        if e.kind == h.STEP_COMPLETED and e.name == MODEL_STEP
    ]


def answer_customer(
    env: Harness, run_id: str, reply: dict[str, Any] = REPLY, *, skip_time: bool = True
) -> None:
    """Answer for the customer once the run waits for it, then run (with ``skip_time=False``:
    stop at the next wait, such as an approval, rather than skip over its deadline)."""
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    assert any("customer-reply" in w for w in env.status(run_id).waiting_for)
    env.send_event(run_id, "customer-reply", reply)
    env.run_until_idle(skip_time=skip_time)


def test_the_model_step_name_is_pinned() -> None:
    """A run in flight finds its model requests by this name; the demo shows it."""
    assert refunds.agent.model_step.name == MODEL_STEP == demo.MODEL_STEP
    assert sorted(refunds.app.queues) == ["ledger", "model", "notify", "payments", "tools"]


def test_refunds_model_names_a_real_model_else_the_offline_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("REFUNDS_MODEL", raising=False)
    assert isinstance(refund_model.refund_model(), FunctionModel)
    monkeypatch.setenv("REFUNDS_MODEL", "openai:gpt-5")
    assert refund_model.refund_model() == "openai:gpt-5"  # passed to Agent unchanged


def test_happy_path_refunds_exactly_once(env: Harness, provider: PaymentProvider) -> None:
    run_id = env.start(refunds.refund_dispute, DISPUTE)
    answer_customer(env, run_id)
    result = env.result(run_id)
    assert result.outcome == "refunded"
    [refund] = provider.refunds("D-1001")
    assert result.refund_id == refund.refund_id
    assert refund.amount_cents == 12999
    assert provider.reversals() == []
    steps = states(env, run_id)
    assert steps["issue_refund"] == ["completed"]
    assert steps["post_to_ledger"] == ["completed"]
    assert model_calls(env, run_id) == [
        ["lookup_transaction", "read_policy", "check_history"],
        ["fraud_check"],
        ["ask_customer"],
        ["issue_refund"],
        ["close"],
    ]
    assert result.model_requests == 5
    usage: Any = env.client.get_published(run_id, "agent usage")
    assert usage["requests"] == 5 and usage["budget"]["requests"] == 20
    messages = Mailbox().messages("D-1001")
    assert len(messages) == 2 and "refunded 129.99" in messages[-1]


def test_small_dispute_is_refunded_without_asking(env: Harness, provider: PaymentProvider) -> None:
    run_id = env.start(refunds.refund_dispute, SMALL)
    env.run_until_idle()
    assert env.result(run_id).outcome == "refunded"
    assert "ask_customer" not in states(env, run_id)
    assert len(provider.refunds("D-1002")) == 1


def test_no_reply_in_two_days_denies_without_refund(
    env: Harness, provider: PaymentProvider
) -> None:
    run_id = env.start(refunds.refund_dispute, DISPUTE)
    env.run_until_idle()  # skips the virtual clock over the two-day timeout
    result = env.result(run_id)
    assert result.outcome == "denied"
    assert "did not answer" in result.summary
    assert provider.refunds() == []


def test_model_is_not_asked_again_for_recorded_turns(
    env: Harness, provider: PaymentProvider, use_policy: Callable[[Policy], None]
) -> None:
    calls: list[int] = []

    def counting(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls.append(len(messages))
        return refund_model.policy(messages, info)

    use_policy(counting)
    run_id = env.start(refunds.refund_dispute, DISPUTE)
    env.run_until_idle(skip_time=False)
    asked = len(calls)
    env.restart()  # a new process: the saga code is replayed from the history
    env.send_event(run_id, "customer-reply", REPLY)
    env.run_until_idle()
    assert env.result(run_id).outcome == "refunded"
    assert asked == 3 and len(calls) == 5, "recorded answers must be replayed, not re-asked"
    assert len(calls) == len(set(calls))


def test_lost_response_is_reconciled_not_reissued(
    env: Harness, provider: PaymentProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = PaymentProvider.refund
    accepted: list[str] = []

    def lose_first_response(self: PaymentProvider, **kwargs: Any) -> Any:
        refund = original(self, **kwargs)
        accepted.append(refund.refund_id)
        if len(accepted) == 1:
            raise ConnectionError("connection reset by peer after the request was sent")
        return refund

    monkeypatch.setattr(PaymentProvider, "refund", lose_first_response)
    run_id = env.start(refunds.refund_dispute, DISPUTE)
    answer_customer(env, run_id)
    result = env.result(run_id)
    [refund] = provider.refunds()
    assert accepted == [refund.refund_id], "issue_refund must not run again when in doubt"
    assert result.refund_id == refund.refund_id
    line = next(x for x in env.status(run_id).steps if x.step == "issue_refund")
    assert (line.state, line.attempts) == ("reconciled", 2)


def test_worker_killed_after_the_provider_accepted(env: Harness, provider: PaymentProvider) -> None:
    """The worker dies after the provider accepted the refund and before the result is stored:
    the message is redelivered once its lease expires, the attempt is in doubt, the reconcile
    finds the refund and records it."""
    crashed: list[str] = []

    def crash_after_accept(role: str, delivery: Delivery) -> None:
        body = json.loads(delivery.body)
        if body["payload"].get("step") != "issue_refund" or crashed or role != "worker":
            return
        req = body["payload"]["args"]["req"]
        PaymentProvider().refund(idempotency_key=body["idempotency_key"], **req)  # accepted...
        crashed.append(body["idempotency_key"])
        raise Crash("killed before the result was recorded")

    env.crash_hook = crash_after_accept
    run_id = env.start(refunds.refund_dispute, DISPUTE)
    answer_customer(env, run_id)
    assert crashed, "the crash hook did not fire"
    assert env.result(run_id).outcome == "refunded"
    [refund] = provider.refunds()
    assert refund.reference == crashed[0]
    assert states(env, run_id)["issue_refund"] == ["reconciled"]


def test_ledger_down_reverses_the_refund_once(env: Harness, provider: PaymentProvider) -> None:
    run_id = env.start(refunds.refund_dispute, {**SMALL, "reason": "damaged book (ledger-down)"})
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "compensated"
    assert run.error is not None and run.error["type"] == "StepFailedError"
    [refund] = provider.refunds()
    [reversal] = provider.reversals()
    assert reversal.refund_id == refund.refund_id
    assert reversal.amount_cents == refund.amount_cents
    line = next(x for x in env.status(run_id).steps if x.step == "issue_refund")
    assert line.compensation == "compensated"
    assert states(env, run_id)["post_to_ledger"] == ["failed"]


def test_provider_honours_idempotency_keys(tmp_path: Path) -> None:
    on = PaymentProvider(tmp_path / "p.db", idempotency=True)
    args: dict[str, Any] = {"dispute_id": "D", "transaction_id": "T", "amount_cents": 100}
    first = on.refund(idempotency_key="k", **args)
    assert on.refund(idempotency_key="k", **args) == first
    assert len(on.refunds()) == 1
    off = PaymentProvider(tmp_path / "p.db", idempotency=False)
    off.refund(idempotency_key="k", **args)
    assert len(off.refunds()) == 2
    assert on.reverse(first.refund_id, idempotency_key="u") == on.reverse(
        first.refund_id, idempotency_key="u"
    )
    assert len(on.reversals()) == 1


def test_refund_that_failed_in_doubt_is_found_and_reversed(
    env: Harness, provider: PaymentProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The provider accepts the refund but the response is lost, and the provider's look-up is
    down for every retry: issue_refund fails for good *in doubt*. The compensation asks the
    reconcile (with the step's own idempotency key) and reverses the refund that did happen."""
    original_refund, original_find = PaymentProvider.refund, PaymentProvider.find_refund
    looked_up: list[str] = []

    def accept_then_lose(self: PaymentProvider, **kwargs: Any) -> Any:
        original_refund(self, **kwargs)
        raise ConnectionError("connection reset by peer after the request was sent")

    def find_when_back(self: PaymentProvider, reference: str) -> Any:
        looked_up.append(reference)
        if len(looked_up) < refunds.FAST.max_attempts:
            raise ConnectionError("the provider's search is down")
        return original_find(self, reference)

    monkeypatch.setattr(PaymentProvider, "refund", accept_then_lose)
    monkeypatch.setattr(PaymentProvider, "find_refund", find_when_back)
    run_id = env.start(refunds.refund_dispute, SMALL)
    env.run_until_idle()
    assert env.get(run_id).status == "compensated"
    [refund] = provider.refunds()
    [reversal] = provider.reversals()
    assert reversal.refund_id == refund.refund_id
    assert set(looked_up) == {refund.reference}, "the reconcile must look up the step's key"


# --- a refund above the approval limit ---------------------------------------------------------


def ask_for_approval(env: Harness) -> tuple[str, Any]:
    run_id = env.start(refunds.refund_dispute, LARGE)
    answer_customer(
        env, run_id, {"message": "It arrived broken, one leg snapped off."}, skip_time=False
    )
    assert env.get(run_id).status == "waiting"
    [pending] = env.approvals(run_id)
    return run_id, pending


def test_a_large_refund_is_issued_once_after_a_person_approves(
    env: Harness, provider: PaymentProvider
) -> None:
    run_id, pending = ask_for_approval(env)
    assert pending.action == "issue_large_refund"
    assert pending.args == {
        "req": {"dispute_id": "D-1003", "transaction_id": "txn_5003", "amount_cents": 48900}
    }
    assert pending.reason is not None and "a person approves" in pending.reason
    env.restart()  # the approval is in the history, not in memory
    env.run_until_idle(skip_time=False)
    assert provider.refunds() == [], "no refund before the approval"
    env.approve(run_id, pending.call_id, by="maria")
    env.run_until_idle()
    result = env.result(run_id)
    [refund] = provider.refunds("D-1003")
    assert result.outcome == "refunded" and result.refund_id == refund.refund_id
    assert refund.amount_cents == 48900
    assert states(env, run_id)["issue_large_refund"] == ["completed"]
    record: Any = env.client.get_published(run_id, f"approval:{pending.call_id}")
    assert record["status"] == "approved" and record["by"] == "maria"


def test_a_denied_large_refund_is_not_issued(env: Harness, provider: PaymentProvider) -> None:
    run_id, pending = ask_for_approval(env)
    env.deny(run_id, pending.call_id, reason="the desk was a gift: refund the buyer", by="maria")
    env.run_until_idle()
    result = env.result(run_id)
    assert result.outcome == "denied" and result.refund_id is None
    assert "refund the buyer" in result.summary
    assert provider.refunds() == []
    assert "issue_large_refund" not in states(env, run_id)


def test_an_unanswered_approval_is_escalated_and_keeps_waiting(
    env: Harness, provider: PaymentProvider
) -> None:
    run_id, pending = ask_for_approval(env)
    env.advance(refunds.APPROVAL_TIMEOUT + timedelta(seconds=1))
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    [escalated] = env.approvals(run_id)
    assert escalated.status == "escalated" and provider.refunds() == []
    env.approve(run_id, pending.call_id)
    env.run_until_idle()
    assert env.result(run_id).outcome == "refunded"


def test_issue_refund_refuses_an_amount_above_the_limit(
    env: Harness, provider: PaymentProvider, use_policy: Callable[[Policy], None]
) -> None:
    """The limit does not rely on the model choosing the right tool: issue_refund's argument
    type refuses a larger amount before any step runs, and the model is told why."""
    retries: list[str] = []

    def careless(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        response = refund_model.policy(messages, info)
        last = messages[-1]
        retries.extend(
            str(p.content)
            for p in (last.parts if isinstance(last, ModelRequest) else ())
            if isinstance(p, ToolReturnPart) and p.outcome == "retried"
        )
        for part in response.parts:
            if (
                isinstance(part, ToolCallPart)
                and part.tool_name == "issue_large_refund"
                and not retries
            ):
                part.tool_name = "issue_refund"  # the wrong tool, once
        return response

    use_policy(careless)
    run_id = env.start(refunds.refund_dispute, LARGE)
    answer_customer(env, run_id, {"message": "It arrived broken."}, skip_time=False)
    assert retries and "less than or equal to 20000" in retries[0]
    assert "issue_refund" not in states(env, run_id)
    [pending] = env.approvals(run_id)
    assert pending.action == "issue_large_refund" and provider.refunds() == []


def test_a_model_that_never_stops_waits_at_its_budget(
    env: Harness, provider: PaymentProvider, use_policy: Callable[[Policy], None]
) -> None:
    def runaway(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return refund_model._call("Let me look again.", {"check_history": {"customer_id": "x"}})

    use_policy(runaway)
    run_id = env.start(refunds.refund_dispute, SMALL)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    assert any("'budget'" in w for w in env.status(run_id).waiting_for)
    assert len(model_calls(env, run_id)) == refunds.BUDGET.requests == 20
    use_policy(refund_model.policy)
    env.send_event(run_id, "budget", {"requests": 30})  # a person raises it; the agent goes on
    env.run_until_idle()
    assert env.result(run_id).outcome == "refunded"
