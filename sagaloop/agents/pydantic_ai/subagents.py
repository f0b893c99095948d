"""Agents as tools for Pydantic AI: :func:`saga_as_tool` (a saga run as a child run of the
supervisor's run) and the saga behind :meth:`SagaAgent.as_tool
<sagaloop.agents.pydantic_ai.SagaAgent.as_tool>` (see :mod:`sagaloop.agents.subagents`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic_ai.tools import Tool

from sagaloop.agents._core import jsonable
from sagaloop.agents.subagents import Failures, SagaTool, saga_tool
from sagaloop.sagas.app import SagaDef
from sagaloop.sagas.context import SagaContext

if TYPE_CHECKING:
    from sagaloop.agents.pydantic_ai.agent import SagaAgent

METADATA_KEY = "sagaloop"


def saga_as_tool(
    saga: SagaDef[Any, Any],
    *,
    name: str | None = None,
    description: str | None = None,
    requires_approval: bool = False,
    failures: Failures = "raise",
) -> Tool[Any]:
    """A Pydantic AI tool that runs ``saga`` (declared with ``@app.saga``) as a child run of
    the saga run whose :class:`SagaAgent` calls it, and answers the model with the child's
    output. Its arguments are the saga's input (see :mod:`sagaloop.agents.subagents`);
    ``failures="return"`` tells the model about a child that failed instead of failing the
    run. Only an agent run in saga code can call it."""
    spec = saga_tool(saga, name=name, description=description, failures=failures)
    return _tool(spec, requires_approval)


def _tool(spec: SagaTool, requires_approval: bool) -> Tool[Any]:
    async def call(**kwargs: Any) -> Any:
        return await spec.call(kwargs)

    call.__name__ = spec.name
    tool: Tool[Any] = Tool.from_schema(
        call, name=spec.name, description=spec.description, json_schema=spec.parameters
    )
    tool.requires_approval = requires_approval
    tool.metadata = {METADATA_KEY: {"saga": spec.saga.name}}
    return tool


def declare_agent_saga(agent: SagaAgent[Any, Any], name: str) -> SagaDef[Any, Any]:
    """The saga ``name`` that runs ``agent`` on a prompt and returns its output as JSON (the
    child run of :meth:`SagaAgent.as_tool`)."""

    async def run_agent(ctx: SagaContext, prompt: str) -> Any:
        result = await agent.run(prompt)
        return jsonable(result.output, f"the output of agent {agent.saga_name!r}")

    run_agent.__doc__ = f"Runs the agent {agent.saga_name!r} on a prompt."
    saga: SagaDef[Any, Any] = agent.app.saga(name=name)(run_agent)
    return saga
