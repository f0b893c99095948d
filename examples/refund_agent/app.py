"""The customer refund agent as a durable saga.

A dispute comes in; the agent loop asks a model for the next action, runs it as a durable step,
adds what it observed to the transcript and asks again, until the model closes the dispute.
Along the way it may ask the customer a question and wait up to two days for the answer (a
durable timer: no process is held while it waits), and it may issue a refund, which must never
happen twice: ``issue_refund`` is declared ``idempotent=False`` with a ``reconcile`` that asks the
provider whether an in-doubt attempt went through, and a ``compensation`` that reverses it if the
saga fails later (say, the ledger refuses the posting).

Run it with ``sagaloop dev --app examples.refund_agent.app`` from the repository root, or see it
survive a SIGKILL with ``sagaloop demo``.

Environment (read when a step runs): ``REFUNDS_PROVIDER_DB`` (the fake services' SQLite file),
``REFUNDS_PROVIDER_IDEMPOTENCY=off`` (the provider ignores idempotency keys),
``REFUNDS_HANG_AFTER_ACCEPT=1`` (``issue_refund`` hangs right after the provider accepted the
refund, so that a demo can kill the process at the worst moment), ``REFUNDS_MODEL`` (see
``model.py``).
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field

from examples.refund_agent.model import Decision, Outcome, Transcript, Turn, current_model
from examples.refund_agent.provider import Ledger, Mailbox, PaymentProvider, Posting, Refund
from sagaloop import (
    App,
    ApplicationError,
    EventTimeoutError,
    RetryPolicy,
    SagaContext,
    StepContext,
)

app = App("refunds")

REPLY_TIMEOUT = timedelta(days=2)
MAX_TURNS = 20
FAST = RetryPolicy(
    max_attempts=5,
    initial_interval=timedelta(milliseconds=200),
    maximum_interval=timedelta(seconds=5),
)


# --- what the saga exchanges -------------------------------------------------------------------


class Dispute(BaseModel):
    dispute_id: str
    customer_id: str
    transaction_id: str
    amount_cents: int = Field(gt=0)
    reason: str


class Transaction(BaseModel):
    transaction_id: str
    customer_id: str
    amount_cents: int
    merchant: str
    date: str


class Policy(BaseModel):
    statement_required_over_cents: int
    max_disputes_per_year: int
    window_days: int
    text: str


class AccountHistory(BaseModel):
    customer_id: str
    account_age_days: int
    disputes_last_year: int


class FraudVerdict(BaseModel):
    score: float
    risk: Literal["low", "medium", "high"]


class CustomerReply(BaseModel):
    message: str


class Assessment(BaseModel):
    supports_refund: bool
    summary: str


class RefundRequest(BaseModel):
    dispute_id: str
    transaction_id: str
    amount_cents: int


class Resolution(BaseModel):
    dispute_id: str
    outcome: Outcome
    refund_id: str | None = None
    summary: str
    turns: int


# --- fake data sources (stand-ins for the company's services) ----------------------------------

TRANSACTIONS = {
    "txn_5001": Transaction(
        transaction_id="txn_5001",
        customer_id="cus_ada",
        amount_cents=12999,
        merchant="Northwind Audio",
        date="2026-01-03",
    ),
    "txn_5002": Transaction(
        transaction_id="txn_5002",
        customer_id="cus_grace",
        amount_cents=2500,
        merchant="Blue Bottle Books",
        date="2026-01-05",
    ),
}
HISTORY = {"cus_ada": (2140, 0), "cus_grace": (380, 1)}
POLICY = Policy(
    statement_required_over_cents=5000,
    max_disputes_per_year=3,
    window_days=120,
    text="Refund undelivered or damaged goods within 120 days; above 50.00 ask the customer "
    "for a statement first; escalate repeat disputers and high fraud risk.",
)
SUPPORTING_WORDS = ("never arrived", "not received", "never received", "damaged", "broken")


# --- the model step ----------------------------------------------------------------------------


@app.step(queue="model", retry=FAST, timeout=timedelta(seconds=60))
def decide(ctx: StepContext, transcript: Transcript) -> Decision:
    """Ask the model for the next action. Recorded in the history: a replay never asks again."""
    return current_model().decide(transcript)


# --- tools -------------------------------------------------------------------------------------


@app.step(queue="tools", retry=FAST)
def lookup_transaction(ctx: StepContext, transaction_id: str) -> Transaction | None:
    return TRANSACTIONS.get(transaction_id)


@app.step(queue="tools", retry=FAST)
def read_policy(ctx: StepContext, reason: str) -> Policy:
    return POLICY


@app.step(queue="tools", retry=FAST)
def check_history(ctx: StepContext, customer_id: str) -> AccountHistory:
    age, disputes = HISTORY.get(customer_id, (30, 0))
    return AccountHistory(
        customer_id=customer_id, account_age_days=age, disputes_last_year=disputes
    )


@app.step(queue="tools", retry=FAST, timeout=timedelta(seconds=10))
def fraud_check(ctx: StepContext, dispute: Dispute) -> FraudVerdict:
    """The fraud service's score (a deterministic fake)."""
    if "fraud" in dispute.reason.lower():
        return FraudVerdict(score=0.93, risk="high")
    digest = hashlib.sha256(f"{dispute.customer_id}/{dispute.transaction_id}".encode()).digest()
    score = digest[0] / 255 * 0.3
    return FraudVerdict(score=round(score, 3), risk="medium" if score > 0.2 else "low")


@app.step(queue="notify", retry=FAST)
def ask_customer(ctx: StepContext, dispute: Dispute, question: str) -> None:
    """Send the question; idempotent by key, so a retried send is not sent twice."""
    Mailbox().send(
        customer_id=dispute.customer_id,
        dispute_id=dispute.dispute_id,
        text=question,
        reference=ctx.idempotency_key,
    )


@app.step(queue="tools", retry=FAST)
def evaluate_reply(ctx: StepContext, dispute: Dispute, reply: CustomerReply) -> Assessment:
    """Read the customer's answer against the dispute."""
    text = reply.message.lower()
    found = [w for w in SUPPORTING_WORDS if w in text]
    if found:
        return Assessment(supports_refund=True, summary=f"The customer confirms: {found[0]}.")
    return Assessment(supports_refund=False, summary="The answer does not back the dispute.")


@app.step(queue="notify", retry=FAST)
def notify_customer(ctx: StepContext, dispute: Dispute, text: str) -> None:
    Mailbox().send(
        customer_id=dispute.customer_id,
        dispute_id=dispute.dispute_id,
        text=text,
        reference=ctx.idempotency_key,
    )


# --- money -------------------------------------------------------------------------------------


@app.step(queue="payments", retry=FAST, timeout=timedelta(seconds=30), idempotent=False)
def issue_refund(ctx: StepContext, req: RefundRequest) -> Refund:
    """Pay the customer back. Must never run twice: when an attempt is in doubt, sagaloop calls
    ``find_refund`` first and records what it finds instead of paying again."""
    refund = PaymentProvider().refund(
        dispute_id=req.dispute_id,
        transaction_id=req.transaction_id,
        amount_cents=req.amount_cents,
        idempotency_key=ctx.idempotency_key,
    )
    if os.environ.get("REFUNDS_HANG_AFTER_ACCEPT") == "1" and not ctx.in_doubt:
        # The provider accepted; the answer has not reached sagaloop yet. The demo kills the
        # process here, the worst moment.
        time.sleep(3600)
    return refund


@issue_refund.reconcile
def find_refund(ctx: StepContext, req: RefundRequest) -> Refund | None:
    """Did an in-doubt attempt go through? Look the refund up by its idempotency key."""
    return PaymentProvider().find_refund(ctx.idempotency_key)


@issue_refund.compensation
def reverse_refund(ctx: StepContext, req: RefundRequest, result: Refund) -> None:
    """Take the refund back; the compensation's own key makes a retried reversal a no-op."""
    PaymentProvider().reverse(result.refund_id, idempotency_key=ctx.idempotency_key)


@app.step(queue="ledger", retry=FAST)
def post_to_ledger(ctx: StepContext, refund: Refund, reason: str) -> Posting:
    """Book the refund. A dispute whose reason contains ``ledger-down`` meets a ledger that
    refuses the posting for good, which makes the saga fail and the refund be reversed."""
    if "ledger-down" in reason:
        raise ApplicationError(
            f"the ledger refused posting {refund.refund_id}: account 'refunds' is closed",
            type="LedgerRejected",
            non_retryable=True,
        )
    return Ledger().post(
        refund_id=refund.refund_id, amount_cents=refund.amount_cents, reference=ctx.idempotency_key
    )


# --- the agent loop ----------------------------------------------------------------------------


@app.saga(name="refund-dispute")
async def refund_dispute(ctx: SagaContext, dispute: Dispute) -> Resolution:
    transcript = Transcript().add(Turn(role="dispute", content=dispute.model_dump()))
    refund: Refund | None = None
    turns = 0
    while True:
        turns += 1
        if turns > MAX_TURNS:
            decision = Decision(action="close", reason="Too many turns.", outcome="escalated")
        else:
            decision = await ctx.call(decide, transcript)
        ctx.logger.info("turn %d: %s (%s)", turns, decision.action, decision.reason)
        transcript = transcript.add(
            Turn(role="agent", action=decision.action, content=decision.model_dump())
        )
        observation: dict[str, Any]
        if decision.action == "lookup_transaction":
            txn = await ctx.call(lookup_transaction, dispute.transaction_id)
            observation = txn.model_dump() if txn else {"transaction_id": None}
        elif decision.action == "read_policy":
            observation = (await ctx.call(read_policy, dispute.reason)).model_dump()
        elif decision.action == "check_history":
            observation = (await ctx.call(check_history, dispute.customer_id)).model_dump()
        elif decision.action == "fraud_check":
            observation = (await ctx.call(fraud_check, dispute)).model_dump()
        elif decision.action == "ask_customer":
            question = decision.question or "Please tell us more about your dispute."
            await ctx.call(ask_customer, dispute, question)
            try:
                reply = await ctx.wait_for_event(
                    "customer-reply", timeout=REPLY_TIMEOUT, model=CustomerReply
                )
            except EventTimeoutError:
                observation = {"timed_out": True}
            else:
                transcript = transcript.add(Turn(role="customer", content=reply.model_dump()))
                observation = (await ctx.call(evaluate_reply, dispute, reply)).model_dump()
        elif decision.action == "refund":
            request = RefundRequest(
                dispute_id=dispute.dispute_id,
                transaction_id=dispute.transaction_id,
                amount_cents=dispute.amount_cents,
            )
            issued = await ctx.call(issue_refund, request)
            refund = issued
            posting = await ctx.call(post_to_ledger, issued, dispute.reason)
            observation = {"refund": issued.model_dump(), "posting": posting.model_dump()}
        else:
            return await _close(ctx, dispute, decision, refund, turns)
        transcript = transcript.add(Turn(role="tool", action=decision.action, content=observation))


async def _close(
    ctx: SagaContext, dispute: Dispute, decision: Decision, refund: Refund | None, turns: int
) -> Resolution:
    outcome: Outcome = decision.outcome or "escalated"
    resolution = Resolution(
        dispute_id=dispute.dispute_id,
        outcome=outcome,
        refund_id=refund.refund_id if refund and outcome == "refunded" else None,
        summary=decision.reason,
        turns=turns,
    )
    await ctx.call(notify_customer, dispute, _message(outcome, dispute, decision.reason))
    return resolution


def _message(outcome: Outcome, dispute: Dispute, reason: str) -> str:
    amount = f"{dispute.amount_cents / 100:.2f}"
    if outcome == "refunded":
        return f"We refunded {amount} for dispute {dispute.dispute_id}."
    if outcome == "denied":
        return f"We cannot refund dispute {dispute.dispute_id}: {reason}"
    return f"A colleague will review dispute {dispute.dispute_id} within one business day."
