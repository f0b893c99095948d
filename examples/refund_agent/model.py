"""The agent's model: any Pydantic AI model; by default a deterministic policy, no network.

:func:`refund_model` returns ``$REFUNDS_MODEL`` when it is set: a Pydantic AI model name such as
``openai:gpt-5`` or ``anthropic:claude-sonnet-4-5``, which the agent then asks unchanged (install
the provider's extra where the engine and the workers run, e.g. ``pip install
'pydantic-ai-slim[openai]'``, and set its API key).
Otherwise it returns ``FunctionModel(policy)``: :func:`policy` plays the LLM. Like one, it reads
the conversation (the dispute, the tools' results, the customer's answer) and answers with tool
calls or with one of the agent's outputs, ``ask_customer`` or ``close``.

Wherever the answer comes from, it is recorded in the run's history by the model-request step,
so a replay after a crash never asks the model again.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_core import to_jsonable_python

from examples.refund_agent.data import Outcome

REFUND_TOOLS = ("issue_refund", "issue_large_refund")
SUPPORTING_WORDS = ("never arrived", "not received", "never received", "damaged", "broken")


# --- what the saga tells the model -------------------------------------------------------------


def dispute_prompt(dispute: dict[str, Any]) -> str:
    return json.dumps({"dispute": dispute})


def reply_prompt(message: str | None) -> str:
    """The customer's answer, or ``None`` when none came before the deadline."""
    if message is None:
        return json.dumps({"customer_reply": None, "note": "no answer within two days"})
    return json.dumps({"customer_reply": message})


def refund_model() -> Model | str:
    """``$REFUNDS_MODEL`` (a Pydantic AI model name), else the offline policy."""
    return os.environ.get("REFUNDS_MODEL") or FunctionModel(policy, model_name="refund-policy")


# --- the offline policy ------------------------------------------------------------------------


class Seen:
    """What the conversation holds: the saga's JSON prompts and the latest result of each tool
    (as JSON: on a worker the messages come back from the history). A call the framework sent
    back for a retry (arguments that did not validate) is no result: the policy decides again."""

    def __init__(self, messages: list[ModelMessage]) -> None:
        self.prompts: dict[str, Any] = {}
        self.results: dict[str, Any] = {}
        for message in messages:
            if not isinstance(message, ModelRequest):
                continue
            for part in message.parts:
                if isinstance(part, ToolReturnPart) and part.outcome == "success":
                    self.results[part.tool_name] = to_jsonable_python(part.content)
                elif isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    try:
                        data = json.loads(part.content)
                    except ValueError:
                        continue
                    if isinstance(data, dict):
                        self.prompts.update(data)


def policy(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """A refund policy standing in for an LLM: gather the facts, ask the fraud service, ask the
    customer when the rules want a statement, refund when everything supports it (with the
    tool that asks a person above the approval limit), close otherwise."""
    seen = Seen(messages)
    dispute: dict[str, Any] = seen.prompts["dispute"]
    amount = int(dispute["amount_cents"])
    facts = {
        "lookup_transaction": {"transaction_id": dispute["transaction_id"]},
        "read_policy": {"reason": dispute["reason"]},
        "check_history": {"customer_id": dispute["customer_id"]},
    }
    missing = {name: args for name, args in facts.items() if name not in seen.results}
    if missing:
        return _call("I need the payment, the rules and the customer's history.", missing)
    txn, rules, history = (seen.results[name] for name in facts)
    if not txn or txn["customer_id"] != dispute["customer_id"] or amount > txn["amount_cents"]:
        return _close("denied", "The dispute does not match the transaction.")
    if history["disputes_last_year"] > rules["max_disputes_per_year"]:
        return _close("escalated", "Too many disputes this year: a person must look.")
    fraud = seen.results.get("fraud_check")
    if fraud is None:
        return _call("Ask the fraud service for a score.", {"fraud_check": {"dispute": dispute}})
    if fraud["risk"] == "high":
        return _close("escalated", f"Fraud risk is high ({fraud['score']:.2f}).")
    if amount > rules["statement_required_over_cents"]:
        if "customer_reply" not in seen.prompts:
            return _ask(
                "The rules ask for the customer's statement above "
                f"{_money(rules['statement_required_over_cents'])}.",
                "Did you receive the goods? Please describe what went wrong.",
            )
        reply = seen.prompts["customer_reply"]
        if reply is None:
            return _close("denied", "The customer did not answer within two days.")
        if not any(word in reply.lower() for word in SUPPORTING_WORDS):
            return _close("denied", "The customer's answer does not support a refund.")
    for tool in REFUND_TOOLS:
        if tool in seen.results:
            result = seen.results[tool]
            if isinstance(result, dict):
                return _close("refunded", f"Refund {result['refund_id']} issued.")
            return _close("denied", f"No refund: {result}")  # a person denied it
    request = {k: dispute[k] for k in ("dispute_id", "transaction_id", "amount_cents")}
    limit = rules["approval_required_over_cents"]
    if amount > limit:
        return _call(
            f"The facts support a refund of {_money(amount)}; above {_money(limit)} a person "
            "approves it.",
            {"issue_large_refund": {"req": request}},
        )
    return _call("The facts support a full refund.", {"issue_refund": {"req": request}})


def _call(reason: str, calls: dict[str, dict[str, Any]]) -> ModelResponse:
    parts = [ToolCallPart(name, args) for name, args in calls.items()]
    return ModelResponse(parts=[TextPart(reason), *parts])


def _ask(reason: str, question: str) -> ModelResponse:
    return _call(reason, {"ask_customer": {"question": question, "reason": reason}})


def _close(outcome: Outcome, reason: str) -> ModelResponse:
    return _call(reason, {"close": {"outcome": outcome, "reason": reason}})


def _money(cents: int) -> str:
    return f"{cents / 100:.2f}"
