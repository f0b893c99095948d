"""OpenTelemetry traces (``sagaloop.tracing``): one run is one trace across the starter,
the engine and the workers, checked with the SDK's in-memory exporter.

The SDK's global tracer provider can be set once per process, so these tests hand a provider
of their own to sagaloop (``tracing.use_tracer_provider``) and put it back afterwards; user
spans come from the same provider, and OpenTelemetry's context (global) links them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sagaloop import App, RetryPolicy, SagaContext, StepContext, StepFailedError, tracing
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope
from sagaloop.runtime.consumers import decode
from sagaloop.testing import Harness

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Traces:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.user = self.provider.get_tracer("the-app")

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        found = sorted(self.exporter.get_finished_spans(), key=lambda s: s.start_time or 0)
        return [s for s in found if name is None or s.name == name]


@pytest.fixture
def traces() -> Iterator[Traces]:
    found = Traces()
    before = tracing.use_tracer_provider(found.provider)
    try:
        yield found
    finally:
        tracing.use_tracer_provider(before)
        found.provider.shutdown()


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


# --- one run, one trace ----------------------------------------------------------------------

app = App("shop")
charges: list[int] = []
user_tracer: list[Any] = []  # the test's tracer, for spans opened in step code


def user_span(name: str) -> None:
    with user_tracer[0].start_as_current_span(name):
        pass


@app.step(retry=RetryPolicy(max_attempts=3), timeout=timedelta(seconds=30))
def charge(ctx: StepContext, amount: int) -> str:  # a timeout: it runs on a pool thread
    charges.append(amount)
    user_span("charge the card")
    if len(charges) == 1:
        raise ConnectionError("the payment provider hung up")
    return "ch_1"


@charge.compensation
async def refund(ctx: StepContext, amount: int, charge_id: str) -> None:  # async
    user_span("refund the card")


@app.step(retry=RetryPolicy(max_attempts=1))
def ship(ctx: StepContext, amount: int) -> None:
    raise ValueError("out of stock")


@app.step(local=True)
def note(ctx: StepContext, text: str) -> str:  # run by the engine, inside its activation
    user_span("note it")
    return text


@app.saga(name="order")
async def order(ctx: SagaContext, amount: int) -> str:
    await ctx.call(note, "ordered")
    charge_id = await ctx.call(charge, amount)
    try:
        await ctx.call(ship, amount)
    except StepFailedError:
        await ctx.compensate()
        return "refunded"
    return charge_id


@app.saga(name="parent")
async def parent(ctx: SagaContext, amount: int) -> str:
    return await ctx.call(order, amount)


@app.saga(name="loop")
async def loop(ctx: SagaContext, n: int) -> str:
    await ctx.call(note, f"round {n}")
    if n < 2:
        ctx.continue_as_new(n + 1)
    return "done"


def test_a_run_is_one_trace_from_the_starter_through_engine_and_workers(traces: Traces) -> None:
    charges.clear()
    user_tracer[:] = [traces.user]
    env = Harness(app)
    with traces.user.start_as_current_span("checkout"):
        run_id = env.start(order, 5)
    env.run_until_idle()
    assert env.result(run_id) == "refunded"

    spans = traces.spans()
    [checkout] = traces.spans("checkout")
    assert {trace_id(s) for s in spans} == {trace_id(checkout)}, "one run: one trace"
    [start] = traces.spans(tracing.START)
    assert parent_id(start) == span_id(checkout) and start.kind == SpanKind.PRODUCER
    stored = env.history(run_id)[0]
    assert stored.kind == h.RUN_STARTED
    assert stored.data["trace"]["traceparent"].split("-")[2] == f"{span_id(start):016x}"

    activations = traces.spans(tracing.ACTIVATION)
    assert {parent_id(a) for a in activations} == {span_id(start)}, "children of the run"
    assert all(a.kind == SpanKind.CONSUMER for a in activations)
    assert {a.attributes["sagaloop.run_id"] for a in activations} == {run_id}
    kinds = [a.attributes["sagaloop.message_type"] for a in activations]
    assert kinds[0] == "start" and "timer" in kinds and "step_result" in kinds
    by_id = {span_id(a): a for a in activations}
    for result in (
        a for a in activations if a.attributes["sagaloop.message_type"] == "step_result"
    ):
        [link] = result.links  # the activation that sent the step
        assert link.context.span_id in by_id

    attempts = traces.spans(tracing.STEP)
    assert [
        (s.attributes["sagaloop.step"], s.attributes["sagaloop.attempt"]) for s in attempts
    ] == [
        ("note", 1),
        ("charge", 1),
        ("charge", 2),
        ("ship", 1),
    ]
    assert all(parent_id(s) in by_id for s in attempts), "each attempt: a child of an activation"
    failed = attempts[1]
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["sagaloop.outcome"] == "failed"
    [event] = failed.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "ConnectionError"
    assert event.attributes["exception.message"] == "the payment provider hung up"
    assert attempts[2].status.status_code == StatusCode.UNSET
    assert attempts[3].status.status_code == StatusCode.ERROR  # ship, out of stock
    [undo] = traces.spans(tracing.COMPENSATION)
    assert undo.attributes["sagaloop.step"] == "charge" and parent_id(undo) in by_id

    # step code's own spans nest under the attempt: on the caller's thread (a local step), a
    # pool thread (a step with a timeout) and an async step's loop (the compensation)
    nested = {s.name: parent_id(s) for s in spans if s.name.endswith(("card", "note it"))}
    assert nested == {
        "note it": span_id(attempts[0]),
        "charge the card": span_id(attempts[2]),  # the later span of that name wins
        "refund the card": span_id(undo),
    }


def test_a_child_run_is_in_its_parents_trace(traces: Traces) -> None:
    charges[:] = [0]  # the first charge succeeds
    user_tracer[:] = [traces.user]
    env = Harness(app)
    run_id = env.start(parent, 7)  # no span in the caller: sagaloop.start is the root
    env.run_until_idle()
    assert env.result(run_id) == "refunded"
    [start] = traces.spans(tracing.START)
    assert start.parent is None
    assert {trace_id(s) for s in traces.spans()} == {trace_id(start)}
    child = [
        a for a in traces.spans(tracing.ACTIVATION) if a.attributes["sagaloop.run_id"] != run_id
    ]
    parents = {span_id(a) for a in traces.spans(tracing.ACTIVATION)} - {span_id(a) for a in child}
    assert child and {parent_id(a) for a in child} <= parents  # the activation that started it


def test_a_run_that_continues_as_new_stays_in_its_trace(traces: Traces) -> None:
    user_tracer[:] = [traces.user]
    env = Harness(app)
    run_id = env.start(loop, 0)
    env.run_until_idle()
    assert env.result(run_id) == "done"
    [start] = traces.spans(tracing.START)
    activations = traces.spans(tracing.ACTIVATION)
    assert len(activations) >= 3 and {parent_id(a) for a in activations} == {span_id(start)}
    assert env.history(run_id)[0].data["epoch"] == 2
    assert (
        env.history(run_id)[0].data["trace"]["traceparent"].split("-")[2]
        == f"{span_id(start):016x}"
    )


def test_the_relay_publishes_in_the_trace_of_the_activation_that_sent(traces: Traces) -> None:
    charges[:] = [0]
    user_tracer[:] = [traces.user]
    env = Harness(app, broker="memory")
    run_id = env.start(order, 1)
    env.run_until_idle()
    assert env.result(run_id) == "refunded"
    publishes = traces.spans(tracing.PUBLISH)
    senders = {span_id(s) for s in traces.spans() if s.name in (tracing.START, tracing.ACTIVATION)}
    assert publishes and all(p.kind == SpanKind.PRODUCER for p in publishes)
    assert {parent_id(p) for p in publishes} <= senders


# --- the envelope's trace context --------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ({"traceparent": PARENT}, {"traceparent": PARENT}),
        (
            {"traceparent": PARENT, "tracestate": "ro=1,x=y"},
            {"traceparent": PARENT, "tracestate": "ro=1,x=y"},
        ),
        ({"traceparent": PARENT, "tracestate": "x" * 513}, {"traceparent": PARENT}),
        ({"traceparent": PARENT, "tracestate": "a\nb", "baggage": "k=v"}, {"traceparent": PARENT}),
        ({"traceparent": PARENT.upper()}, None),
        ({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, None),
        ({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01"}, None),
        ({"traceparent": "ff" + PARENT[2:]}, None),
        ({"traceparent": PARENT + "-more"}, None),
        ({"traceparent": PARENT * 1000}, None),
        ({"tracestate": "ro=1"}, None),
        ({"traceparent": 5}, None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ([PARENT], None),
    ],
)
def test_a_malformed_trace_context_is_dropped_never_refused(given: Any, kept: Any) -> None:
    body = {"type": "event", "run_id": "r", "payload": {"name": "go"}, "trace": given}
    assert Envelope.from_bytes(json.dumps(body).encode()).trace == kept


def test_a_raw_start_with_a_bad_or_good_traceparent(traces: Traces) -> None:
    charges[:] = [0]
    user_tracer[:] = [traces.user]
    env = Harness(app)
    for run_id, trace in [
        ("bad", {"traceparent": "not-a-traceparent"}),
        ("good", {"traceparent": PARENT}),
    ]:
        start = {
            "type": "start",
            "run_id": run_id,
            "saga": "order",
            "payload": {"input": 1},
            "trace": trace,
        }
        env.broker.publish([("shop.engine", json.dumps(start).encode())])
    env.run_until_idle()
    assert env.result("bad") == env.result("good") == "refunded"
    assert not env.store.dead_letters()
    per_run: dict[str, set[int]] = {}
    for a in traces.spans(tracing.ACTIVATION):
        per_run.setdefault(str(a.attributes["sagaloop.run_id"]), set()).add(trace_id(a))
    assert per_run["good"] == {int(PARENT.split("-")[1], 16)}, "the publisher's trace"
    assert len(per_run["bad"]) == 1, "its first activation began the run's trace"
    first = traces.spans(tracing.ACTIVATION)[0]
    assert first.attributes["sagaloop.run_id"] == "bad" and first.parent is None
    assert env.history("good")[0].data["trace"] == {"traceparent": PARENT}
    assert (
        env.history("bad")[0].data["trace"]["traceparent"].split("-")[2] == f"{span_id(first):016x}"
    )


class _Delivery:
    def __init__(self, body: bytes, trace: dict[str, Any] | None) -> None:
        self.body, self.trace = body, trace
        self.content_type, self.deliveries, self.trusted = None, 1, False
        self.reason: str | None = None

    def dead_letter(self, reason: str) -> None:
        self.reason = reason


def test_an_amqp_traceparent_header_fills_an_envelope_without_one() -> None:
    body = json.dumps({"type": "start", "run_id": "r", "saga": "order", "payload": {}}).encode()
    header = {"traceparent": PARENT.encode(), "tracestate": "ro=1"}  # pika: bytes or str
    env = decode(_Delivery(body, header))
    assert env is not None and env.trace == {"traceparent": PARENT, "tracestate": "ro=1"}
    env = decode(_Delivery(body, {"traceparent": "junk"}))
    assert env is not None and env.trace is None
    own = json.dumps(
        {
            "type": "start",
            "run_id": "r",
            "saga": "order",
            "payload": {},
            "trace": {"traceparent": PARENT},
        }
    ).encode()
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    env = decode(_Delivery(own, {"traceparent": other}))
    assert env is not None and env.trace == {"traceparent": PARENT}, "the envelope's wins"


def test_the_published_header_continues_the_messages_trace_and_the_consumer_follows_it() -> None:
    body = json.dumps(
        {"type": "step", "run_id": "r", "payload": {}, "trace": {"traceparent": PARENT}},
        separators=(",", ":"),
    ).encode()
    relay = "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01"  # same trace
    other = "00-22222222222222222222222222222222-1111111111111111-01"  # a new trace
    assert tracing.amqp_headers(body, {"traceparent": relay}) == {"traceparent": relay}
    assert tracing.amqp_headers(body, {"traceparent": other}) == {"traceparent": PARENT}
    assert tracing.amqp_headers(body, None) == {"traceparent": PARENT}
    assert tracing.amqp_headers(b'{"type":"step"}', {"traceparent": relay}) is None
    own = {"traceparent": PARENT}
    assert tracing.continued(own, {"traceparent": relay.encode()}) == {"traceparent": relay}
    assert tracing.continued(own, {"traceparent": other}) == own
    assert tracing.continued(own, {"traceparent": "junk"}) == own
    assert tracing.continued(None, {"traceparent": other}) == {"traceparent": other}
    assert tracing.continued(None, None) is None


def test_rabbitmqs_traceparent_header_reaches_the_consumer() -> None:
    from sagaloop.brokers._amqp import Consumer
    from sagaloop.brokers.rabbitmq import RabbitBroker, RabbitDelivery

    held: list[Any] = []
    broker = SimpleNamespace(
        _signing_key=None, _cond=threading.Condition(), _held=SimpleNamespace(delivered=held.append)
    )
    body = json.dumps({"type": "start", "run_id": "r", "saga": "order", "payload": {}}).encode()
    headers = {"traceparent": PARENT.encode(), "tracestate": "ro=1", "x-other": 1}
    props = SimpleNamespace(headers=headers, content_type="application/json")
    method = SimpleNamespace(redelivered=False, delivery_tag=1)
    RabbitBroker._on_message(broker, Consumer("shop.engine", 1, 0), None, method, props, body)
    env = decode(RabbitDelivery(broker, held[0]))
    assert env is not None and env.trace == {"traceparent": PARENT, "tracestate": "ro=1"}


def test_the_json_schema_documents_the_trace_context() -> None:
    schema = Envelope.model_json_schema()["properties"]["trace"]
    assert "traceparent" in schema["description"] and "dropped" in schema["description"]


# --- off: zero cost ----------------------------------------------------------------------------


def test_without_a_tracer_provider_nothing_is_recorded_or_stored() -> None:
    assert tracing.use_tracer_provider(None) is None  # none set: the global one, a proxy
    env = Harness(app)
    charges[:] = [0]
    run_id = env.start(order, 1)
    env.run_until_idle()
    assert env.history(run_id)[0].data == {"input": 1}, "no trace context stored"
    assert tracing.carried(decode) is decode


def test_without_the_extra_nothing_is_imported_and_runs_work() -> None:
    code = textwrap.dedent(
        """
        import sys
        import sagaloop, sagaloop.testing, sagaloop.runtime.consumers, sagaloop.outbox
        assert not [m for m in sys.modules if m.startswith("opentelemetry")], "imported"
        sys.modules["opentelemetry"] = None  # as if the extra were not installed
        from sagaloop import App, SagaContext, StepContext
        from sagaloop.testing import Harness
        app = App("plain")

        @app.step()
        def double(ctx: StepContext, n: int) -> int:
            return 2 * n

        @app.saga(name="s")
        async def s(ctx: SagaContext, n: int) -> int:
            return await ctx.call(double, n)

        env = Harness(app, broker="memory")
        run_id = env.start(s, 21)
        env.run_until_idle()
        assert env.result(run_id) == 42
        from sagaloop import tracing
        assert tracing._loaded and tracing._api is None
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok", out.stderr


# --- agents: GenAI semantic conventions ---------------------------------------------------------


def test_an_agents_model_and_tool_steps_carry_gen_ai_attributes(traces: Traces) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, models
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from sagaloop.agents.pydantic_ai import SagaAgent

    models.ALLOW_MODEL_REQUESTS = False

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("add", {"a": 1, "b": 2})])
        return ModelResponse(parts=[TextPart("3")])

    agents = App("genai")
    agent = Agent(FunctionModel(model), name="calc")

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    saga_agent = SagaAgent(agent, app=agents)

    @agents.saga(name="ask")
    async def ask(ctx: SagaContext, prompt: str) -> str:
        return str((await saga_agent.run(prompt)).output)

    env = Harness(agents)
    run_id = env.start(ask, "1 + 2?")
    env.run_until_idle()
    assert env.result(run_id) == "3"
    steps = traces.spans(tracing.STEP)
    model_steps = [
        s for s in steps if s.attributes["sagaloop.step"] == "agent__calc__model_request"
    ]
    assert len(model_steps) == 2
    for span in model_steps:
        attributes = dict(span.attributes or {})
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.request.model"] == "function:model:"
        assert attributes["gen_ai.provider.name"] == attributes["gen_ai.system"] == "function"
        assert isinstance(attributes["gen_ai.usage.input_tokens"], int)
        assert isinstance(attributes["gen_ai.usage.output_tokens"], int)
        assert attributes["gen_ai.usage.input_tokens"] > 0
    [tool] = [s for s in steps if s.attributes["sagaloop.step"] == "agent__calc__tool__add"]
    assert tool.attributes["gen_ai.tool.name"] == "add"
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"


def test_an_openai_agents_model_step_carries_gen_ai_attributes(traces: Traces) -> None:
    pytest.importorskip("agents")
    from agents import Agent
    from agents.items import ModelResponse
    from agents.models.openai_responses import OpenAIResponsesModel
    from agents.testing import ScriptedModel, assistant_message
    from agents.usage import Usage
    from openai import AsyncOpenAI

    from sagaloop.agents.openai_agents import SagaRunner
    from sagaloop.agents.openai_agents.model import model_ref

    usage = Usage(requests=1, input_tokens=12, output_tokens=3, total_tokens=15)
    model = ScriptedModel(
        [ModelResponse(output=[assistant_message("4")], usage=usage, response_id=None)]
    )
    agents = App("genai-oa")
    agent: Agent[Any] = Agent(name="calc", model=model)
    runner = SagaRunner(agents, agent)

    @agents.saga(name="ask")
    async def ask(ctx: SagaContext, prompt: str) -> str:
        return str((await runner.run(agent, prompt)).final_output)

    env = Harness(agents)
    run_id = env.start(ask, "2 + 2?")
    env.run_until_idle()
    assert env.result(run_id) == "4"
    [span] = traces.spans(tracing.STEP)
    assert span.attributes is not None
    assert span.attributes["gen_ai.operation.name"] == "chat"
    assert span.attributes["gen_ai.usage.input_tokens"] == 12
    assert span.attributes["gen_ai.usage.output_tokens"] == 3
    # the model's name and provider, when the runner can tell them
    openai = OpenAIResponsesModel("gpt-5", AsyncOpenAI(api_key="unused"))
    assert model_ref("gpt-5", openai) == ("gpt-5", "openai")
    assert model_ref(None, openai) == ("gpt-5", "openai")
    assert model_ref("litellm/claude", model) == ("claude", "litellm")
    assert model_ref(None, model) == (None, None)
