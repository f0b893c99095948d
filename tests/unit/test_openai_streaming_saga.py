"""OpenAI Agents streaming in a saga (issue 25, item 16): ``SagaRunner.run_streamed`` in saga
code is the SDK's streamed run made durable. Its model calls and tools are the same steps, with
the same records in the history, as ``SagaRunner.run``; ``stream_events()`` yields each
response replayed from its recorded step (the same events on every replay, no model asked
again); with ``SagaRunner(stream=True)`` the worker streams the live tokens to the run's
channel (``Client.stream``). Offline: the SDK's ScriptedModel."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from agents import Agent, function_tool
from agents.items import ModelResponse
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from agents.usage import Usage

from sagaloop import App, SagaContext
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.engine import history as h
from sagaloop.testing import Harness


def reply(*items: Any) -> ModelResponse:
    usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
    return ModelResponse(output=list(items), usage=usage, response_id=None)


def outputs_of(call: Any) -> list[str]:
    return [
        str(i["output"])
        for i in call.input
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]


def tool_then_answer() -> ScriptedModel:
    return ScriptedModel(
        [
            reply(
                assistant_message("let me add"),
                function_call("add", {"a": 2, "b": 3}, call_id="c1"),
            ),
            ModelStep.respond(lambda call: reply(assistant_message(f"sum {outputs_of(call)[0]}"))),
        ]
    )


def adding_app(streamed: bool, effects: Counter[str]) -> tuple[App, ScriptedModel]:
    """The saga ``ask``: the agent adds with its tool, then answers; with ``streamed`` it runs
    through ``run_streamed`` and returns what it saw of the stream too."""
    model = tool_then_answer()
    app = App("oa-stream")

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        effects[f"add {a} {b}"] += 1
        return a + b

    agent: Agent[Any] = Agent(name="adder", model=model, tools=[add])
    runner = SagaRunner(app, agent, stream=True)

    @app.saga(name="ask")
    async def ask(ctx: SagaContext, prompt: str) -> dict[str, Any]:
        if not streamed:
            result = await runner.run(agent, prompt)
            return {"output": result.final_output}
        streaming = runner.run_streamed(agent, prompt)
        texts: list[str] = []
        kinds: list[str] = []
        async for event in streaming.stream_events():
            kinds.append(event.type)
            data = getattr(event, "data", None)
            if getattr(data, "type", None) == "response.output_text.delta":
                texts.append(data.delta)
        return {
            "output": streaming.final_output,
            "texts": texts,
            "items": sorted({k for k in kinds if k != "raw_response_event"}),
        }

    return app, model


def step_once_with_restarts(env: Harness) -> None:
    for _ in range(500):
        if not env.step_once():
            break
        env.restart()
    env.run_until_idle()


def records(env: Harness, run_id: str) -> list[tuple[str, str | None, Any]]:
    """The run's history: each event's kind, name and data (what the steps were asked, what
    they returned, what was published), without its time; not the saga's own output."""
    return [(e.kind, e.name, e.data) for e in env.history(run_id) if e.kind != h.SAGA_FINISHED]


def test_run_streamed_in_a_saga_yields_the_recorded_events_and_streams_live_tokens() -> None:
    effects: Counter[str] = Counter()
    app, model = adding_app(True, effects)
    env = Harness(app)
    run_id = env.start("ask", "add 2 and 3")
    live = env.streams.subscribe(run_id)
    step_once_with_restarts(env)
    out = env.result(run_id)
    assert out["output"] == "sum 5"
    assert out["texts"] == ["let me add", "sum 5"], "each response's text, replayed"
    assert {"run_item_stream_event", "agent_updated_stream_event"} <= set(out["items"])
    assert effects == {"add 2 3": 1}, "the tool ran once, whatever the replays"
    assert [c.streamed for c in model.calls] == [True, True], "asked once per turn, streaming"
    items = live.get(0.1)
    texts = "".join(i["data"]["text"] for i in items if i["data"]["text"])
    assert texts == "let me addsum 5", "the worker streamed the live tokens to the channel"
    assert {i["step"] for i in items} == {"agent__adder__model_request"}


def test_run_streamed_records_the_same_history_as_run() -> None:
    histories = []
    for streamed in (False, True):
        app, _ = adding_app(streamed, Counter())
        env = Harness(app)
        run_id = env.start("ask", "add 2 and 3", run_id="r1")
        env.run_until_idle()
        assert env.result(run_id)["output"] == "sum 5"
        histories.append(records(env, run_id))
    plain, streamed_history = histories
    assert streamed_history == plain
    names = [n for k, n, _ in plain if k == h.STEP_COMPLETED]
    assert names == [
        "agent__adder__model_request",
        "agent__adder__tool__add",
        "agent__adder__model_request",
    ]
    assert json.dumps(plain)  # JSON, as stored


def test_run_streamed_in_a_run_the_engine_keeps_in_memory_between_activations() -> None:
    """With the engine's cache, the SDK's streamed run stays suspended at its step between
    activations instead of being replayed: the same outcome."""
    effects: Counter[str] = Counter()
    app, model = adding_app(True, effects)
    env = Harness(app, cache=True)
    run_id = env.start("ask", "add 2 and 3")
    env.run_until_idle()
    assert env.result(run_id)["texts"] == ["let me add", "sum 5"]
    assert effects == {"add 2 3": 1} and len(model.calls) == 2
