"""The customer refund agent: a Pydantic AI agent run as a durable saga.

A dispute comes in; the saga hands it to ``agent``, a Pydantic AI ``Agent`` wrapped in
``SagaAgent``: each model request and each tool call is a step of the run, recorded in its
history, so after a crash the model is not asked again and no recorded tool runs again. The
tools are the ``@app.step``s below, handed to the model with ``step_as_tool``: each keeps its
queue, retry policy, timeout, reconcile and compensation. The agent answers with one of two
outputs: a ``Question`` for the customer, or a ``Verdict`` that closes the dispute.

On a question the saga sends it and waits up to two days for the customer's answer (a durable
timer: no process is held while it waits), then runs the agent again on the same conversation
with the answer. The refund must never happen twice: ``issue_refund`` is declared
``idempotent=False`` with a ``reconcile`` that asks the provider whether an in-doubt attempt went
through, and a ``compensation`` that reverses it if the saga fails later (say, the ledger refuses
the posting). Refunds above 200.00 need a person's approval (``sagaloop approve``), and a
``Budget`` caps the model requests of a run. The saga books the refund the provider returned,
not what the model says, and tells the customer.

Run it with ``sagaloop dev --app examples.refund_agent.app`` from the repository root (with
``pip install -e '.[pydantic-ai]'``), or see it survive a SIGKILL with ``sagaloop demo``.

Environment: ``REFUNDS_MODEL`` (read when the agent is built: a Pydantic AI model name such as
``openai:gpt-5``; default, an offline policy, see ``model.py``), ``REFUNDS_PROVIDER_DB`` (the
fake services' SQLite file), ``REFUNDS_PROVIDER_IDEMPOTENCY=off`` (the provider ignores
idempotency keys), ``REFUNDS_HANG_AFTER_ACCEPT=1`` (a refund step hangs right after the provider
accepted the refund, so that a demo can kill the process at the worst moment); the last three are
read when a step runs.
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta

from pydantic_ai import Agent, ToolOutput
from pydantic_ai.messages import ModelMessage, ModelRequest, ToolReturnPart

from examples.refund_agent.data import (
    APPROVAL_OVER_CENTS,
    AccountHistory,
    CustomerReply,
    Dispute,
    FraudVerdict,
    LargeRefundRequest,
    Outcome,
    Policy,
    Question,
    RefundRequest,
    Resolution,
    Transaction,
    Verdict,
)
from examples.refund_agent.model import dispute_prompt, refund_model, reply_prompt
from examples.refund_agent.provider import Ledger, Mailbox, PaymentProvider, Posting, Refund
from sagaloop import (
    App,
    ApplicationError,
    EventTimeoutError,
    RetryPolicy,
    SagaContext,
    StepContext,
)
from sagaloop.agents import Budget
from sagaloop.agents.pydantic_ai import SagaAgent, step_as_tool

app = App("refunds")

REPLY_TIMEOUT = timedelta(days=2)
APPROVAL_TIMEOUT = timedelta(days=2)
BUDGET = Budget(requests=20, on_exceed="wait")
FAST = RetryPolicy(
    max_attempts=5,
    initial_interval=timedelta(milliseconds=200),
    maximum_interval=timedelta(seconds=5),
)


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
    "txn_5003": Transaction(
        transaction_id="txn_5003",
        customer_id="cus_linus",
        amount_cents=48900,
        merchant="Fjord Furniture",
        date="2026-01-08",
    ),
}
HISTORY = {"cus_ada": (2140, 0), "cus_grace": (380, 1), "cus_linus": (920, 0)}
POLICY = Policy(
    statement_required_over_cents=5000,
    approval_required_over_cents=APPROVAL_OVER_CENTS,
    max_disputes_per_year=3,
    window_days=120,
    text="Refund undelivered or damaged goods within 120 days; above 50.00 ask the customer "
    "for a statement first; above 200.00 a person approves the refund; escalate repeat "
    "disputers and high fraud risk.",
)


# --- tools -------------------------------------------------------------------------------------


@app.step(queue="tools", retry=FAST)
def lookup_transaction(ctx: StepContext, transaction_id: str) -> Transaction | None:
    """The disputed payment, or null if there is no such transaction."""
    return TRANSACTIONS.get(transaction_id)


@app.step(queue="tools", retry=FAST)
def read_policy(ctx: StepContext, reason: str) -> Policy:
    """The refund rules that apply to a dispute with this reason."""
    return POLICY


@app.step(queue="tools", retry=FAST)
def check_history(ctx: StepContext, customer_id: str) -> AccountHistory:
    """The customer's account age and disputes of the last year."""
    age, disputes = HISTORY.get(customer_id, (30, 0))
    return AccountHistory(
        customer_id=customer_id, account_age_days=age, disputes_last_year=disputes
    )


@app.step(queue="tools", retry=FAST, timeout=timedelta(seconds=10))
def fraud_check(ctx: StepContext, dispute: Dispute) -> FraudVerdict:
    """The fraud service's score of the dispute (a deterministic fake)."""
    if "fraud" in dispute.reason.lower():
        return FraudVerdict(score=0.93, risk="high")
    digest = hashlib.sha256(f"{dispute.customer_id}/{dispute.transaction_id}".encode()).digest()
    score = digest[0] / 255 * 0.3
    return FraudVerdict(score=round(score, 3), risk="medium" if score > 0.2 else "low")


# --- money -------------------------------------------------------------------------------------
#
# Refunds above APPROVAL_OVER_CENTS need a person's approval. `step_as_tool(...,
# requires_approval=True)` is a fixed flag per tool, so the limit makes two tools over two steps
# that share the payment, its reconcile and its compensation. `issue_refund` takes amounts up to
# the limit: its argument's type says so, and Pydantic AI refuses a larger amount (telling the
# model why) before any step runs. `issue_large_refund` takes the larger ones, and the adapter
# pauses the run on it for `sagaloop approve` (ctx.approval, within the same run). The rule holds
# whatever the model decides; it does not rely on the model picking the right tool.


@app.step(queue="payments", retry=FAST, timeout=timedelta(seconds=30), idempotent=False)
def issue_refund(ctx: StepContext, req: RefundRequest) -> Refund:
    """Refund the customer, up to 200.00. Never runs twice: when an attempt is in doubt,
    sagaloop calls ``find_refund`` first and records what it finds instead of paying again."""
    return _refund(ctx, req)


@app.step(queue="payments", retry=FAST, timeout=timedelta(seconds=30), idempotent=False)
def issue_large_refund(ctx: StepContext, req: LargeRefundRequest) -> Refund:
    """Refund the customer above 200.00, once a person has approved it."""
    return _refund(ctx, req)


def _refund(ctx: StepContext, req: RefundRequest) -> Refund:
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
@issue_large_refund.reconcile
def find_refund(ctx: StepContext, req: RefundRequest) -> Refund | None:
    """Did an in-doubt attempt go through? Look the refund up by its idempotency key."""
    return PaymentProvider().find_refund(ctx.idempotency_key)


@issue_refund.compensation
@issue_large_refund.compensation
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


# --- talking to the customer (the saga's steps, not the model's tools) --------------------------


@app.step(queue="notify", retry=FAST)
def ask_customer(ctx: StepContext, dispute: Dispute, question: str) -> None:
    """Send the question; idempotent by key, so a retried send is not sent twice."""
    Mailbox().send(
        customer_id=dispute.customer_id,
        dispute_id=dispute.dispute_id,
        text=question,
        reference=ctx.idempotency_key,
    )


@app.step(queue="notify", retry=FAST)
def notify_customer(ctx: StepContext, dispute: Dispute, text: str) -> None:
    Mailbox().send(
        customer_id=dispute.customer_id,
        dispute_id=dispute.dispute_id,
        text=text,
        reference=ctx.idempotency_key,
    )


# --- the agent ---------------------------------------------------------------------------------

INSTRUCTIONS = """\
You resolve a customer's payment dispute. Gather the facts with the tools (the transaction, the
refund rules, the customer's history, the fraud score), then either ask the customer a question
(ask_customer) or close the dispute (close) as refunded, denied or escalated. Follow the rules
that read_policy returns. Refund with issue_refund up to 200.00 and with issue_large_refund
above, which a person approves; never refund more than the disputed amount."""

agent = SagaAgent(
    Agent[None, Question | Verdict](
        refund_model(),
        name="refunds",
        instructions=INSTRUCTIONS,
        output_type=[ToolOutput(Question, name="ask_customer"), ToolOutput(Verdict, name="close")],
        tools=[
            step_as_tool(lookup_transaction),
            step_as_tool(read_policy),
            step_as_tool(check_history),
            step_as_tool(fraud_check),
            step_as_tool(issue_refund),
            step_as_tool(issue_large_refund, requires_approval=True),
        ],
        defer_model_check=True,  # a model name is resolved at the first request, not at import
    ),
    app=app,
    model_queue="model",
    tool_queue="tools",
    budget=BUDGET,  # reached: the run waits for a person to raise it (the event `budget`)
    approval_timeout=APPROVAL_TIMEOUT,
    on_approval_timeout="escalate",  # unanswered after two days: escalated, still waiting
)


# --- the saga ----------------------------------------------------------------------------------


@app.saga(name="refund-dispute")
async def refund_dispute(ctx: SagaContext, dispute: Dispute) -> Resolution:
    result = await agent.run(dispute_prompt(dispute.model_dump()))
    while isinstance(result.output, Question):
        # The agent's run ends with its question; the wait for the answer is the saga's. Then
        # the agent goes on with the same conversation (and the same usage count).
        await ctx.call(ask_customer, dispute, result.output.question)
        try:
            reply = await ctx.wait_for_event(
                "customer-reply", timeout=REPLY_TIMEOUT, model=CustomerReply
            )
            answer: str | None = reply.message
        except EventTimeoutError:
            answer = None
        result = await agent.run(
            reply_prompt(answer), message_history=result.all_messages(), usage=result.usage
        )
    verdict = result.output
    # Money is booked from the provider's answer, not from what the model says it did.
    refund = issued_refund(result.all_messages())
    if refund is not None:
        await ctx.call(post_to_ledger, refund, dispute.reason)
        outcome: Outcome = "refunded"
        summary = verdict.reason
    elif verdict.outcome == "refunded":
        outcome, summary = "escalated", "The agent reported a refund that the provider never made."
    else:
        outcome, summary = verdict.outcome, verdict.reason
    await ctx.call(notify_customer, dispute, _message(outcome, dispute, summary))
    return Resolution(
        dispute_id=dispute.dispute_id,
        outcome=outcome,
        refund_id=refund.refund_id if refund else None,
        summary=summary,
        model_requests=result.usage.requests,
    )


def issued_refund(messages: list[ModelMessage]) -> Refund | None:
    """The refund a refund tool returned in the conversation: the provider's answer."""
    for message in messages:
        for part in message.parts if isinstance(message, ModelRequest) else ():
            # a refund tool's result is a Refund, or the text of a denial: no money moved
            if isinstance(part, ToolReturnPart) and isinstance(part.content, Refund):
                return part.content
    return None


def _message(outcome: Outcome, dispute: Dispute, reason: str) -> str:
    amount = f"{dispute.amount_cents / 100:.2f}"
    if outcome == "refunded":
        return f"We refunded {amount} for dispute {dispute.dispute_id}."
    if outcome == "denied":
        return f"We cannot refund dispute {dispute.dispute_id}: {reason}"
    return f"A colleague will review dispute {dispute.dispute_id} within one business day."
