"""The app of ``benchmarks.agent_loop`` (``--app benchmarks.loopapp``): steps that say when their
body began and ended, a step that streams, and a Pydantic AI agent on a scripted model.

Every step body returns ``[began, ended]`` read from ``time.time()`` inside the body: the
wall clock, comparable between the benchmark's process and the worker's or engine's (one host,
one clock), where ``time.perf_counter`` is not. The app is named ``bench``, as
``benchmarks.benchapp``, so that ``benchmarks.sagaloop_bench.System`` declares and deletes its
queues."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic_ai import Agent, models
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel
from pydantic_ai.usage import UsageLimits

from sagaloop import App, SagaContext, StepContext
from sagaloop.agents.pydantic_ai import SagaAgent

models.ALLOW_MODEL_REQUESTS = False

app = App("bench")

CHUNKS = 300
CHUNK_EVERY = 0.01  # 100 chunks a second: 3 s in all
STREAM_AFTER = 1.0
"""The streaming step waits this long before its first chunk: the reader (``Client.stream``,
opened right after the start) is subscribed by then, and would otherwise miss the first chunks."""

TURNS = 5
TOKENS = 5  # text deltas per model response, each after TOKEN_PAUSE
TOKEN_PAUSE = 0.01
TOOL_PAUSE = 0.02
MODEL_S = (TOKENS * TOKEN_PAUSE) * (TURNS + 1)  # TURNS requests with a tool call, then the answer
TOOLS_S = TOOL_PAUSE * TURNS
"""The model's and the tools' own time in one agent run: what their scripted sleeps take."""


def _stamp() -> list[float]:
    began = time.time()
    return [began, time.time()]


@app.step(queue="bench")
def stamp(ctx: StepContext, i: int) -> list[float]:
    """A trivial step on the ``bench`` queue (a worker runs it): when its body began and ended."""
    return _stamp()


@app.step(local=True)
def stamp_local(ctx: StepContext, i: int) -> list[float]:
    """``stamp`` as an in-process step: the engine's process runs it."""
    return _stamp()


def _chunks(ctx: StepContext) -> list[float]:
    time.sleep(STREAM_AFTER)
    first = time.time()
    sent = []
    for i in range(CHUNKS):
        due = first + i * CHUNK_EVERY  # on a schedule: a slow publish is not made up for later
        pause = due - time.time()
        if pause > 0:
            time.sleep(pause)
        sent.append(time.time())
        ctx.stream(f"{i:04d}")  # four bytes: the chunk's index
    return sent


@app.step(queue="bench")
def chunks(ctx: StepContext) -> list[float]:
    """Streams ``CHUNKS`` four-byte chunks to the run's live channel, one every
    ``CHUNK_EVERY`` seconds; returns when it sent each."""
    return _chunks(ctx)


@app.step(local=True)
def chunks_local(ctx: StepContext) -> list[float]:
    """``chunks`` as an in-process step."""
    return _chunks(ctx)


@app.saga(name="stamps")
async def stamps(ctx: SagaContext, spec: dict[str, Any]) -> list[list[float]]:
    """``spec["steps"]`` steps one after the other (``spec["local"]``: in-process steps)."""
    step = stamp_local if spec["local"] else stamp
    return [await ctx.call(step, i) for i in range(spec["steps"])]


@app.saga(name="fanout")
async def fanout(ctx: SagaContext, spec: dict[str, Any]) -> list[list[float]]:
    """``spec["steps"]`` steps at once: ``asyncio.gather`` of as many ``ctx.call``."""
    step = stamp_local if spec["local"] else stamp
    return list(await asyncio.gather(*(ctx.call(step, i) for i in range(spec["steps"]))))


@app.saga(name="stream")
async def stream(ctx: SagaContext, spec: dict[str, Any]) -> list[float]:
    """One step that streams."""
    return await ctx.call(chunks_local if spec["local"] else chunks)


# --- a five-turn agent loop: a scripted model that streams, two tools ---------------------------


async def _script(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
    """Turn ``n`` (one model request each): ``TOKENS`` text deltas, then (for the first
    ``TURNS`` turns) a call of ``lookup`` or ``weather``, in turn."""
    turn = sum(isinstance(m, ModelResponse) for m in messages)
    for k in range(TOKENS):
        await asyncio.sleep(TOKEN_PAUSE)
        yield f"t{turn}.{k} "
    if turn < TURNS:
        tool = ("lookup", "weather")[turn % 2]
        calls: DeltaToolCalls = {0: DeltaToolCall(name=tool, json_args=f'{{"i": {turn}}}')}
        yield calls


_agent = Agent(FunctionModel(stream_function=_script), name="loop")


@_agent.tool_plain
def lookup(i: int) -> str:
    """Look the record up."""
    time.sleep(TOOL_PAUSE)
    return f"record {i}"


@_agent.tool_plain
def weather(i: int) -> str:
    """The weather at the place."""
    time.sleep(TOOL_PAUSE)
    return f"sunny {i}"


loop_agent = SagaAgent(
    _agent, app=app, model_queue="bench", tool_queue="bench", model_rate_limit=None, stream=True
)
local_agent = SagaAgent(
    _agent, app=app, name="loop_local", model_rate_limit=None, stream=True, local=True
)
"""The same agent with its model requests and tools as in-process steps (``local=True``)."""


@app.saga(name="agent5")
async def agent5(ctx: SagaContext, spec: dict[str, Any]) -> int:
    """The five-turn loop: six model requests (each streamed), five tool calls; returns how
    many tools it called. ``spec["local"]``: its steps in-process."""
    agent = local_agent if spec.get("local") else loop_agent
    result = await agent.run("go", usage_limits=UsageLimits(request_limit=None))
    calls = [
        p
        for m in result.all_messages()
        if isinstance(m, ModelResponse)
        for p in m.parts
        if isinstance(p, ToolCallPart)
    ]
    return len(calls)
