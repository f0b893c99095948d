"""Pydantic AI models and limits as the saga side of :class:`SagaAgent` sees them."""

from __future__ import annotations

import logging
from typing import Any

from pydantic_ai import messages as _messages
from pydantic_ai.exceptions import UserError
from pydantic_ai.models import Model, infer_model
from pydantic_ai.usage import UsageLimits

from sagaloop.agents.budgets import Budget

logger = logging.getLogger("sagaloop.agents.pydantic_ai")


def lifted_request_limit(given: UsageLimits | None, budget: Budget | None) -> UsageLimits | None:
    """The ``usage_limits`` of an agent run in a saga. Pydantic AI caps a run it is given none
    for at 50 requests (``UsageLimits()``), failing longer loops with ``UsageLimitExceeded``;
    when the run's :class:`Budget` limits ``requests``, that limit is the one that holds
    (with its ``on_exceed``), so the framework's default is lifted. Limits the caller gave
    are kept as they are; without a request budget, the framework's default stays."""
    if given is not None or budget is None or budget.requests is None:
        return given
    return UsageLimits(request_limit=None)


class _NamedModel(Model):
    """Stands for a model the engine cannot build (its provider's package or key is only on
    the workers): the saga side needs its name, never its requests."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._system, _, self._name = name.rpartition(":")

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def system(self) -> str:
        return self._system or "unknown"

    async def request(self, *args: Any, **kwargs: Any) -> _messages.ModelResponse:
        raise UserError("this model only runs on the workers, as a step")


def profile_model(model: Model | str) -> Model:
    """The model as the engine shapes requests for it: the real one when it can be built here
    (its profile, settings and request preparation), else one that only knows its name (with
    the default profile: build the model in the engine too when a provider needs its own)."""
    if isinstance(model, Model):
        return model
    try:
        return infer_model(model)
    except Exception as e:  # the provider's package or its API key is missing here
        logger.info("the engine uses a default profile for model %s: %s", model, e)
        return _NamedModel(model)
