"""A Pydantic AI agent that runs as a saga: `SagaAgent`.

Built only on Pydantic AI's public extension points (``WrapperAgent``, ``WrapperModel``,
``WrapperToolset``, ``Agent.override``, ``DurableRunContext``):

- every model request is the step ``agent__{name}__model_request``: the worker runs the real
  model; the response, its usage and its price are recorded, never paid again on replay. The
  request records only the transcript's new messages (:mod:`sagaloop.agents.transcript`);
- every function tool is its own step ``agent__{name}__tool__{tool}``, with its own policy
  (:class:`ToolPolicy`: queue, retry, timeout, idempotent, reconcile, compensation), and
  :func:`step_as_tool` hands an existing ``@app.step`` to the model. ``ModelRetry``,
  ``ApprovalRequired`` and ``CallDeferred`` raised by a tool cross the step as values;
- agents as tools: :func:`saga_as_tool` (a saga) and :meth:`SagaAgent.as_tool` (a sub-agent)
  run as a CHILD RUN of the supervisor's run, started in saga code
  (:mod:`sagaloop.agents.subagents`);
- a tool that needs approval pauses the same run (``ctx.approval``) instead of ending it;
- budgets are counted from the recorded usage (:mod:`sagaloop.agents.budgets`).

Outside saga code a ``SagaAgent`` is the plain agent. Step names are compatibility data: a run in
flight resolves its steps by these names (tests pin them).

The package: ``agent`` (:class:`SagaAgent`, its model and function tools), ``mcp`` (its MCP
servers' steps and toolsets), ``subagents`` (agents as tools, child runs), ``run`` (the saga
side of one agent run) and ``profiles`` (models and usage limits as the saga side sees them);
the model-call core and the options are shared with :mod:`sagaloop.agents.openai_agents`
(:mod:`sagaloop.agents.options`).
"""

try:
    import pydantic_ai  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - the extra is missing
    from sagaloop.extras import missing_extra

    raise missing_extra("SagaAgent", "pydantic-ai", e) from e

from sagaloop.agents._core import ToolPolicy
from sagaloop.agents.pydantic_ai.agent import METADATA_KEY, SagaAgent, step_as_tool
from sagaloop.agents.pydantic_ai.subagents import saga_as_tool

__all__ = ["METADATA_KEY", "SagaAgent", "ToolPolicy", "saga_as_tool", "step_as_tool"]
