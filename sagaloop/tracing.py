"""OpenTelemetry traces of runs: one run is one trace, across the processes it crosses.

Needs only ``opentelemetry-api`` (the ``otel`` extra) in the library; the application configures
an SDK and an exporter (``opentelemetry-instrument``, or a ``TracerProvider`` set in its own
code). Without the API installed, or without a tracer provider set, every hook below is a
check and a no-op (1 to 3 µs): nothing is imported at ``import sagaloop`` (the API is imported
on the first hook, once) and no span is made. The module is a leaf at the package's top,
as ``errors`` is, because every layer calls it: the engine, the workers, the relay, the brokers,
the client and the agents (none of them may import ``sagaloop.observability``, which reads the
store).

How the context travels (``docs/operations.md``, "Traces", says it for operators):

- The envelope's ``trace`` object carries a W3C trace context, ``{"traceparent": ...,
  "tracestate": ...}`` (:func:`clean` checks it: a malformed one is dropped, never a reason to
  refuse the message). ``Client.start`` opens the span ``sagaloop.start`` (a child of the span
  active in the caller, if any) and puts its context in the start message and in the run's
  ``run_started`` event: that is **the run's trace context**, stored with its history (none
  when the starting process does not trace: each activation of the run then begins a trace).
  A raw start brings its own (the envelope's field, or RabbitMQ's ``traceparent`` header); a
  raw start that brings none gets its first activation's.
- Each **activation** of a run is the span ``sagaloop.activation``, a child of the run's trace
  context, linked to the context of the message that caused it (an event sent from a traced
  request, a step's result). The messages the activation sends (steps, child runs, events to
  other runs, cancellations) carry the activation's context; timers carry none (their rows have
  no room for it) and need none: their activation reads the run's context from its history.
- Each **step attempt** is ``sagaloop.step`` (``sagaloop.compensation`` for an undo), a child
  of the activation that sent it (of the relay's publish span in between, on RabbitMQ),
  current while the step's code runs (on the worker's thread, on the pool thread of a step
  with a timeout, in an async step's loop), so spans that step code opens nest under it. A
  failed attempt has status ERROR and the exception as an event. Its ``step_result`` carries
  the step message's context back.
- The relay's batches are ``sagaloop.relay.publish`` spans: children of the context their
  messages share, else linked to each. On RabbitMQ each message's AMQP ``traceparent``
  header is the relay's span when it is of the message's trace (:func:`amqp_headers`); the
  worker continues it (:func:`continued`), so a step attempt is a child of the relay's
  publish, itself a child of the activation that sent the step.

Span kinds, names and the ``sagaloop.`` attributes are stable. An engine or worker without a
tracer still passes the run's context on (it is data of the history and of the messages), so
a process in the middle that does not trace does not break the trace of the others.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

ACTIVATION = "sagaloop.activation"
STEP = "sagaloop.step"
COMPENSATION = "sagaloop.compensation"
PUBLISH = "sagaloop.relay.publish"
START = "sagaloop.start"

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACESTATE = 512
"""The longest ``tracestate`` kept (W3C: at least 512 characters must be propagated)."""
MAX_LINKS = 64
"""The most links a relay batch's span gets (one per message with a trace context)."""

_PARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_STATE = re.compile(r"[\x20-\x7e]+")
_STARTS = frozenset({"start", "child_start"})
"""Message types that start a run: their context is the run's when the run has none yet."""
_TAIL = re.compile(
    rb'"trace":\{"traceparent":"([0-9a-f-]{55})"(?:,"tracestate":"(?:[^"\\]|\\.)*")?\}\}$'
)
"""The end of an envelope as sagaloop writes it (``trace`` is its last field)."""

Carrier = dict[str, str]
F = TypeVar("F", bound=Callable[..., Any])


class Message(Protocol):
    """What the hooks read of an :class:`~sagaloop.engine.messages.Envelope`."""

    @property
    def type(self) -> str: ...
    @property
    def message_id(self) -> str: ...
    @property
    def run_id(self) -> str: ...
    @property
    def saga(self) -> str | None: ...
    @property
    def position(self) -> int | None: ...
    @property
    def attempt(self) -> int | None: ...
    @property
    def payload(self) -> dict[str, Any]: ...
    @property
    def trace(self) -> Carrier | None: ...


# --- the W3C trace context (no OpenTelemetry needed) -----------------------------------------


def clean(value: object) -> Carrier | None:
    """The W3C trace context in ``value`` (an envelope's ``trace``, AMQP headers), or None.
    Never raises: a ``traceparent`` that is not ``00-<32 hex>-<16 hex>-<2 hex>`` (lower case,
    ids not all zero, version not ``ff``) drops the whole context; a ``tracestate`` that is not
    1 to 512 printable ASCII characters is dropped alone; other keys are ignored."""
    if not isinstance(value, Mapping):
        return None
    parent = value.get(TRACEPARENT)
    if isinstance(parent, bytes):
        parent = parent.decode("ascii", "replace")
    if not isinstance(parent, str) or not _valid_parent(parent):
        return None
    found = {TRACEPARENT: parent}
    state = value.get(TRACESTATE)
    if isinstance(state, bytes):
        state = state.decode("ascii", "replace")
    if isinstance(state, str) and len(state) <= MAX_TRACESTATE and _STATE.fullmatch(state):
        found[TRACESTATE] = state
    return found


def _valid_parent(text: str) -> bool:
    match = _PARENT.fullmatch(text)
    return match is not None and match[1] != "ff" and match[2] != "0" * 32 and match[3] != "0" * 16


def same_trace(a: Carrier, b: Carrier) -> bool:
    """Whether two (clean) contexts are of the same trace."""
    return a[TRACEPARENT][3:35] == b[TRACEPARENT][3:35]


def own_context(body: bytes) -> Carrier | None:
    """The ``traceparent`` of an envelope as sagaloop writes it (``trace`` its last field),
    read without parsing the body; None when it carries none."""
    match = _TAIL.search(body[-1200:])
    return clean({TRACEPARENT: match[1].decode()}) if match is not None else None


def amqp_headers(body: bytes, here: Carrier | None) -> Carrier | None:
    """The W3C trace headers (AMQP ``traceparent``, ``tracestate``) of a message sagaloop
    publishes: ``here`` (the publisher's current context, :func:`current`: the relay's span
    ``sagaloop.relay.publish``) when it is of the message's trace, else the message's own
    context, so that a header never moves a message to another trace; None when the message
    carries none. Consumers continue it (:func:`continued`)."""
    own = own_context(body)
    if own is None:
        return None
    return here if here is not None and same_trace(here, own) else own


def continued(own: Carrier | None, header: object) -> Carrier | None:
    """The trace context a consumer continues: the envelope's own, or the AMQP headers'
    (:func:`clean`) when the envelope has none (a plain publisher's), or when they are of the
    envelope's trace (the span of sagaloop's relay that published it: the step is its child).
    Headers of another trace never win over the envelope's."""
    found = clean(header)
    if own is None or (found is not None and same_trace(found, own)):
        return found if found is not None else own
    return own


def parent_of(message: Message, run_trace: Carrier | None) -> Carrier | None:
    """The context a run's work continues: the run's own, else that of the message starting it."""
    if run_trace:
        return run_trace
    return message.trace if message.type in _STARTS else None


# --- OpenTelemetry, imported once, on first use ----------------------------------------------


class _Otel:
    """The OpenTelemetry API and sagaloop's tracer (per tracer provider)."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.context = context
        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()
        self.off = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        self._tracer: tuple[TracerProvider, Tracer] | None = None

    def tracer(self, provider: TracerProvider) -> Tracer:
        cached = self._tracer
        if cached is None or cached[0] is not provider:
            cached = (provider, provider.get_tracer("sagaloop", _version()))
            self._tracer = cached
        return cached[1]

    def extract(self, carrier: Carrier | None) -> Context:
        """The context in ``carrier``; an empty one (a new trace) without: never the ambient
        context, so that where a run's work happens (a test's span, a web request serving an
        embedded engine) does not decide which trace it joins."""
        empty = self.context.Context()
        return self.propagator.extract(carrier, empty) if carrier else empty

    def inject(self) -> Carrier | None:
        """The current context, if it has a valid span."""
        carrier: Carrier = {}
        self.propagator.inject(carrier)
        return carrier or None

    def link(self, carrier: Carrier | None) -> list[Any]:
        if not carrier:
            return []
        span = self.trace.get_current_span(self.extract(carrier))
        found = span.get_span_context()
        return [self.trace.Link(found)] if found.is_valid else []


_api: _Otel | None = None
_loaded = False
_provider: TracerProvider | None = None


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sagaloop")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return None


def _load() -> _Otel | None:
    global _api, _loaded
    if not _loaded:
        try:
            _api = _Otel()
        except ImportError:  # the extra is not installed: tracing stays off
            _api = None
        _loaded = True
    return _api


def _on() -> tuple[_Otel, Tracer] | None:
    """The API and the tracer, when a tracer provider is set (else None: tracing is off)."""
    otel = _api if _loaded else _load()
    if otel is None:
        return None
    provider = _provider if _provider is not None else otel.trace.get_tracer_provider()
    if isinstance(provider, otel.off):
        return None
    return otel, otel.tracer(provider)


def use_tracer_provider(provider: TracerProvider | None) -> TracerProvider | None:
    """Make sagaloop's spans in ``provider`` instead of the global tracer provider (None: the
    global one again); return the provider used before. For tests, which cannot set the global
    provider more than once per process, and for an application that keeps sagaloop's spans
    apart. Context propagation is OpenTelemetry's, global either way."""
    global _provider
    before, _provider = _provider, provider
    return before


# --- hooks -----------------------------------------------------------------------------------


def _attributes(message: Message) -> dict[str, Any]:
    found: dict[str, Any] = {
        "sagaloop.run_id": message.run_id,
        "sagaloop.message_type": message.type,
        "sagaloop.message_id": message.message_id,
    }
    if message.saga:
        found["sagaloop.saga"] = message.saga
    if message.position is not None:
        found["sagaloop.position"] = message.position
    if message.attempt is not None:
        found["sagaloop.attempt"] = message.attempt
    return found


def start(run_id: str, saga: str) -> AbstractContextManager[Carrier | None]:
    """``Client.start``: the span ``sagaloop.start`` (a child of the caller's current span);
    yields its context, the run's trace context (None when tracing is off)."""
    on = _on()
    return contextlib.nullcontext() if on is None else _start(*on, run_id, saga)


@contextlib.contextmanager
def _start(otel: _Otel, tracer: Tracer, run_id: str, saga: str) -> Iterator[Carrier | None]:
    attributes = {"sagaloop.run_id": run_id, "sagaloop.saga": saga}
    attributes["sagaloop.message_type"] = "start"
    kind = otel.trace.SpanKind.PRODUCER
    with tracer.start_as_current_span(START, kind=kind, attributes=attributes):
        yield otel.inject()


def current() -> Carrier | None:
    """The caller's current trace context (``Client.send_event``, ``cancel``, ``retry``)."""
    on = _on()
    return None if on is None else on[0].inject()


def activation(
    message: Message, run_trace: Carrier | None, saga: str, started_ns: int
) -> AbstractContextManager[Carrier | None]:
    """The span ``sagaloop.activation`` of ``message``'s run, from ``started_ns`` (when the
    engine began to read the run): a child of the run's trace context ``run_trace``, linked to
    the message's own. Yields the context that the messages it sends carry: its own, or, when
    tracing is off, the run's (passed on unchanged)."""
    parent = parent_of(message, run_trace)
    on = _on()
    if on is None:
        return contextlib.nullcontext(parent)
    return _activation(*on, message, parent, saga, started_ns)


@contextlib.contextmanager
def _activation(
    otel: _Otel,
    tracer: Tracer,
    message: Message,
    parent: Carrier | None,
    saga: str,
    started_ns: int,
) -> Iterator[Carrier | None]:
    links = otel.link(message.trace) if message.trace and message.trace != parent else None
    attributes = _attributes(message)
    if saga:
        attributes["sagaloop.saga"] = saga
    with tracer.start_as_current_span(
        ACTIVATION,
        context=otel.extract(parent),
        kind=otel.trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
        start_time=started_ns,
    ):
        yield otel.inject() or parent


def run_trace(given: Carrier | None) -> dict[str, Carrier]:
    """What a ``run_started`` event the engine writes stores as the run's trace context:
    ``given`` (the starting message's), else the current activation's; ``{}`` when there is
    none (the event's data is then what it was before tracing)."""
    if given:
        return {"trace": given}
    on = _on()
    found = None if on is None else on[0].inject()
    return {"trace": found} if found else {}


class Attempt:
    """The span of one step attempt (a no-op when tracing is off)."""

    def __init__(self, span: Span | None = None, otel: _Otel | None = None) -> None:
        self._span = span
        self._otel = otel

    @property
    def recording(self) -> bool:
        """Whether :meth:`done` records anything (else its caller need not build the reply)."""
        return self._span is not None

    def done(self, reply: Mapping[str, Any]) -> None:
        """Record the attempt's outcome: status ERROR when it failed or halted."""
        span, otel = self._span, self._otel
        if span is None or otel is None:
            return
        outcome = reply.get("outcome")
        span.set_attribute("sagaloop.outcome", str(outcome))
        if reply.get("skipped"):
            span.set_attribute("sagaloop.skipped", True)
        if outcome in ("failed", "halted"):
            error = reply.get("error")
            text = None
            if isinstance(error, Mapping):
                text = f"{error.get('type')}: {error.get('message')}"
            span.set_status(otel.trace.Status(otel.trace.StatusCode.ERROR, text))


_OFF = Attempt()


def step_attempt(task: Message) -> AbstractContextManager[Attempt]:
    """The span ``sagaloop.step`` (``sagaloop.compensation`` for an undo) of the attempt that
    ``task`` asks for, current while the attempt runs: a child of the context ``task``
    carries."""
    on = _on()
    return contextlib.nullcontext(_OFF) if on is None else _step_attempt(*on, task)


@contextlib.contextmanager
def _step_attempt(otel: _Otel, tracer: Tracer, task: Message) -> Iterator[Attempt]:
    undo = task.payload.get("direction") == "undo"
    attributes = _attributes(task)
    attributes["sagaloop.step"] = str(task.payload.get("step"))
    attributes["sagaloop.direction"] = "undo" if undo else "do"
    if task.payload.get("in_doubt"):
        attributes["sagaloop.in_doubt"] = True
    with tracer.start_as_current_span(
        COMPENSATION if undo else STEP,
        context=otel.extract(task.trace),
        kind=otel.trace.SpanKind.CONSUMER,
        attributes=attributes,
    ) as span:
        yield Attempt(span, otel)


def failed(exc: BaseException) -> None:
    """Record the exception that failed the current attempt on its span."""
    on = _on()
    if on is not None:
        span = on[0].trace.get_current_span()
        if span.is_recording():
            span.record_exception(exc)


def carried(fn: F) -> F:
    """``fn`` running in the caller's current trace context, on whatever thread calls it (a
    step's pool thread, an async step's own thread): ``fn`` itself when tracing is off."""
    on = _on()
    if on is None:
        return fn
    context = on[0].context
    captured = context.get_current()

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = context.attach(captured)
        try:
            return fn(*args, **kwargs)
        finally:
            context.detach(token)

    return run  # type: ignore[return-value]


def publish(bodies: Sequence[bytes]) -> AbstractContextManager[None]:
    """The span ``sagaloop.relay.publish`` of a batch the relay publishes. When its messages
    all carry the same trace context (the messages of one activation, handed over after its
    commit: the usual case), it is a child of it; otherwise it is a new trace, linked to the
    messages' contexts (at most ``MAX_LINKS``)."""
    on = _on()
    return contextlib.nullcontext() if on is None else _publish(*on, bodies)


@contextlib.contextmanager
def _publish(otel: _Otel, tracer: Tracer, bodies: Sequence[bytes]) -> Iterator[None]:
    found: list[str | None] = []
    for body in bodies:
        own = own_context(body)
        found.append(own[TRACEPARENT] if own is not None else None)
    distinct = list(dict.fromkeys(found))
    parent = clean({TRACEPARENT: distinct[0]}) if len(distinct) == 1 else None
    links: list[Any] = []
    if parent is None:
        for traceparent in distinct[:MAX_LINKS]:
            links += otel.link(clean({TRACEPARENT: traceparent}))
    with tracer.start_as_current_span(
        PUBLISH,
        context=otel.extract(parent),
        kind=otel.trace.SpanKind.PRODUCER,
        attributes={"sagaloop.messages": len(bodies)},
        links=links,
    ):
        yield


def now_ns() -> int:
    """The time, for a span's ``started_ns``."""
    return time.time_ns()


# --- agents: GenAI semantic conventions ------------------------------------------------------


def _recording() -> Span | None:
    on = _on()
    if on is None:
        return None
    span = on[0].trace.get_current_span()
    return span if span.is_recording() else None


def model_call(
    *,
    model: str | None,
    provider: str | None = None,
    response_model: str | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
) -> None:
    """On the current step span: what an agent's model request asked and used."""
    span = _recording()
    if span is None:
        return
    found: dict[str, Any] = {"gen_ai.operation.name": "chat"}
    for key, value in (
        ("gen_ai.request.model", model),
        ("gen_ai.response.model", response_model),
        ("gen_ai.provider.name", provider),
        ("gen_ai.system", provider),
        ("gen_ai.usage.input_tokens", input_tokens),
        ("gen_ai.usage.output_tokens", output_tokens),
    ):
        if value is not None:
            found[key] = value
    span.set_attributes(found)


def tool_call(name: str) -> None:
    """On the current step span: the agent's tool it runs."""
    span = _recording()
    if span is not None:
        span.set_attributes({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name})
