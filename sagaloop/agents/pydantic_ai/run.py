"""The saga side of one :class:`~sagaloop.agents.pydantic_ai.SagaAgent` run, shared by the
agent and its MCP servers (:mod:`sagaloop.agents.pydantic_ai.mcp`): the run's state, the tools
as saga code sees them (each call a step, an approval asked inside the run), and how a tool's
signals (``ModelRetry``, ``ApprovalRequired``, ``CallDeferred``) cross a step as values."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import pydantic
import pydantic_core
from pydantic_ai import messages as _messages
from pydantic_ai.durable_exec import DurableRunContext
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry, UserError
from pydantic_ai.tools import RunContext
from pydantic_ai.toolsets import WrapperToolset
from pydantic_ai.toolsets.abstract import ToolsetTool

from sagaloop.agents._core import ToolPolicy, ask, charge_tool_calls, denial, jsonable
from sagaloop.agents._model_call import AgentRun
from sagaloop.errors import ApprovalDenied
from sagaloop.sagas.approvals import Approval

if TYPE_CHECKING:
    from sagaloop.agents.pydantic_ai.agent import SagaAgent


@dataclasses.dataclass(kw_only=True)
class PydanticRun(AgentRun):
    """The saga side of one agent run."""

    agent: SagaAgent[Any, Any]
    deps: Any
    last_response: _messages.ModelResponse | None = None


current: ContextVar[PydanticRun | None] = ContextVar("sagaloop_agent_run", default=None)
"""The agent run saga code is in (None: not inside ``SagaAgent.run`` in a saga)."""

TOOL_SIGNALS = (ModelRetry, ApprovalRequired, CallDeferred)
"""What a tool raises to talk to the agent run; the worker returns it as a value."""


def signal_of(e: ModelRetry | ApprovalRequired | CallDeferred) -> dict[str, Any]:
    """One of :data:`TOOL_SIGNALS` as the tool step's result."""
    if isinstance(e, ModelRetry):
        return {"retry": e.message}
    if isinstance(e, ApprovalRequired):
        return {"approval": {"metadata": jsonable(e.metadata, "approval metadata")}}
    return {"deferred": {"metadata": jsonable(e.metadata, "deferral metadata")}}


_CONTEXT_DEFAULTS: dict[str, Any] = {
    "metadata": None,
    "retries": {},
    "tool_call_approved": False,
    "tool_call_metadata": None,
    "retry": 0,
    "partial_output": False,
    "trace_include_content": False,
    "usage": {},
    "usage_limits": {},
    "deadline": None,
    "loaded_capability_ids": [],
    "discovered_tool_names": [],
    "_anchored_evidence": {"discovered_tool_names": [], "loaded_capability_ids": []},
    "available_tool_names": [],
    "_tool_names_by_kind": {},
    "active_capability_ids": [],
    "_deferred_capability_ids": [],
    "capability_active": None,
}
"""The values a tool call's run context leaves out when it has them (:func:`compact_context`),
and the worker puts back (:func:`run_context`)."""

_EMPTY: tuple[Any, ...] = (None, 0, 0.0, {})
"""Inside ``usage``: the values a count has when nothing was counted (RunUsage's defaults)."""


def compact_context(context: dict[str, Any]) -> dict[str, Any]:
    """A tool call's run context (as JSON) as its step's argument stores it: without the
    entries that hold their default (:data:`_CONTEXT_DEFAULTS`), ``usage`` without its zero
    counts, ``usage_limits`` without its unset limits (None), ``conversation_id`` left out when
    it is the ``run_id``. :func:`run_context` rebuilds the same context: about 300 bytes per
    call instead of 1.3 KB. A context stored whole (by an earlier version) is read as it is."""
    out: dict[str, Any] = {}
    for key, value in context.items():
        if key in _CONTEXT_DEFAULTS and value == _CONTEXT_DEFAULTS[key]:
            continue
        if key == "conversation_id" and value == context.get("run_id"):
            continue
        if key == "usage" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if not any(v == e for e in _EMPTY)}
        elif key == "usage_limits" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None and v is not False}
        if key in ("usage", "usage_limits") and not value:
            continue
        out[key] = value
    return out


def run_context(deps_type: Any, call: Mapping[str, Any]) -> RunContext[Any]:
    """On the worker: the run context a tool step was called with, its deps rebuilt, the
    entries :func:`compact_context` left out put back."""
    deps_json = call.get("deps")
    deps = None if deps_json is None else pydantic.TypeAdapter(deps_type).validate_python(deps_json)
    context = dict(call.get("context") or {})
    for key, default in _CONTEXT_DEFAULTS.items():
        context.setdefault(key, copy.deepcopy(default))
    context.setdefault("conversation_id", context.get("run_id"))
    return DurableRunContext.deserialize_run_context(context, deps)


async def ask_person(
    run: PydanticRun, tool: str, args: Any, toolset_tool: ToolsetTool[Any] | None = None
) -> Approval:
    """A person's answer to a call of ``tool`` (the model's text of its last response as the
    reasoning; the tool's arguments' schema, which an edit must fit)."""
    reasoning = None
    if run.last_response is not None:
        texts = [
            p.content
            for p in run.last_response.parts
            if isinstance(p, _messages.TextPart | _messages.ThinkingPart) and p.content
        ]
        reasoning = "\n".join(texts) or None
    agent = run.agent
    return await ask(
        run.saga,
        tool,
        args,
        agent.policies.get(tool, ToolPolicy()),
        timeout=agent.approval_timeout,
        on_timeout=agent.on_approval_timeout,
        reasoning=reasoning,
        schema=None if toolset_tool is None else toolset_tool.tool_def.parameters_json_schema,
    )


@dataclasses.dataclass
class BudgetGate(WrapperToolset[Any]):
    """Answers each call of a batch the budget refused with the refusal (none of them runs);
    every tool kind passes here, function, step and MCP tools alike."""

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        run = current.get()
        if run is not None and run.refusal is not None:
            return run.refusal
        return await super().call_tool(name, tool_args, ctx, tool)


@dataclasses.dataclass
class SagaToolset(WrapperToolset[Any]):
    """The agent's tools as the saga sees them: each call is a step; a tool that needs approval
    is offered to the model as a plain tool and asks a person inside the run."""

    agent: SagaAgent[Any, Any] = dataclasses.field(kw_only=True)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = await super().get_tools(ctx)
        if current.get() is None:
            return tools
        out = {}
        for name, tool in tools.items():
            if tool.tool_def.kind == "unapproved":
                tool = dataclasses.replace(
                    tool, tool_def=dataclasses.replace(tool.tool_def, kind="function")
                )
            out[name] = tool
        return out

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        run = current.get()
        if run is None:
            return await super().call_tool(name, tool_args, ctx, tool)
        agent = self.agent
        if name in agent.saga_tools:  # a child run, started by the tool in saga code
            if agent.needs_approval.get(name) and not ctx.tool_call_approved:
                decision = await ask_person(run, name, tool_args, tool)
                if not decision.approved:
                    return denial(decision.reason)
                tool_args = decision.args
            charge_tool_calls(run.saga, 1, run.conversation)
            return await super().call_tool(name, tool_args, ctx, tool)
        step_name = agent.tool_steps.get(name)
        if step_name is None:
            raise UserError(
                f"tool {name!r} of agent {agent.saga_name!r} has no step: declare tools before "
                "wrapping the agent in SagaAgent (its steps are registered then)"
            )
        step = agent.app.get_step(step_name)
        assert step is not None
        args = jsonable(tool_args, f"the arguments of tool {name!r}")
        approved = bool(ctx.tool_call_approved)
        if agent.needs_approval.get(name) and not approved and not step.approval:
            decision = await ask_person(run, name, args, tool)
            if not decision.approved:
                return denial(decision.reason)
            args, approved = decision.args, True
        charge_tool_calls(run.saga, 1, run.conversation)
        if name in agent.step_tools:
            try:
                result = await run.saga.call(step, **args)
                run.encoder.received(result)
                return result
            except ApprovalDenied as e:  # the step itself asks (``@app.step(approval=True)``)
                return denial(e.reason)
        context = DurableRunContext.serialize_run_context(ctx)
        context["tool_call_approved"] = approved
        # the context as JSON; what is not JSON (a policy's functions in the tool's metadata)
        # stays behind: the worker has the tool, and with it its metadata
        context = pydantic_core.to_jsonable_python(context, fallback=lambda _: None)
        call = {"args": args, "deps": run.deps, "context": compact_context(context)}
        while True:
            reply = await run.saga.call(step, call)
            run.encoder.received(reply)
            if "value" in reply:
                return reply["value"]
            if "retry" in reply:
                raise ModelRetry(str(reply["retry"]))
            if "deferred" in reply:
                raise CallDeferred(reply["deferred"].get("metadata"))
            if "approval" in reply and not approved:  # the tool asked for it, at run time
                decision = await ask_person(run, name, args, tool)
                if not decision.approved:
                    return denial(decision.reason)
                call = {**call, "args": decision.args}
                call["context"] = {**call["context"], "tool_call_approved": True}
                approved = True
                continue
            raise UserError(f"tool {name!r} answered {reply!r}")
