"""Agents as tools for the OpenAI Agents SDK: :func:`saga_as_function_tool` (a saga run as a
child run of the supervisor's run) and the saga behind :meth:`SagaRunner.agent_as_tool
<sagaloop.agents.openai_agents.SagaRunner.agent_as_tool>` (see
:mod:`sagaloop.agents.subagents`). The SDK's own ``Agent.as_tool`` would run the sub-agent
inside the tool, on a worker, as one step: its model calls would not be recorded one by one."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from agents import Agent
from agents.tool import FunctionTool
from agents.tool_context import ToolContext

from sagaloop.agents._core import charge_tool_calls, jsonable, step_part
from sagaloop.agents.openai_agents.run import tool_call, unless_refused
from sagaloop.agents.options import steps_prefix
from sagaloop.agents.subagents import Failures, saga_tool
from sagaloop.agents.tools import ToolCallError
from sagaloop.errors import ValidationError
from sagaloop.sagas.app import SagaDef
from sagaloop.sagas.context import SagaContext

if TYPE_CHECKING:
    from sagaloop.agents.openai_agents.runner import SagaRunner

SAGA_ATTR = "__sagaloop_saga__"
"""Set on a tool that runs a saga: the runner neither declares a step for it nor wraps it."""


def saga_as_function_tool(
    saga: SagaDef[Any, Any],
    *,
    name: str | None = None,
    description: str | None = None,
    needs_approval: bool = False,
    failures: Failures = "raise",
) -> FunctionTool:
    """An OpenAI Agents ``FunctionTool`` that runs ``saga`` (declared with ``@app.saga``) as a
    child run of the saga run whose :class:`SagaRunner` run calls it, and answers the model
    with the child's output (JSON text, or the text itself). Its arguments are the saga's
    input, in a strict JSON Schema (see :mod:`sagaloop.agents.subagents`); arguments that do
    not fit come back to the model as an error; ``failures="return"`` tells the model about a
    child that failed instead of failing the run. Only a run in saga code can call it."""
    spec = saga_tool(saga, name=name, description=description, strict=True, failures=failures)

    async def invoke(ctx: ToolContext[Any], arguments: str) -> Any:
        saga_ctx = spec.in_saga()
        run, arguments, refusal = tool_call(ctx.tool_call_id, arguments)
        if refusal is not None:
            return refusal
        try:
            spec.input_of(arguments)
        except ToolCallError as e:
            return f"Error: {e}"
        charge_tool_calls(saga_ctx, 1, "" if run is None else run.conversation)
        value = await spec.call(arguments)
        return value if isinstance(value, str) else json.dumps(value)

    tool = FunctionTool(
        name=spec.name,
        description=spec.description,
        params_json_schema=spec.parameters,
        on_invoke_tool=invoke,
        strict_json_schema=True,
        needs_approval=unless_refused(needs_approval),
    )
    setattr(tool, SAGA_ATTR, saga.name)
    return tool


def agent_tool(
    runner: SagaRunner,
    agent: Agent[Any] | None,
    *,
    name: str | None,
    description: str | None,
    needs_approval: bool,
    failures: Failures,
) -> FunctionTool:
    """:meth:`SagaRunner.agent_as_tool`."""
    agent = agent or next(iter(runner.agents.values()))
    if runner.agents.get(agent.name) is not agent:
        raise ValidationError(
            f"agent {agent.name!r} is not one of this SagaRunner's: name it in "
            "SagaRunner(app, ...) first"
        )
    saga = runner.as_tools.get(agent.name)
    if saga is None:
        saga = declare_agent_saga(runner, agent, f"{steps_prefix(agent.name)}__as_tool")
        runner.as_tools[agent.name] = saga
    return saga_as_function_tool(
        saga,
        name=name or step_part(agent.name),
        description=description
        or agent.handoff_description
        or f"Ask the agent {agent.name!r}: give it a prompt, get its answer.",
        needs_approval=needs_approval,
        failures=failures,
    )


def declare_agent_saga(runner: SagaRunner, agent: Agent[Any], name: str) -> SagaDef[Any, Any]:
    """The saga ``name`` that runs ``agent`` with ``runner`` on a prompt and returns its final
    output as JSON (the child run of :meth:`SagaRunner.agent_as_tool`)."""

    async def run_agent(ctx: SagaContext, prompt: str) -> Any:
        result = await runner.run(agent, prompt)
        return jsonable(result.final_output, f"the output of agent {agent.name!r}")

    run_agent.__doc__ = f"Runs the agent {agent.name!r} on a prompt."
    saga: SagaDef[Any, Any] = runner.app.saga(name=name)(run_agent)
    return saga
