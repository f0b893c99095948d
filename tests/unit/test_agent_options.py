"""Both adapters take the same options (``sagaloop.agents.options.AgentOptions``) and keep
them the same way; a key that is not an option is refused as Python refuses an unknown
keyword argument. Offline: the frameworks' test models."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from agents import Agent as OpenAIAgent
from agents.testing import ScriptedModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.test import TestModel

from sagaloop import App, RetryPolicy
from sagaloop.agents import Budget, ToolPolicy
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.agents.options import DurableAdapter
from sagaloop.agents.pydantic_ai import SagaAgent

OPTIONS: dict[str, Any] = {
    "model_queue": "llm",
    "tool_queue": "io",
    "model_retry": RetryPolicy(max_attempts=2),
    "model_timeout": timedelta(seconds=30),
    "model_rate_limit": "5/s",
    "model_rate_key": "provider",
    "budget": Budget(requests=3),
    "approval_timeout": timedelta(hours=1),
    "on_approval_timeout": "escalate",
    "stream": True,
    "local": True,
}


def pydantic_agent(**options: Any) -> SagaAgent[Any, Any]:
    return SagaAgent(PydanticAgent(TestModel(), name="helper"), app=App("opts"), **options)


def openai_runner(**options: Any) -> SagaRunner:
    return SagaRunner(App("opts"), OpenAIAgent("helper", model=ScriptedModel([])), **options)


ADAPTERS = [
    pytest.param(pydantic_agent, id="pydantic_ai"),
    pytest.param(openai_runner, id="openai"),
]


@pytest.mark.parametrize("make", ADAPTERS)
def test_both_adapters_keep_the_same_options(make: Any) -> None:
    adapter: DurableAdapter = make(**OPTIONS)
    assert (adapter.budget, adapter.approval_timeout) == (OPTIONS["budget"], timedelta(hours=1))
    assert (adapter.on_approval_timeout, adapter.stream) == ("escalate", True)
    assert adapter.tool_queue == "io"
    model = adapter.model_options
    assert (model.queue, model.retry, model.timeout) == (
        "llm",
        RetryPolicy(max_attempts=2),
        timedelta(seconds=30),
    )
    assert (model.rate_limit, model.rate_key) == ("5/s", "provider")
    step = adapter.app.steps["agent__helper__model_request"]
    assert (step.queue, step.timeout, step.rate_limit.key, step.local) == (
        "llm",
        timedelta(seconds=30),
        "provider",
        True,
    )
    assert adapter.local and model.local


@pytest.mark.parametrize("make", ADAPTERS)
def test_the_defaults_are_those_of_the_documented_signature(make: Any) -> None:
    adapter: DurableAdapter = make()
    assert (adapter.budget, adapter.approval_timeout, adapter.stream) == (None, None, False)
    assert (adapter.on_approval_timeout, adapter.tool_queue) == ("deny", "tools")
    assert adapter.model_options.queue == "model"
    assert adapter.model_options.timeout == timedelta(minutes=10)
    assert not adapter.local and not adapter.app.steps["agent__helper__model_request"].local


@pytest.mark.parametrize("make", ADAPTERS)
def test_an_unknown_option_is_refused_by_name(make: Any) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'model_qeue'"):
        make(model_qeue="llm")


@pytest.mark.parametrize("make", ADAPTERS)
def test_a_tool_policy_for_no_tool_is_refused(make: Any) -> None:
    with pytest.raises(Exception, match="unknown tools"):
        make(tools={"nothing": ToolPolicy()})
