"""The refund agent example (examples/refund_agent) in the in-process harness: the happy path
refunds once; a refund whose response is lost, or whose worker dies after the provider accepted
it, is reconciled instead of issued again; a ledger that refuses the posting for good gets the
refund reversed once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.refund_agent import app as refunds
from examples.refund_agent import model as refund_model
from examples.refund_agent.provider import Mailbox, PaymentProvider
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
REPLY = {"message": "The parcel never arrived; the tracking page stopped on Jan 4."}


@pytest.fixture
def provider(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PaymentProvider:
    monkeypatch.setenv("REFUNDS_PROVIDER_DB", str(tmp_path / "provider.db"))
    monkeypatch.setenv("REFUNDS_PROVIDER_IDEMPOTENCY", "off")  # only the reconcile protects
    monkeypatch.delenv("REFUNDS_HANG_AFTER_ACCEPT", raising=False)
    monkeypatch.delenv("REFUNDS_MODEL", raising=False)
    return PaymentProvider()


@pytest.fixture
def env(provider: PaymentProvider) -> Iterator[Harness]:
    harness = Harness(refunds.app)
    yield harness
    harness.close()


def states(env: Harness, run_id: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in env.status(run_id).steps:
        out.setdefault(line.step, []).append(line.state)
    return out


def answer_customer(env: Harness, run_id: str) -> None:
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    assert any("customer-reply" in w for w in env.status(run_id).waiting_for)
    env.send_event(run_id, "customer-reply", REPLY)
    env.run_until_idle()


def test_happy_path_refunds_exactly_once(env: Harness, provider: PaymentProvider) -> None:
    run_id = env.start(refunds.refund_dispute, DISPUTE)
    answer_customer(env, run_id)
    result = env.result(run_id)
    assert result["outcome"] == "refunded"
    [refund] = provider.refunds("D-1001")
    assert result["refund_id"] == refund.refund_id
    assert refund.amount_cents == 12999
    assert provider.reversals() == []
    steps = states(env, run_id)
    assert steps["issue_refund"] == ["completed"]
    assert steps["post_to_ledger"] == ["completed"]
    actions = [
        e.data["result"]["action"]
        for e in env.history(run_id)
        if e.kind == "step_completed" and e.name == "decide"
    ]
    assert actions == [
        "lookup_transaction",
        "read_policy",
        "check_history",
        "fraud_check",
        "ask_customer",
        "refund",
        "close",
    ]
    messages = Mailbox().messages("D-1001")
    assert len(messages) == 2 and "refunded 129.99" in messages[-1]


def test_small_dispute_is_refunded_without_asking(env: Harness, provider: PaymentProvider) -> None:
    run_id = env.start(refunds.refund_dispute, SMALL)
    env.run_until_idle()
    assert env.result(run_id)["outcome"] == "refunded"
    assert "ask_customer" not in states(env, run_id)
    assert len(provider.refunds("D-1002")) == 1


def test_no_reply_in_two_days_denies_without_refund(
    env: Harness, provider: PaymentProvider
) -> None:
    run_id = env.start(refunds.refund_dispute, DISPUTE)
    env.run_until_idle()  # skips the virtual clock over the two-day timeout
    result = env.result(run_id)
    assert result["outcome"] == "denied"
    assert provider.refunds() == []


def test_model_is_not_asked_again_for_recorded_turns(
    env: Harness, provider: PaymentProvider
) -> None:
    calls: list[int] = []

    class Counting(refund_model.ScriptedModel):
        def decide(self, transcript: refund_model.Transcript) -> refund_model.Decision:
            calls.append(len(transcript.turns))
            return super().decide(transcript)

    refund_model.use_model(Counting())
    try:
        run_id = env.start(refunds.refund_dispute, DISPUTE)
        env.run_until_idle(skip_time=False)
        asked = len(calls)
        env.restart()  # a new process: the saga code is replayed from the history
        env.send_event(run_id, "customer-reply", REPLY)
        env.run_until_idle()
    finally:
        refund_model.use_model(None)
    assert env.result(run_id)["outcome"] == "refunded"
    assert asked == 5 and len(calls) == 7, "recorded decisions must be replayed, not re-asked"
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
    assert result["refund_id"] == refund.refund_id
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
    assert env.result(run_id)["outcome"] == "refunded"
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
