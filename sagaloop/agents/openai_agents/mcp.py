"""A :class:`~sagaloop.agents.openai_agents.SagaRunner` agent's MCP servers: each server's
steps ``agent__{agent}__mcp__{server}__list_tools`` and ``...__call_tool`` (the worker side,
which connects to the real server in each step) and :class:`StepMCPServer`, the server as saga
code sees it (listing and calling its tools are those steps)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

from agents.exceptions import UserError
from agents.mcp import MCPServer
from mcp.types import CallToolResult, TextContent
from mcp.types import Tool as MCPTool

from sagaloop import tracing
from sagaloop.agents._core import ToolPolicy, charge_tool_calls, server_steps, step_part
from sagaloop.agents.openai_agents.run import in_run
from sagaloop.sagas.app import App, StepDef
from sagaloop.sagas.context import StepContext

SERVER_KEY = "mcp:"
"""``SagaRunner(tools={"mcp:{name}": ToolPolicy(...)})``: the policy of MCP server ``name``'s
steps."""


def declare(
    app: App, prefix: str, server: MCPServer, policy: ToolPolicy, tool_queue: str
) -> tuple[StepDef[Any, Any], StepDef[Any, Any]]:
    """Register the two steps of ``server`` (an MCP server of the agent whose steps are named
    ``{prefix}__...``) on ``app``, with the server's ``policy``."""
    # one step at a time per server in this process (each async step runs on an event loop
    # of its own)
    lock = threading.Lock()

    async def on_server(act: Callable[[MCPServer], Awaitable[Any]]) -> Any:
        """``act(server)`` with the server connected."""
        with lock:
            await server.connect()  # type: ignore[no-untyped-call]
            try:
                return await act(server)
            finally:
                await server.cleanup()  # type: ignore[no-untyped-call]

    async def list_tools(ctx: StepContext, _: dict[str, Any]) -> list[Any]:
        tools = await on_server(lambda s: s.list_tools())
        return [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tools]

    async def call_tool(ctx: StepContext, call: dict[str, Any]) -> Any:
        tracing.tool_call(str(call["tool"]))  # on the step's span: gen_ai.tool.name
        result = await on_server(
            lambda s: s.call_tool(call["tool"], call.get("args"), call.get("meta"))
        )
        return result.model_dump(mode="json", by_alias=True, exclude_none=True)

    return server_steps(
        app,
        f"{prefix}__mcp__{step_part(server.name)}",
        policy,
        policy.queue or tool_queue,
        ("list_tools", list_tools),
        call_tool,
    )


class StepMCPServer(MCPServer):
    """An MCP server as saga code sees it: listing and calling its tools are steps."""

    def __init__(
        self, server: MCPServer, steps: tuple[StepDef[Any, Any], StepDef[Any, Any]]
    ) -> None:
        super().__init__(
            use_structured_content=server.use_structured_content,
            failure_error_function=server._failure_error_function,
            tool_input_guardrails=server.tool_input_guardrails,
            tool_output_guardrails=server.tool_output_guardrails,
        )
        # the server's approval policy, as the SDK normalised it: its tools ask a person
        self._needs_approval_policy = server._needs_approval_policy
        self._name = server.name
        self._list_tools, self._call_tool = steps

    @property
    def name(self) -> str:
        return self._name

    async def connect(self) -> None:
        """The worker connects, in each step."""

    async def cleanup(self) -> None:
        """The worker disconnects, in each step."""

    async def list_tools(self, run_context: Any = None, agent: Any = None) -> list[MCPTool]:
        run = in_run("an MCP server")
        listed = await run.saga.call(self._list_tools, {})
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
        reply = await run.saga.call(self._call_tool, call)
        run.encoder.received(reply)
        return CallToolResult.model_validate(reply)

    async def list_prompts(self) -> Any:
        raise UserError("MCP prompts are not served to an agent in a saga (only tools are)")

    async def get_prompt(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        raise UserError("MCP prompts are not served to an agent in a saga (only tools are)")
