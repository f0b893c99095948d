"""MCP servers of a :class:`~sagaloop.agents.pydantic_ai.SagaAgent`: listing and calling their
tools are steps.

For each ``pydantic_ai.mcp.MCPToolset`` among the agent's toolsets (it needs an explicit ``id=``,
which names its steps), ``SagaAgent`` registers:

- ``agent__{name}__mcp__{id}__get_tools``: lists the server's tools, recorded as tool definitions;
- ``agent__{name}__mcp__{id}__call_tool``: calls one of its tools, recorded as the tool's result;
- ``agent__{name}__mcp__{id}__call_tool__{tool}`` for a tool named in ``SagaAgent(tools={...})``:
  that tool's calls, with its :class:`~sagaloop.agents.pydantic_ai.ToolPolicy` (queue, retry,
  timeout, idempotent, reconcile, compensation; ``requires_approval`` asks a person first). A
  server's tools are only known once it is asked, so with MCP servers every name in ``tools=``
  that is not a function tool is taken as an MCP tool's (one step on each server).

``tools={"mcp:{id}": ToolPolicy(...)}`` sets the queue, retry and timeout of a server's steps (and
``idempotent`` of its ``call_tool``); the queue is the agent's ``tool_queue`` otherwise. Each step
opens the server's session in its body and closes it at the end: saga code never talks to the
server. The step names are listed in ``SagaAgent.step_names`` (through ``tool_steps``, under keys
``mcp:{id}:get_tools``, ``mcp:{id}:call_tool`` and ``mcp:{id}:call_tool:{tool}``).

In saga code the server is replaced by :class:`SagaMCPToolset`, which answers from these steps
(recorded, so replays and restarts do not ask again); outside saga code the agent uses the server
as usual.

``pydantic_ai.mcp`` is not imported here: an agent can only hold an ``MCPToolset`` once its
module is loaded, so one that is not loaded means no MCP server (and no ``fastmcp`` import).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pydantic
import pydantic_core
from pydantic_ai import messages as _messages
from pydantic_ai.durable_exec import DurableRunContext
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry, ToolFailed, UserError
from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, CombinedToolset
from pydantic_ai.toolsets.abstract import ToolsetTool

from sagaloop import tracing
from sagaloop.agents._core import (
    ToolPolicy,
    denial,
    jsonable,
    server_steps,
    step_part,
    tool_step,
    usage_of,
)
from sagaloop.agents.pydantic_ai.run import (
    TOOL_SIGNALS,
    SagaToolset,
    ask_person,
    compact_context,
    current,
    run_context,
    signal_of,
)
from sagaloop.errors import ValidationError
from sagaloop.sagas.app import StepDef
from sagaloop.sagas.context import StepContext

if TYPE_CHECKING:
    from pydantic_ai.mcp import MCPToolset

    from sagaloop.agents.pydantic_ai.agent import SagaAgent

SERVER_KEY = "mcp:"
"""``SagaAgent(tools={"mcp:{id}": ToolPolicy(...)})``: the policy of MCP server ``id``'s steps."""

_TOOL_DEF: pydantic.TypeAdapter[ToolDefinition] = pydantic.TypeAdapter(ToolDefinition)
# a tool's result as the model gets it: text, JSON, images and files (BinaryContent) come back
# as themselves from the recorded JSON
_CONTENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(_messages.ToolReturnContent)
_TOOL_RETURN: pydantic.TypeAdapter[_messages.ToolReturn[Any]] = pydantic.TypeAdapter(
    _messages.ToolReturn
)


@dataclasses.dataclass(eq=False)
class MCPServerSteps:
    """One MCP server of a ``SagaAgent`` and the steps that talk to it."""

    id: str
    toolset: MCPToolset[Any]
    policies: dict[str, ToolPolicy]
    get_tools: StepDef[Any, Any] = dataclasses.field(init=False)
    call_tool: StepDef[Any, Any] = dataclasses.field(init=False)
    tool_steps: dict[str, StepDef[Any, Any]] = dataclasses.field(init=False)
    """The steps of the tools named in ``SagaAgent(tools=...)``, by tool name."""
    # The steps of one worker process share the server's client, and each async step runs on an
    # event loop of its own: one at a time, so no session is used from two loops.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _mcp_servers(toolsets: Sequence[AbstractToolset[Any]]) -> list[MCPToolset[Any]]:
    module = sys.modules.get("pydantic_ai.mcp")
    if module is None:
        return []
    cls = module.MCPToolset
    found: list[MCPToolset[Any]] = []

    def visit(toolset: AbstractToolset[Any]) -> None:
        if isinstance(toolset, cls) and not any(toolset is f for f in found):
            found.append(toolset)

    for toolset in toolsets:
        toolset.apply(visit)
    return found


def declare(agent: SagaAgent[Any, Any], given: dict[str, ToolPolicy]) -> list[MCPServerSteps]:
    """Register the steps of the agent's MCP servers on its app. Takes the policies of ``given``
    that belong to them (``mcp:{id}`` and, when the agent has an MCP server, every tool name left
    in ``given``: an MCP server's tools are only known once it is asked)."""
    servers = _mcp_servers(agent.wrapped.toolsets)
    if not servers:
        return []
    named: dict[str, MCPToolset[Any]] = {}
    for toolset in servers:
        # only an id given by the user: one derived from the server's URL would rename the
        # steps when the URL changes
        toolset_id: str | None = getattr(toolset, "_explicit_id", toolset.id)
        if not toolset_id:
            raise ValidationError(
                f"the MCP server {toolset!r} of agent {agent.saga_name!r} has no id: pass "
                "MCPToolset(..., id='...'); the id names its steps, so keep it stable while runs "
                "are in flight"
            )
        if toolset_id in named:
            raise ValidationError(
                f"two MCP servers of agent {agent.saga_name!r} have the id {toolset_id!r}: "
                "give each its own MCPToolset(..., id='...')"
            )
        if toolset.include_instructions:
            raise ValidationError(
                f"MCP server {toolset_id!r} of agent {agent.saga_name!r} has "
                "include_instructions=True, which SagaAgent does not support yet: pass "
                "include_instructions=False and put what the model needs in the agent's "
                "instructions"
            )
        named[toolset_id] = toolset
    server_policies = {
        i: given.pop(f"{SERVER_KEY}{i}") if f"{SERVER_KEY}{i}" in given else ToolPolicy()
        for i in named
    }
    tool_policies = {n: p for n, p in given.items() if not n.startswith(SERVER_KEY)}
    for name, policy in tool_policies.items():
        del given[name]
        agent.policies.setdefault(name, policy)  # read when it asks for an approval
    out = []
    for toolset_id, toolset in named.items():
        server = _declare_server(
            agent, toolset, toolset_id, server_policies[toolset_id], tool_policies
        )
        # listed in SagaAgent.step_names; the colons keep these keys apart from tool names
        key = f"{SERVER_KEY}{toolset_id}"
        agent.tool_steps[f"{key}:get_tools"] = server.get_tools.name
        agent.tool_steps[f"{key}:call_tool"] = server.call_tool.name
        for tool_name, step in server.tool_steps.items():
            agent.tool_steps[f"{key}:call_tool:{tool_name}"] = step.name
        out.append(server)
    return out


def _declare_server(
    agent: SagaAgent[Any, Any],
    toolset: MCPToolset[Any],
    toolset_id: str,
    policy: ToolPolicy,
    tool_policies: Mapping[str, ToolPolicy],
) -> MCPServerSteps:
    prefix = f"{agent.prefix}__mcp__{step_part(toolset_id)}"
    policy = agent._placed(policy)
    queue = policy.queue or agent.tool_queue
    server = MCPServerSteps(id=toolset_id, toolset=toolset, policies=dict(tool_policies))

    async def get_tools(ctx: StepContext, call: dict[str, Any]) -> dict[str, Any]:
        run_ctx = run_context(agent.wrapped.deps_type, call)
        async with _session(server, run_ctx) as session:
            tools = await session.get_tools(run_ctx)
        return {
            "tools": {
                name: _TOOL_DEF.dump_python(tool.tool_def, mode="json", fallback=lambda _: None)
                for name, tool in tools.items()
            }
        }

    async def call_tool(ctx: StepContext, call: dict[str, Any]) -> dict[str, Any]:
        run_ctx = run_context(agent.wrapped.deps_type, call)
        tool_def = _TOOL_DEF.validate_python(call["tool_def"])
        name = str(call["name"])
        tracing.tool_call(name)  # on the step's span: gen_ai.tool.name
        async with _session(server, run_ctx) as session:
            tool = session.tool_for_tool_def(tool_def, ctx=run_ctx)
            try:
                value = await session.call_tool(name, dict(call.get("args") or {}), run_ctx, tool)
            except ToolFailed as e:
                return {"failed": e.message}
            except TOOL_SIGNALS as e:
                return signal_of(e)
        return _encode(value, name)

    server.get_tools, server.call_tool = server_steps(
        agent.app, prefix, policy, queue, ("get_tools", get_tools), call_tool
    )
    server.tool_steps = {
        # the server's policy is the default of its tools'
        tool_name: tool_step(
            agent.app,
            f"{prefix}__call_tool__{step_part(tool_name)}",
            dataclasses.replace(
                p,
                retry=p.retry or policy.retry,
                timeout=p.timeout or policy.timeout,
                rate_limit=p.rate_limit or policy.rate_limit,
                rate_key=p.rate_key or policy.rate_key,
                local=policy.local if p.local is None else p.local,
            ),
            p.queue or queue,
        )(call_tool)
        for tool_name, p in tool_policies.items()
    }
    return server


# --- the worker side ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _session(server: MCPServerSteps, ctx: RunContext[Any]) -> Any:
    """The server entered for one step (its session opened here, closed at the end)."""
    toolset = await server.toolset.for_run(ctx)  # a copy when auth or headers come from the run
    with server.lock if toolset is server.toolset else contextlib.nullcontext():
        async with toolset:
            yield toolset


def _encode(value: Any, name: str) -> dict[str, Any]:
    try:
        if isinstance(value, _messages.ToolReturn):
            return {"tool_return": _TOOL_RETURN.dump_python(value, mode="json")}
        return {"value": _CONTENT.dump_python(value, mode="json")}
    except pydantic_core.PydanticSerializationError as e:
        raise ValidationError(
            f"the result of MCP tool {name!r} cannot be stored as JSON: {e}"
        ) from e


# --- the saga side -----------------------------------------------------------------------------


def _context_json(ctx: RunContext[Any]) -> Any:
    context = DurableRunContext.serialize_run_context(ctx)
    # what is not JSON stays behind, as for function tools
    return compact_context(pydantic_core.to_jsonable_python(context, fallback=lambda _: None))


class SagaMCPToolset(AbstractToolset[Any]):
    """An MCP server as saga code sees it: its tools come from the ``get_tools`` step, their
    calls are ``call_tool`` steps. It opens nothing (entering it is a no-op); one is built per
    agent run, and keeps the listing for that run when the server caches its tools."""

    def __init__(self, server: MCPServerSteps, agent: SagaAgent[Any, Any]) -> None:
        self.server = server
        self.agent = agent
        self._tools: dict[str, ToolDefinition] | None = None

    @property
    def id(self) -> str | None:
        return self.server.id

    @property
    def label(self) -> str:
        return f"MCP server {self.server.id!r} (in a saga)"

    @property
    def tool_name_conflict_hint(self) -> str:
        return self.server.toolset.tool_name_conflict_hint

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        run = current.get()
        if run is None:  # only built for a run in a saga
            raise UserError(f"{self.label} was used outside SagaAgent.run in a saga")
        defs = self._tools
        if defs is None:
            call = {"context": _context_json(ctx), "deps": run.deps}
            reply = await run.saga.call(self.server.get_tools, call)
            defs = {n: _TOOL_DEF.validate_python(d) for n, d in reply["tools"].items()}
            if self.server.toolset.cache_tools:
                self._tools = defs
        toolset = self.server.toolset
        return {
            # the server's own tool (its argument validator, its retries), listed by this toolset
            name: dataclasses.replace(toolset.tool_for_tool_def(tool_def, ctx=ctx), toolset=self)
            for name, tool_def in defs.items()
        }

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        run = current.get()
        if run is None:
            raise UserError(f"{self.label} was used outside SagaAgent.run in a saga")
        args = jsonable(tool_args, f"the arguments of MCP tool {name!r}")
        approved = bool(ctx.tool_call_approved)
        policy = self.server.policies.get(name)
        if policy is not None and policy.requires_approval and not approved:
            decision = await ask_person(run, name, args, tool)
            if not decision.approved:
                return denial(decision.reason)
            args, approved = decision.args, True
        usage_of(run.saga).usage.tool_calls += 1
        context = _context_json(ctx)
        context["tool_call_approved"] = approved
        call = {
            "name": name,
            "args": args,
            "tool_def": _TOOL_DEF.dump_python(tool.tool_def, mode="json", fallback=lambda _: None),
            "deps": run.deps,
            "context": context,
        }
        reply = await run.saga.call(self.server.tool_steps.get(name, self.server.call_tool), call)
        run.encoder.received(reply)
        if "value" in reply:
            return _CONTENT.validate_python(reply["value"])
        if "tool_return" in reply:
            return _TOOL_RETURN.validate_python(reply["tool_return"])
        if "retry" in reply:
            raise ModelRetry(str(reply["retry"]))
        if "failed" in reply:
            raise ToolFailed(str(reply["failed"]))
        if "deferred" in reply:
            raise CallDeferred(reply["deferred"].get("metadata"))
        if "approval" in reply:
            raise ApprovalRequired(reply["approval"].get("metadata"))
        raise UserError(f"MCP tool {name!r} answered {reply!r}")


@dataclasses.dataclass
class SagaToolsetWithMCP(SagaToolset):
    """The agent's tools in a saga when it has MCP servers: their tools go to their own
    toolset (whose calls are already steps), the others are steps as usual. A call that needs
    an approval (``server.approval_required()``, or the server's answer) pauses the run for a
    person, as a function tool's does."""

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        if not isinstance(tool.toolset, SagaMCPToolset):
            return await super().call_tool(name, tool_args, ctx, tool)
        try:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        except ApprovalRequired:
            run = current.get()
            if run is None or ctx.tool_call_approved:
                raise
        args = jsonable(tool_args, f"the arguments of MCP tool {name!r}")
        decision = await ask_person(run, name, args, tool)
        if not decision.approved:
            return denial(decision.reason)
        ctx = dataclasses.replace(ctx, tool_call_approved=True)
        return await self.wrapped.call_tool(name, decision.args, ctx, tool)


def saga_toolset(agent: SagaAgent[Any, Any], toolsets: CombinedToolset[Any]) -> SagaToolset:
    """The agent's toolsets as saga code uses them, each MCP server replaced by its steps."""
    servers: list[MCPServerSteps] = agent.mcp_servers
    if not servers:
        return SagaToolset(toolsets, agent=agent)

    def swap(toolset: AbstractToolset[Any]) -> AbstractToolset[Any]:
        for server in servers:
            if toolset is server.toolset:
                return SagaMCPToolset(server, agent)
        return toolset

    return SagaToolsetWithMCP(toolsets.visit_and_replace(swap), agent=agent)
