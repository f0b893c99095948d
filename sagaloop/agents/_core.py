"""What the framework adapters share: a tool's policy and its step, the usage of a saga run
counted across its agent runs, budgets, approvals. No agent framework is imported here."""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Literal

import pydantic_core

from sagaloop.agents.budgets import USAGE_KEY, Budget, BudgetExceeded, Usage
from sagaloop.errors import ValidationError
from sagaloop.sagas.app import App, StepDef
from sagaloop.sagas.approvals import Approval
from sagaloop.sagas.context import SagaContext, StepContext
from sagaloop.sagas.policy import RetryPolicy

_STEP_NAME = re.compile(r"[^A-Za-z0-9_.:-]")


@dataclasses.dataclass(frozen=True)
class ToolPolicy:
    """How one tool runs as a step. Give it in the tool's metadata
    (``@agent.tool(metadata={"sagaloop": ToolPolicy(...)})``) or in ``SagaAgent(tools={...})``
    (Pydantic AI), or in ``SagaRunner(tools={...})`` (OpenAI Agents).

    ``compensation(ctx, args, result)`` undoes the tool's effect when the run fails;
    ``reconcile(ctx, args) -> result | None`` says whether an attempt in doubt took effect; with
    ``idempotent=False`` and no reconcile an attempt in doubt halts the run in
    ``needs_attention`` instead of repeating. ``requires_approval`` pauses the run for a person
    (``sagaloop approve``), waiting at most ``approval_timeout``, then ``on_timeout``.
    ``rate_limit`` (``"10/s"``, ``"600/m"``) caps how often the tool's attempts start, across
    every worker; tools (and model steps) with the same ``rate_key`` share one quota, as an
    API's does (see ``@app.step(rate_limit=...)``)."""

    queue: str | None = None
    retry: RetryPolicy | None = None
    timeout: timedelta | None = None
    idempotent: bool = True
    compensation: Callable[[StepContext, dict[str, Any], Any], Any] | None = None
    reconcile: Callable[[StepContext, dict[str, Any]], Any] | None = None
    requires_approval: bool | None = None
    approval_timeout: timedelta | None = None
    on_timeout: Literal["deny", "escalate"] = "deny"
    rate_limit: str | None = None
    rate_key: str | None = None


async def _run_plain(step: StepDef[Any, Any], kwargs: dict[str, Any]) -> Any:
    """A step's function run in-process, outside any saga (a tool used by a plain agent)."""
    from sagaloop.engine.messages import Envelope
    from sagaloop.engine.steps import _StepContext

    env = Envelope(type="step", run_id="local", payload={}, position=0, attempt=1)
    result = step.fn(_StepContext(env, step, False), **kwargs)
    if isinstance(result, collections.abc.Awaitable):
        result = await result
    return result


def _jsonable(value: Any, what: str) -> Any:
    try:
        return pydantic_core.to_jsonable_python(value)
    except pydantic_core.PydanticSerializationError as e:
        raise ValidationError(f"{what} cannot be stored as JSON: {e}") from e


def _step_part(text: str) -> str:
    return _STEP_NAME.sub("_", text)


def _denial(reason: str | None) -> str:
    return f"The tool call was denied: {reason}" if reason else "The tool call was denied."


@dataclasses.dataclass
class _RunUsage:
    """What one saga run used, across its agent runs (rebuilt by replay, like the run)."""

    usage: Usage
    started: datetime


_usage: weakref.WeakKeyDictionary[SagaContext, _RunUsage] = weakref.WeakKeyDictionary()


def _usage_of(saga: SagaContext) -> _RunUsage:
    found = _usage.get(saga)
    if found is None:
        found = _usage[saga] = _RunUsage(Usage(), saga.now())
    return found


async def check_budget(saga: SagaContext, budget: Budget | None) -> Budget | None:
    """Before a model request: raise :class:`BudgetExceeded`, or wait for the event ``budget``
    (``on_exceed="wait"``) until the limits are raised; returns the budget in force."""
    while budget is not None:
        state = _usage_of(saga)
        reached = state.usage.over(budget, started=state.started, now=saga.now())
        if not reached:
            return budget
        if budget.on_exceed == "fail":
            raise BudgetExceeded(saga.run_id, reached, state.usage.model_copy())
        publish_usage(saga, budget)
        prompt = {"budget": "exceeded", "reached": reached, "usage": state.usage.model_dump()}
        data = await saga.wait_for_event("budget", prompt=prompt)
        budget = budget.raised(data)
    return budget


def publish_usage(saga: SagaContext, budget: Budget | None) -> None:
    """Usage against the budget, for `sagaloop status` and the console."""
    shown: dict[str, Any] = _usage_of(saga).usage.model_dump()
    if budget is not None:
        shown["budget"] = budget.model_dump(mode="json", exclude_none=True)
    saga.publish(USAGE_KEY, shown)


async def ask(
    saga: SagaContext,
    tool: str,
    args: Any,
    policy: ToolPolicy,
    *,
    timeout: timedelta | None,
    on_timeout: Literal["deny", "escalate"],
    reasoning: str | None,
) -> Approval:
    """A person's answer to a tool call (the tool's policy first, then the agent's defaults)."""
    return await saga.approval(
        tool,
        args,
        timeout=policy.approval_timeout or timeout,
        on_timeout=policy.on_timeout if policy.approval_timeout else on_timeout,
        reason=reasoning[:4000] if reasoning else None,
    )


def _tool_step(
    app: App, name: str, policy: ToolPolicy, queue: str
) -> Callable[[Callable[..., Any]], StepDef[Any, Any]]:
    """Declares the step of a tool (its call is ``{"args", ...}``, its result ``{"value"}``)
    with the tool's policy; its compensation and reconcile get the tool's arguments."""

    def register(fn: Callable[..., Any]) -> StepDef[Any, Any]:
        step: StepDef[Any, Any] = app.step(
            name=name,
            queue=queue,
            retry=policy.retry,
            timeout=policy.timeout,
            idempotent=policy.idempotent,
            rate_limit=policy.rate_limit,
            rate_key=policy.rate_key,
        )(fn)
        if policy.compensation is not None:
            undo = policy.compensation

            def compensate(ctx: StepContext, call: dict[str, Any], result: Any) -> Any:
                value = result.get("value") if isinstance(result, dict) else None
                return undo(ctx, call.get("args", {}), value)

            step.compensation(compensate)
        if policy.reconcile is not None:
            look_up = policy.reconcile

            def reconcile(ctx: StepContext, call: dict[str, Any]) -> Any:
                found = look_up(ctx, call.get("args", {}))
                return None if found is None else {"value": _jsonable(found, "a found result")}

            step.reconcile(reconcile)
        return step

    return register
