"""OpenAI Agents SDK agents that run as a saga: :class:`SagaRunner`.

Built on the SDK's public extension points (``Model``, ``FunctionTool``, ``Handoff``,
``MCPServer``, ``Agent.clone``, ``RunResult.to_state``), no monkey-patching::

    runner = SagaRunner(app, triage_agent)  # where the app's steps are declared

    @app.saga(name="triage")
    async def triage(ctx: SagaContext, ticket: str) -> str:
        result = await runner.run(triage_agent, ticket, max_turns=20)
        return result.final_output

- every model call is the step ``agent__{agent}__model_request``: the worker runs the real model
  (the agent's ``Model`` instance, or its model name through ``model_provider``); the response
  and its usage are recorded, never paid again on replay. The request records only the input
  items new since the previous request of the same run (:mod:`sagaloop.agents.transcript`);
- every function tool is its own step ``agent__{agent}__tool__{tool}``, with its
  :class:`~sagaloop.agents.ToolPolicy` (``SagaRunner(tools={name: ToolPolicy(...)})``): the SDK
  would run tools in the saga's process, and a replay would run their effects again.
  :func:`step_as_function_tool` hands an existing ``@app.step`` to the model;
- agents as tools: :func:`saga_as_function_tool` (a saga) and
  :meth:`SagaRunner.agent_as_tool` (an agent of a runner) run as a CHILD RUN of the calling
  run, started in saga code (:mod:`sagaloop.agents.subagents`);
- a tool that needs approval (``needs_approval``, an MCP server's ``require_approval``, or
  ``ToolPolicy(requires_approval=True)``) pauses the same saga run through ``ctx.approval``
  (``sagaloop approvals/approve/deny``); the SDK's run is resumed from its in-memory state;
- an agent's MCP servers are listed and called through the steps
  ``agent__{agent}__mcp__{server}__list_tools`` and ``...__call_tool``;
- handoffs move to the durable copy of the target agent; guardrails, instructions and hooks
  are saga code (they run again on every replay: keep them free of effects, or make the effect
  a step); ``max_turns`` and a :class:`~sagaloop.agents.Budget` bound the run;
- ``SagaRunner(stream=True)``: the worker streams the model's events to the run's live channel
  (``Client.stream``, ``sagaloop tail``); ``runner.run_streamed`` in saga code takes the same
  steps as ``runner.run`` and replays each recorded response as the SDK's stream events.

Outside saga code ``runner.run`` is the SDK's ``Runner.run``. Step names are compatibility data:
a run in flight resolves its steps by these names (tests pin them).

The package: ``runner`` (:class:`SagaRunner`, its declaration, durable clones and tools),
``model`` (the model step on both sides), ``replay`` (a recorded response as stream events, for
``run_streamed``), ``mcp`` (its MCP servers' steps), ``subagents`` (agents as tools, child runs)
and ``run`` (the saga side of one ``SagaRunner.run``); the model-call core and the options are
shared with :mod:`sagaloop.agents.pydantic_ai` (:mod:`sagaloop.agents.options`).
"""

try:
    import agents  # noqa: F401  (the OpenAI Agents SDK)
except ModuleNotFoundError as e:  # pragma: no cover - the extra is missing
    from sagaloop.extras import missing_extra

    raise missing_extra("SagaRunner", "openai-agents", e) from e

from sagaloop.agents.openai_agents.runner import SagaRunner, step_as_function_tool
from sagaloop.agents.openai_agents.subagents import saga_as_function_tool

__all__ = ["SagaRunner", "saga_as_function_tool", "step_as_function_tool"]
