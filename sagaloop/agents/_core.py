"""What the framework adapters share: a tool's policy and its step, the usage of a saga run
counted across its agent runs, budgets, approvals. No agent framework is imported here."""

from __future__ import annotations

import asyncio
import collections.abc
import dataclasses
import logging
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
    API's does (see ``@app.step(rate_limit=...)``). ``local=True`` runs the tool as an
    in-process step (``@app.step(local=True)``: the engine's processes run it, with no worker and
    no broker hop), ``local=False`` on its queue; None: as the agent's ``local`` option says."""

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
    local: bool | None = None


class _PlainStepContext(StepContext):
    """What a step's function receives when a plain agent (no saga) calls it as a tool: one
    attempt of no run, nothing to stream to and no one to heartbeat to."""

    def __init__(self, step: StepDef[Any, Any]) -> None:
        self.run_id = "local"
        self.saga = ""
        self.step = step.name
        self.position = 0
        self.attempt = 1
        self.in_doubt = False
        self.idempotency_key = ""
        self.logger = logging.LoggerAdapter(logging.getLogger(__name__), {"step": step.name})

    def stream(self, data: Any) -> None:
        pass

    def heartbeat(self, details: Any = None) -> None:
        pass


async def run_plain(step: StepDef[Any, Any], kwargs: dict[str, Any]) -> Any:
    """A step's function run in-process, outside any saga (a tool used by a plain agent)."""
    result = step.fn(_PlainStepContext(step), **kwargs)
    if isinstance(result, collections.abc.Awaitable):
        result = await result
    return result


def attempt_timeout(limit: timedelta | None) -> asyncio.Timeout:
    """A step body's own deadline (its step's timeout): a model stream read under it is
    closed when the attempt times out, where the engine only stops waiting for it."""
    return asyncio.timeout(None if limit is None else limit.total_seconds())


def jsonable(value: Any, what: str) -> Any:
    try:
        return pydantic_core.to_jsonable_python(value)
    except pydantic_core.PydanticSerializationError as e:
        raise ValidationError(f"{what} cannot be stored as JSON: {e}") from e


def step_part(text: str) -> str:
    return _STEP_NAME.sub("_", text)


def denial(reason: str | None) -> str:
    return f"The tool call was denied: {reason}" if reason else "The tool call was denied."


@dataclasses.dataclass
class _RunUsage:
    """What one saga run used, across its agent runs (rebuilt by replay, like the run)."""

    usage: Usage
    started: datetime
    allowance: Budget | None = None
    """The run tree's limits for this run (:class:`~sagaloop.agents.BudgetTree`): a root's
    own, or the share its parent gave it."""
    reserved: dict[str, Usage] = dataclasses.field(default_factory=dict)
    """Shares given to child runs and not settled yet, by share id: counted as spent."""
    batches: dict[str, int] = dataclasses.field(default_factory=dict)
    """Tool calls of batches that passed their gate and have not all run yet, by agent run:
    counted as spent, so that agent runs of one saga run at the same time cannot each be let
    through with the same calls left."""

    def checked(self) -> Usage:
        """What this run used, with the calls of batches already let through."""
        total = self.usage.model_copy()
        total.tool_calls += sum(self.batches.values())
        return total

    def committed(self) -> Usage:
        """What this run used plus what it reserved for its child runs."""
        total = self.checked()
        for share in self.reserved.values():
            total = total.plus(share)
        return total


_usage: weakref.WeakKeyDictionary[SagaContext, _RunUsage] = weakref.WeakKeyDictionary()


def usage_of(saga: SagaContext) -> _RunUsage:
    found = _usage.get(saga)
    if found is None:
        found = _usage[saga] = _RunUsage(Usage(), saga.now())
    return found


def _limits(state: _RunUsage, budget: Budget | None) -> list[tuple[Budget, Usage]]:
    """Each budget in force with the usage it is checked against: an agent run's budget
    against what the saga run used, the run tree's share against that plus its reservations."""
    out = [] if budget is None else [(budget, state.checked())]
    if state.allowance is not None:
        out.append((state.allowance, state.committed()))
    return out


async def _gate(
    saga: SagaContext, budget: Budget | None, calls: int | None, key: str
) -> tuple[Budget | None, str | None]:
    """Before a model request (``calls`` None), or before a batch of ``calls`` tool calls:
    the budget in force once it may go on (after waiting for the event ``budget`` under
    ``on_exceed="wait"``, as long as needed), and for a batch refused under ``"tell_model"``
    the answer to each of its calls; raises :class:`BudgetExceeded` (``"fail"``, and
    ``"tell_model"`` for a model request). ``key`` names the agent run (its earlier batch
    is over once it asks again)."""
    state = usage_of(saga)
    state.batches.pop(key, None)
    while True:
        reached: list[str] = []
        mode = "fail"
        left: int | None = None
        for limits, used in _limits(state, budget):
            if calls is None:
                found = used.over(limits, started=state.started, now=saga.now())
            elif limits.tool_calls is not None and used.tool_calls + calls > limits.tool_calls:
                found = [f"tool_calls {used.tool_calls}+{calls} of {limits.tool_calls}"]
                rest = max(limits.tool_calls - used.tool_calls, 0)
                left = rest if left is None else min(left, rest)
            else:
                found = []
            if found and not reached:
                mode = limits.on_exceed
            reached += found
        if not reached:
            if calls:
                state.batches[key] = calls
            return budget, None
        if mode == "tell_model" and calls is not None:
            return budget, (
                f"Not run: the budget of this run allows {left} more tool call"
                f"{'' if left == 1 else 's'}, and this response asked for {calls} at once "
                "(none of them ran). Ask for fewer at a time, or answer without tools."
            )
        if mode != "wait":
            raise BudgetExceeded(saga.run_id, reached, state.usage.model_copy())
        publish_usage(saga, budget)
        prompt = {"budget": "exceeded", "reached": reached, "usage": state.usage.model_dump()}
        # a raise counts only once the budget was reached: one sent before is refused
        data = await saga.wait_for_event("budget", prompt=prompt, early="refuse")
        budget = None if budget is None else budget.raised(data)
        if state.allowance is not None:
            state.allowance = state.allowance.raised(data)


async def check_budget(saga: SagaContext, budget: Budget | None, key: str = "") -> Budget | None:
    """Before a model request of the agent run ``key``: raise :class:`BudgetExceeded`, or wait
    for the event ``budget`` (``on_exceed="wait"``) until the limits are raised; returns the
    budget in force."""
    return (await _gate(saga, budget, None, key))[0]


async def check_batch(
    saga: SagaContext, budget: Budget | None, calls: int, key: str = ""
) -> tuple[Budget | None, str | None]:
    """Before any of the ``calls`` tool calls a model response asked for runs: all of them fit
    in what ``tool_calls`` has left, or none runs. Returns the budget in force and, when the
    batch is refused under ``on_exceed="tell_model"``, the answer to give each of its calls;
    ``"fail"`` raises :class:`BudgetExceeded`, ``"wait"`` waits for a raise. The calls let
    through count as spent until they run (:func:`charge_tool_calls` with the same ``key``)
    or the agent run ``key`` asks the model again."""
    if calls <= 0:
        usage_of(saga).batches.pop(key, None)
        return budget, None
    return await _gate(saga, budget, calls, key)


def charge_tool_calls(saga: SagaContext, calls: int = 1, key: str = "") -> None:
    """Count tool calls that run (their steps are about to be called), out of the batch the
    agent run ``key`` was let through with."""
    state = usage_of(saga)
    state.usage.tool_calls += calls
    if key in state.batches:
        state.batches[key] = max(state.batches[key] - calls, 0)


def publish_usage(saga: SagaContext, budget: Budget | None) -> None:
    """Usage against the budget, for `sagaloop status` and the console (``tree``: with what
    the run reserved for its child runs, what a parent counts when it settles a share)."""
    state = usage_of(saga)
    shown: dict[str, Any] = state.usage.model_dump()
    if budget is not None:
        shown["budget"] = budget.model_dump(mode="json", exclude_none=True)
    if state.allowance is not None or state.reserved:
        shown["tree"] = state.committed().model_dump()
    if state.allowance is not None:
        shown["tree_budget"] = state.allowance.model_dump(mode="json", exclude_none=True)
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
    schema: dict[str, Any] | None = None,
) -> Approval:
    """A person's answer to a tool call (the tool's policy first, then the agent's defaults).
    ``schema``: the tool's arguments' JSON Schema, which an edit must fit (checked where the
    answer is given, and again by the run, which refuses an edit that does not fit)."""
    return await saga.approval(
        tool,
        args,
        timeout=policy.approval_timeout or timeout,
        on_timeout=policy.on_timeout if policy.approval_timeout else on_timeout,
        reason=reasoning[:4000] if reasoning else None,
        args_schema=schema,
    )


def policy_step(
    app: App, name: str, policy: ToolPolicy, queue: str
) -> Callable[[Callable[..., Any]], StepDef[Any, Any]]:
    """Declares a step with a tool's (or an MCP server's) policy: its retry, timeout,
    idempotence and rate limit, on ``queue`` (or in-process: ``local``)."""

    def register(fn: Callable[..., Any]) -> StepDef[Any, Any]:
        step: StepDef[Any, Any] = app.step(
            name=name,
            queue=queue,
            retry=policy.retry,
            timeout=policy.timeout,
            idempotent=policy.idempotent,
            rate_limit=policy.rate_limit,
            rate_key=policy.rate_key,
            local=bool(policy.local),
        )(fn)
        return step

    return register


def server_steps(
    app: App,
    prefix: str,
    policy: ToolPolicy,
    queue: str,
    listing: tuple[str, Callable[..., Any]],
    calling: Callable[..., Any],
) -> tuple[StepDef[Any, Any], StepDef[Any, Any]]:
    """The two steps of an agent's MCP server, with the server's policy: ``{prefix}__{name}``
    lists its tools (``listing``: its name and function; idempotent, as listing changes
    nothing), ``{prefix}__call_tool`` calls one of them."""
    listing_policy = dataclasses.replace(policy, idempotent=True, rate_limit=None, rate_key=None)
    listed = policy_step(app, f"{prefix}__{listing[0]}", listing_policy, queue)(listing[1])
    return listed, policy_step(app, f"{prefix}__call_tool", policy, queue)(calling)


def tool_step(
    app: App, name: str, policy: ToolPolicy, queue: str
) -> Callable[[Callable[..., Any]], StepDef[Any, Any]]:
    """Declares the step of a tool (its call is ``{"args", ...}``, its result ``{"value"}``)
    with the tool's policy; its compensation and reconcile get the tool's arguments."""

    def register(fn: Callable[..., Any]) -> StepDef[Any, Any]:
        step = policy_step(app, name, policy, queue)(fn)
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
                return None if found is None else {"value": jsonable(found, "a found result")}

            step.reconcile(reconcile)
        return step

    return register
