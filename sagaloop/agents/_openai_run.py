"""The saga side of one :class:`~sagaloop.agents.openai_agents.SagaRunner` run, shared by the
runner and its model (:mod:`sagaloop.agents._openai_model`): the run's state, the agents' MCP
servers as saga code sees them (listing and calling their tools are steps), and the approval
gate that lets a call the budget refused through unasked."""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from agents.exceptions import UserError
from agents.mcp import MCPServer
from mcp.types import CallToolResult, TextContent
from mcp.types import Tool as MCPTool

from sagaloop.agents._core import charge_tool_calls
from sagaloop.agents._model_call import AgentRun

if TYPE_CHECKING:
    from sagaloop.agents.openai_agents import SagaRunner


@dataclasses.dataclass(kw_only=True)
class OpenAIRun(AgentRun):
    """The saga side of one ``SagaRunner.run``."""

    runner: SagaRunner
    context: Any
    model: str | None
    last_text: str | None = None
    edits: dict[str, str] = dataclasses.field(default_factory=dict)
    """Arguments an approver edited, by tool call id."""


current: ContextVar[OpenAIRun | None] = ContextVar("sagaloop_openai_agents_run", default=None)


def in_run(what: str) -> OpenAIRun:
    run = current.get()
    if run is None:
        raise UserError(f"{what} of a SagaRunner's agent runs only inside SagaRunner.run")
    return run


def unless_refused(needs: Any) -> Any:
    """A tool's ``needs_approval`` that asks nobody about a call whose batch the budget
    refused (the call answers with the refusal, and does not run)."""
    if needs is False:
        return False

    async def gated(ctx: Any, params: dict[str, Any], call_id: str) -> bool:
        run = current.get()
        if run is not None and run.refusal is not None:
            return False
        return bool(needs if isinstance(needs, bool) else await needs(ctx, params, call_id))

    return gated


class StepMCPServer(MCPServer):
    """An MCP server as saga code sees it: listing and calling its tools are steps."""

    def __init__(self, runner: SagaRunner, agent: str, server: MCPServer) -> None:
        super().__init__(
            use_structured_content=server.use_structured_content,
            failure_error_function=server._failure_error_function,
            tool_input_guardrails=server.tool_input_guardrails,
            tool_output_guardrails=server.tool_output_guardrails,
        )
        # the server's approval policy, as the SDK normalised it: its tools ask a person
        self._needs_approval_policy = server._needs_approval_policy
        self._runner = runner
        self._key = (agent, server.name)

    @property
    def name(self) -> str:
        return self._key[1]

    async def connect(self) -> None:
        """The worker connects, in each step."""

    async def cleanup(self) -> None:
        """The worker disconnects, in each step."""

    async def list_tools(self, run_context: Any = None, agent: Any = None) -> list[MCPTool]:
        run = in_run("an MCP server")
        listed = await run.saga.call(self._runner.mcp_steps[self._key][0], {})
        return [MCPTool.model_validate(t) for t in listed]

    async def call_tool(
        self, tool_name: str, arguments: dict[str, Any] | None, meta: dict[str, Any] | None = None
    ) -> CallToolResult:
        run = in_run("an MCP server")
        if run.refusal is not None:
            return CallToolResult(
                content=[TextContent(type="text", text=run.refusal)], isError=True
            )
        charge_tool_calls(run.saga, 1, run.conversation)
        call = {"tool": tool_name, "args": arguments or {}, "meta": meta}
        reply = await run.saga.call(self._runner.mcp_steps[self._key][1], call)
        return CallToolResult.model_validate(reply)

    async def list_prompts(self) -> Any:
        raise UserError("MCP prompts are not served to an agent in a saga (only tools are)")

    async def get_prompt(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        raise UserError("MCP prompts are not served to an agent in a saga (only tools are)")
