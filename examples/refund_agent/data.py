"""What the refund saga exchanges: its input and output, the tools' arguments and results, the
customer's reply and the agent's two outputs. Plain pydantic models, in a module of their own so
that a client checking an event against the model a run waits for (``sagaloop send-event``)
imports them without importing the agent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

APPROVAL_OVER_CENTS = 20000
"""Refunds above this amount need a person's approval."""

Outcome = Literal["refunded", "denied", "escalated"]


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
    approval_required_over_cents: int
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


class RefundRequest(BaseModel):
    """A refund up to the approval limit (a larger amount is refused before any step runs)."""

    dispute_id: str
    transaction_id: str
    amount_cents: int = Field(gt=0, le=APPROVAL_OVER_CENTS)


class LargeRefundRequest(RefundRequest):
    """A refund above the approval limit."""

    amount_cents: int = Field(gt=APPROVAL_OVER_CENTS)


class Resolution(BaseModel):
    dispute_id: str
    outcome: Outcome
    refund_id: str | None = None
    summary: str
    model_requests: int


# --- the agent's two outputs -------------------------------------------------------------------


class Question(BaseModel):
    """Ask the customer something and wait for the answer before deciding."""

    question: str
    reason: str


class Verdict(BaseModel):
    """Close the dispute."""

    outcome: Outcome
    reason: str
