"""Durable agents: framework adapters on top of sagas (optional extras).

- :mod:`sagaloop.agents.pydantic_ai` (the ``pydantic-ai`` extra): ``SagaAgent``.
- :mod:`sagaloop.agents.openai_agents` (the ``openai-agents`` extra): ``SagaRunner``.
- :mod:`sagaloop.agents.tools`: ``StepTools``, steps as tools for a tool-calling loop written
  without a framework (OpenAI and Anthropic formats; no extra needed).

Framework-neutral parts: a tool's policy (:class:`ToolPolicy`), budgets
(:mod:`sagaloop.agents.budgets`), transcripts stored once (:mod:`sagaloop.agents.transcript`),
the options both adapters take (:mod:`sagaloop.agents.options`), the model request as a step
they share (``_model_call``) and sub-agents as tools that run as child runs
(:mod:`sagaloop.agents.subagents`).
Nothing in the core imports this package.
"""

from sagaloop.agents._core import ToolPolicy
from sagaloop.agents.budgets import USAGE_KEY, Budget, BudgetExceeded, Usage

__all__ = ["USAGE_KEY", "Budget", "BudgetExceeded", "ToolPolicy", "Usage"]
