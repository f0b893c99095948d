"""The agent's brain: a ``Model`` chooses the next action from the transcript.

The saga calls it through the ``decide`` step, so every decision is recorded in the run's history
and replayed, never asked again, when the saga code runs again after a crash. The default
:class:`ScriptedModel` is a deterministic policy that needs no network; a real LLM client plugs in
by implementing :class:`Model` and passing it to :func:`use_model` (or naming a factory in
``$REFUNDS_MODEL`` as ``module:attribute``), without touching the saga.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

Action = Literal[
    "lookup_transaction",
    "read_policy",
    "check_history",
    "fraud_check",
    "ask_customer",
    "refund",
    "close",
]
Outcome = Literal["refunded", "denied", "escalated"]


class Turn(BaseModel):
    """One entry of the transcript: the dispute, an agent decision, a tool's observation or the
    customer's words."""

    model_config = ConfigDict(frozen=True)

    role: Literal["dispute", "agent", "tool", "customer"]
    action: Action | None = None
    content: dict[str, Any] = Field(default_factory=dict)


class Transcript(BaseModel):
    """Everything the agent saw and did so far, oldest first."""

    model_config = ConfigDict(frozen=True)

    turns: tuple[Turn, ...] = ()

    def add(self, turn: Turn) -> Transcript:
        return Transcript(turns=(*self.turns, turn))

    def observed(self, action: Action) -> dict[str, Any] | None:
        """The latest tool observation of ``action``, if any."""
        for turn in reversed(self.turns):
            if turn.role == "tool" and turn.action == action:
                return turn.content
        return None

    @property
    def dispute(self) -> dict[str, Any]:
        return self.turns[0].content if self.turns else {}


class Decision(BaseModel):
    """The next action and why. ``question`` goes with ``ask_customer``, ``outcome`` with
    ``close``."""

    action: Action
    reason: str
    question: str | None = None
    outcome: Outcome | None = None


class Model(Protocol):
    def decide(self, transcript: Transcript) -> Decision: ...


class ScriptedModel:
    """A deterministic refund policy standing in for an LLM: gather facts, ask the customer when
    the policy wants a statement, refund when everything supports it, close otherwise."""

    def decide(self, transcript: Transcript) -> Decision:
        dispute = transcript.dispute
        amount = int(dispute.get("amount_cents", 0))
        txn = transcript.observed("lookup_transaction")
        if txn is None:
            return Decision(action="lookup_transaction", reason="I need the disputed payment.")
        if txn.get("customer_id") != dispute.get("customer_id") or amount > txn["amount_cents"]:
            return _close("denied", "The dispute does not match the transaction.")
        policy = transcript.observed("read_policy")
        if policy is None:
            return Decision(action="read_policy", reason="Which refund rules apply?")
        history = transcript.observed("check_history")
        if history is None:
            return Decision(action="check_history", reason="Is this customer a repeat disputer?")
        if history["disputes_last_year"] > policy["max_disputes_per_year"]:
            return _close("escalated", "Too many disputes this year: a person must look.")
        fraud = transcript.observed("fraud_check")
        if fraud is None:
            return Decision(action="fraud_check", reason="Ask the fraud service for a score.")
        if fraud["risk"] == "high":
            return _close("escalated", f"Fraud risk is high ({fraud['score']:.2f}).")
        if amount > policy["statement_required_over_cents"]:
            reply = transcript.observed("ask_customer")
            if reply is None:
                return Decision(
                    action="ask_customer",
                    reason="The policy asks for the customer's statement above "
                    f"{policy['statement_required_over_cents'] / 100:.2f}.",
                    question="Did you receive the goods? Please describe what went wrong.",
                )
            if reply.get("timed_out"):
                return _close("denied", "The customer did not answer within two days.")
            if not reply.get("supports_refund"):
                return _close("denied", "The customer's answer does not support a refund.")
        refund = transcript.observed("refund")
        if refund is None:
            return Decision(action="refund", reason="The facts support a full refund.")
        return _close("refunded", f"Refund {refund['refund']['refund_id']} issued and booked.")


def _close(outcome: Outcome, reason: str) -> Decision:
    return Decision(action="close", reason=reason, outcome=outcome)


_model: Model | None = None


def use_model(model: Model | None) -> None:
    """Make ``decide`` use ``model`` in this process (None: back to the default)."""
    global _model
    _model = model


def current_model() -> Model:
    """The model set by :func:`use_model`, else the factory named by ``$REFUNDS_MODEL``
    (``module:attribute``), else :class:`ScriptedModel`."""
    if _model is not None:
        return _model
    spec = os.environ.get("REFUNDS_MODEL", "")
    if spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr or "model")
        model: Model = factory()
        return model
    return ScriptedModel()
