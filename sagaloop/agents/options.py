"""The options both framework adapters take, written once: ``SagaAgent(agent, app=app,
**options)`` (:mod:`sagaloop.agents.pydantic_ai`) and ``SagaRunner(app, *agents, **options)``
(:mod:`sagaloop.agents.openai_agents`). No agent framework is imported."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, TypedDict, cast

from sagaloop.agents._core import ToolPolicy, step_part, tool_step
from sagaloop.agents._model_call import ModelStepOptions
from sagaloop.agents.budgets import Budget
from sagaloop.sagas.app import App, StepDef
from sagaloop.sagas.policy import RetryPolicy

__all__ = ["AgentOptions", "DurableAdapter", "steps_prefix"]


class AgentOptions(TypedDict, total=False):
    """How an adapter's steps run and what bounds its agent runs (every key optional).

    - ``model_queue`` (``"model"``), ``model_retry`` (else
      :data:`~sagaloop.agents.providers.MODEL_RETRY`), ``model_timeout`` (10 minutes an
      attempt), ``model_rate_limit`` (``"10/s"``: how often model requests start across every
      worker) and ``model_rate_key`` (agents that call one provider share its quota): the model
      step (:class:`~sagaloop.agents._model_call.ModelStepOptions`);
    - ``tool_queue`` (``"tools"``) and ``tools`` (a :class:`~sagaloop.agents.ToolPolicy` by tool
      name, or ``"mcp:{server}"``): the tool steps;
    - ``budget``: bounds the agent runs of a saga run (a run's own ``budget=`` comes first);
    - ``approval_timeout`` and ``on_approval_timeout`` (``"deny"`` or ``"escalate"``): how long
      a tool that needs approval waits for a person;
    - ``stream``: the worker streams the model's events to the run's live channel;
    - ``local``: the model requests and the tools run as in-process steps
      (``@app.step(local=True)``): ``sagaloop engine`` runs them on its ``--concurrency``
      threads, with no worker and no broker hop (a tool's ``ToolPolicy(local=False)`` keeps it
      on its queue). For agents whose model calls are few and short next to the engine's
      threads: a request holds one of them while it waits for the model.
    """

    model_queue: str
    model_retry: RetryPolicy | None
    model_timeout: timedelta | None
    model_rate_limit: str | None
    model_rate_key: str | None
    tool_queue: str
    tools: Mapping[str, ToolPolicy] | None
    budget: Budget | None
    approval_timeout: timedelta | None
    on_approval_timeout: Literal["deny", "escalate"]
    stream: bool
    local: bool


_MODEL_STEP = {
    "model_queue": "queue",
    "model_retry": "retry",
    "model_timeout": "timeout",
    "model_rate_limit": "rate_limit",
    "model_rate_key": "rate_key",
    "local": "local",
}
"""The keys of :class:`AgentOptions` that are fields of :class:`ModelStepOptions`."""


class DurableAdapter:
    """What both adapters keep of their :class:`AgentOptions`."""

    app: App
    budget: Budget | None
    approval_timeout: timedelta | None
    on_approval_timeout: Literal["deny", "escalate"]
    stream: bool
    tool_queue: str
    local: bool
    model_options: ModelStepOptions

    def _take_options(self, app: App, options: AgentOptions) -> dict[str, ToolPolicy]:
        """Keep ``options`` (refusing a key that is not one); returns a copy of the given tool
        policies, which the adapter's declaration consumes."""
        given = cast(Mapping[str, Any], options)
        unknown = sorted(set(given) - set(AgentOptions.__annotations__))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r}"
            )
        self.app = app
        self.budget = options.get("budget")
        self.approval_timeout = options.get("approval_timeout")
        self.on_approval_timeout = options.get("on_approval_timeout", "deny")
        self.stream = options.get("stream", False)
        self.tool_queue = options.get("tool_queue", "tools")
        self.local = options.get("local", False)
        self.model_options = ModelStepOptions(
            **{field: given[key] for key, field in _MODEL_STEP.items() if key in given}
        )
        return dict(options.get("tools") or {})

    def _tool_step(
        self, prefix: str, tool_name: str, policy: ToolPolicy, run_tool: Callable[..., Any]
    ) -> StepDef[Any, Any]:
        """Register ``run_tool`` (the worker side of a function tool) as the step
        ``{prefix}__tool__{tool_name}``, with the tool's ``policy``, on its queue (else
        ``tool_queue``)."""
        name = f"{prefix}__tool__{step_part(tool_name)}"
        policy = self._placed(policy)
        return tool_step(self.app, name, policy, policy.queue or self.tool_queue)(run_tool)

    def _placed(self, policy: ToolPolicy) -> ToolPolicy:
        """``policy``, in-process or not as it says, else as the agent's ``local`` says."""
        return policy if policy.local is not None else dataclasses.replace(policy, local=self.local)


def steps_prefix(agent_name: str) -> str:
    """``agent__{agent_name}``: the start of the names of an agent's steps (compatibility data:
    a run in flight resolves its steps by these names)."""
    return f"agent__{step_part(agent_name)}"
