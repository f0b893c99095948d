"""Budgets of an agent run, counted from what the history recorded.

Usage comes from the recorded results of model and tool steps, so a replay adds up the same
figures and stops at the same request: a budget never double-counts and never diverges.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sagaloop.errors import SagaloopError

USAGE_KEY = "agent usage"
"""The key under which an agent run publishes its usage (and budget) after each model request:
``Client.get_published(run_id, USAGE_KEY)``, and ``sagaloop status``."""


class Budget(BaseModel):
    """Limits of one run (all agent runs of a saga run together). ``None``: no limit.

    Checked before each model request, and before each batch of tool calls a model response
    asks for (all the calls of one response together, before any of them runs: a response
    that asks for more calls than ``tool_calls`` has left runs none of them).
    ``on_exceed="fail"`` raises :class:`BudgetExceeded` in saga code (the run fails and
    compensates unless the saga catches it); ``"wait"`` makes the run wait for the event
    ``budget`` (``sagaloop send-event RUN budget --data '{"requests": 40}'``), whose data
    raises the limits it names, then goes on; ``"tell_model"`` answers each call of a refused
    batch with the refusal (none runs) and lets the model go on (a model request past a limit
    still fails, as with ``"fail"``: there is no model to tell)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests: int | None = Field(default=None, ge=0)
    input_tokens: int | None = Field(default=None, ge=0)
    output_tokens: int | None = Field(default=None, ge=0)
    tool_calls: int | None = Field(default=None, ge=0)
    cost: float | None = Field(default=None, ge=0)
    """In the currency of the prices (genai-prices: US dollars)."""
    wall_clock: timedelta | None = None
    """From the start of the run, in the run's recorded time."""
    on_exceed: Literal["fail", "wait", "tell_model"] = "fail"

    def raised(self, data: Any) -> Budget:
        """This budget with the limits in ``data`` (a ``budget`` event's) replaced."""
        if not isinstance(data, dict):
            return self
        fields = {k: v for k, v in data.items() if k in Usage.model_fields or k == "wall_clock"}
        return self.model_validate({**self.model_dump(), **fields})


class Usage(BaseModel):
    """What a run used so far."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0
    cost: float = 0.0

    def plus(self, other: Usage) -> Usage:
        """The sum of two usages."""
        return Usage(
            requests=self.requests + other.requests,
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            tool_calls=self.tool_calls + other.tool_calls,
            cost=self.cost + other.cost,
        )

    def over(self, budget: Budget, *, started: datetime, now: datetime) -> list[str]:
        """The limits of ``budget`` this usage reached (a request is refused once a limit is
        reached, since the next one would pass it)."""
        out = []
        for name in ("requests", "input_tokens", "output_tokens", "tool_calls", "cost"):
            limit = getattr(budget, name)
            used = getattr(self, name)
            if limit is not None and used >= limit:
                out.append(f"{name} {used:g} of {limit:g}")
        if budget.wall_clock is not None and now - started >= budget.wall_clock:
            out.append(f"wall_clock {now - started} of {budget.wall_clock}")
        return out


class BudgetExceeded(SagaloopError):
    """A run reached a limit of its budget; raised in saga code at the next model request, or
    before a batch of tool calls that would pass ``tool_calls``."""

    def __init__(self, run_id: str, reached: list[str], usage: Usage) -> None:
        super().__init__(
            f"run {run_id!r} reached its budget ({', '.join(reached)}); raise the limits with "
            "a Budget(on_exceed='wait') and the event 'budget', or give the saga a larger one"
        )
        self.run_id = run_id
        self.reached = reached
        self.usage = usage
