"""A model stream is closed when its step times out or its run ends (issue 22, section 3):
``SagaAgent(stream=True)`` and ``SagaRunner(stream=True)`` stop reading, and paying for, a
stream whose run is over (``ctx.heartbeat()`` raises ``StepCancelled``) or whose step ran past
its timeout. The model steps' bodies are called directly, with a step context whose heartbeat
says the run ended after a few events; the models count what they sent and whether their
stream was closed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from agents import Agent as OAAgent
from agents.models.interface import Model as OAModel
from pydantic import BaseModel
from pydantic_ai import Agent, models
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelRequest
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, ApplicationError, StepCancelled
from sagaloop.agents import transcript
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.agents.pydantic_ai import SagaAgent
from sagaloop.engine.messages import Envelope
from sagaloop.runtime.steps import _StepContext
from sagaloop.sagas.app import StepDef

models.ALLOW_MODEL_REQUESTS = False

CHUNKS = 200


class Meter:
    """What a model sent of its stream, and whether the stream was closed."""

    def __init__(self, pause: float = 0.0) -> None:
        self.sent = 0
        self.closed = False
        self.pause = pause

    async def chunks(self) -> AsyncIterator[str]:
        try:
            for i in range(CHUNKS):
                self.sent += 1
                if self.pause:
                    await asyncio.sleep(self.pause)
                yield f"w{i} "
        finally:
            self.closed = True


def step_context(step: StepDef[Any, Any], *, ended_after: int | None) -> _StepContext:
    """A model step's context whose heartbeat says the run ended after ``ended_after`` beats."""
    beats = 0

    def beat(ctx: Any) -> None:
        nonlocal beats
        beats += 1
        if ended_after is not None and beats > ended_after:
            raise StepCancelled("run 'r' is failed: the step should stop")

    env = Envelope(type="step", run_id="r", payload={}, position=0, attempt=1)
    return _StepContext(env, step, False, beat=beat)


def pydantic_request() -> dict[str, Any]:
    encoder = transcript.Encoder(
        lambda ms: ModelMessagesTypeAdapter.dump_python(list(ms), mode="json")
    )
    delta = encoder.delta([ModelRequest.user_text_prompt("talk")])
    delta.update(conversation="r/1", n=0)
    return {"transcript": delta, "settings": None, "params": {}}


def pydantic_agent(meter: Meter, **options: Any) -> SagaAgent[Any, Any]:
    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        async for chunk in meter.chunks():
            yield chunk

    agent = Agent(FunctionModel(stream_function=stream), name="talker")
    return SagaAgent(agent, app=App("streams"), stream=True, **options)


def test_pydantic_ai_a_stream_is_closed_when_its_run_ends() -> None:
    meter = Meter()
    saga_agent = pydantic_agent(meter)
    ctx = step_context(saga_agent.model_step, ended_after=3)
    with pytest.raises(StepCancelled):
        asyncio.run(saga_agent.model_step.fn(ctx, pydantic_request()))
    assert meter.sent < 10, f"read {meter.sent} chunks of a run that had ended"
    assert meter.closed


def test_pydantic_ai_a_stream_is_closed_when_its_step_times_out() -> None:
    meter = Meter(pause=0.02)  # 4 s in all
    saga_agent = pydantic_agent(meter, model_timeout=timedelta(milliseconds=200))
    ctx = step_context(saga_agent.model_step, ended_after=None)
    started = time.monotonic()
    with pytest.raises(ApplicationError) as timed_out:  # an outage: asked again
        asyncio.run(saga_agent.model_step.fn(ctx, pydantic_request()))
    assert time.monotonic() - started < 2.5
    assert isinstance(timed_out.value.__cause__, TimeoutError)
    assert meter.sent < CHUNKS and meter.closed


class Delta(BaseModel):
    type: str = "response.output_text.delta"
    delta: str


class StreamingModel(OAModel):
    def __init__(self, meter: Meter) -> None:
        self.meter = meter

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("streamed only")

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for chunk in self.meter.chunks():
            yield Delta(delta=chunk)


def openai_request() -> dict[str, Any]:
    encoder = transcript.Encoder(lambda items: list(items))
    delta = encoder.delta([{"role": "user", "content": "talk"}])
    delta.update(conversation="r/1", n=0)
    return {
        "transcript": delta,
        "model": None,
        "system": None,
        "settings": {},
        "tools": [],
        "output_schema": None,
        "handoffs": [],
    }


def openai_runner(meter: Meter, **options: Any) -> SagaRunner:
    agent: OAAgent[Any] = OAAgent(name="talker", model=StreamingModel(meter))
    return SagaRunner(App("oa-streams"), agent, stream=True, **options)


def test_openai_a_stream_is_closed_when_its_run_ends() -> None:
    meter = Meter()
    runner = openai_runner(meter)
    step = runner.model_steps["talker"]
    ctx = step_context(step, ended_after=3)
    with pytest.raises(StepCancelled):
        asyncio.run(step.fn(ctx, openai_request()))
    assert meter.sent < 10, f"read {meter.sent} chunks of a run that had ended"
    assert meter.closed


def test_openai_a_stream_is_closed_when_its_step_times_out() -> None:
    meter = Meter(pause=0.02)
    runner = openai_runner(meter, model_timeout=timedelta(milliseconds=200))
    step = runner.model_steps["talker"]
    ctx = step_context(step, ended_after=None)
    started = time.monotonic()
    with pytest.raises(ApplicationError) as timed_out:  # an outage: asked again
        asyncio.run(step.fn(ctx, openai_request()))
    assert time.monotonic() - started < 2.5
    assert isinstance(timed_out.value.__cause__, TimeoutError)
    assert meter.sent < CHUNKS and meter.closed
