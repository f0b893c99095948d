"""Durable agents: framework adapters on top of sagas (optional extras).

- :mod:`sagaloop.agents.pydantic_ai` (``pip install sagaloop[pydantic-ai]``): ``SagaAgent``.

Framework-neutral parts: budgets (:mod:`sagaloop.agents.budgets`) and transcripts stored once
(:mod:`sagaloop.agents.transcript`). Nothing in the core imports this package.
"""

from sagaloop.agents.budgets import USAGE_KEY, Budget, BudgetExceeded, Usage

__all__ = ["USAGE_KEY", "Budget", "BudgetExceeded", "Usage"]
