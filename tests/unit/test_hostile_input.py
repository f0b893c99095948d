"""Hostile input: whatever arrives on a queue or on the command line is refused with a reason
(a dead letter, or a one-line error and a non-zero exit), never crashes a consumer, never loses
valid work, and never prints a credential.

The fuzz tests publish junk to the engine queue and to a step queue of a Harness app, then a
valid run through the public message contract, and account for every message from the outside:
dead-lettered with a reason, or (a well-formed message that is merely a duplicate or addressed
to a finished run) ignored without touching the finished run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cli_env import cli_database, run
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from sagaloop import App, Client, SagaContext, StepContext
from sagaloop.cli.main import cli
from sagaloop.engine import history as hist
from sagaloop.engine.messages import (
    MAX_DEPTH,
    MAX_MESSAGE_BYTES,
    Envelope,
    StepReply,
    StepTask,
    engine_queue,
    step_queue,
)
from sagaloop.errors import (
    EventTimeoutError,
    MessageError,
    RunFinishedError,
    RunNotFoundError,
    ValidationError,
)
from sagaloop.testing.harness import Harness

app = App("hostile")
EQ = engine_queue("hostile")
SQ = step_queue("hostile", "q")
ORDER = {"id": "o-1", "cents": 250}
FINISHED = "finished-run"
LATE_REPLY = {"direction": "do", "outcome": "completed", "result": 250}
VALID = "valid-run"
SECRET = "hunter2"


class Order(BaseModel):
    id: str
    cents: int


@app.step(queue="q")
def charge(ctx: StepContext, order: Order) -> int:
    return order.cents


@app.saga(name="pay")
async def pay(ctx: SagaContext, order: Order) -> int:
    await ctx.wait_for_event("go")
    return await ctx.call(charge, order)


@app.saga(name="measure")
async def measure(ctx: SagaContext, text: str) -> int:
    return await ctx.call(charge, Order(id="big", cents=len(text)))


@app.saga(name="patient")
async def patient(ctx: SagaContext, n: int) -> int:
    await ctx.sleep(timedelta(minutes=5))
    with contextlib.suppress(EventTimeoutError):
        await ctx.wait_for_event("never", timeout=timedelta(minutes=5))
    return await ctx.call(charge, Order(id="p", cents=n))


# --- helpers ---------------------------------------------------------------------------------


def harness(broker: str = "database") -> Harness:
    """A harness holding one finished run, the target of stale messages."""
    h = Harness(app, broker=broker)  # type: ignore[arg-type]
    h.start(pay, ORDER, run_id=FINISHED)
    h.run_until_idle()
    h.send_event(FINISHED, "go")
    h.run_until_idle()
    assert h.get(FINISHED).status == "completed"
    return h


def contract(**fields: Any) -> bytes:
    """A message as any AMQP client would publish it (plain JSON, no sagaloop code)."""
    return json.dumps(fields).encode()


def valid_start(run_id: str = VALID, saga: str = "pay", value: Any = None) -> bytes:
    return contract(
        type="start",
        run_id=run_id,
        saga=saga,
        message_id=f"{run_id}-start",
        payload={"input": ORDER if value is None else value},
    )


def go(run_id: str = VALID) -> bytes:
    return contract(type="event", run_id=run_id, payload={"name": "go", "data": None})


def dead(h: Harness) -> list[tuple[str, bytes, str]]:
    if h.broker.uses_outbox:
        return h.store.dead_letters()
    return list(h.broker.dead)  # type: ignore[attr-defined]


def drain(h: Harness) -> None:
    """Process until idle; a poison message (retried for ever) fails here instead of hanging."""
    h.run_until_idle(max_steps=5_000)


def snapshot(h: Harness, run_id: str) -> tuple[str, Any, int]:
    run = h.get(run_id)
    return run.status, run.output, len(h.history(run_id))


@contextlib.contextmanager
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """ERROR records of sagaloop's loggers: an unexpected exception in a consumer logs one."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("sagaloop")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def as_envelope(body: bytes) -> Envelope | None:
    try:
        return Envelope.from_bytes(body)
    except MessageError:
        return None


# --- strategies ------------------------------------------------------------------------------

TYPES = ["start", "event", "cancel", "retry", "step", "step_result", "timer"]
FIELDS = [
    "v",
    "message_id",
    "type",
    "run_id",
    "saga",
    "position",
    "attempt",
    "idempotency_key",
    "payload",
    "created_at",
    "trace",
]
texts = st.text(st.characters(exclude_categories=()), max_size=20)  # lone surrogates too
ids = st.text(min_size=1, max_size=40)
json_leaves = (
    st.none() | st.booleans() | st.integers() | st.floats() | texts | st.sampled_from(FIELDS)
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
junk_dicts = st.dictionaries(texts | st.sampled_from(FIELDS), json_values, max_size=6)
run_ids = st.sampled_from([FINISHED, "no-such-run"]) | ids
maybe = st.none
payloads: dict[str, st.SearchStrategy[Any]] = {
    "start": st.fixed_dictionaries({"input": st.just(ORDER) | json_values}) | junk_dicts,
    "event": st.fixed_dictionaries({"name": st.just("go") | texts, "data": json_values})
    | junk_dicts,
    "cancel": st.fixed_dictionaries({}, optional={"reason": texts | json_values}) | junk_dicts,
    "retry": st.just({}) | junk_dicts,
    "step": st.fixed_dictionaries(
        {"step": st.sampled_from(["charge", "nope"]) | texts},
        optional={
            "args": json_values | st.just({"order": ORDER}),
            "direction": st.sampled_from(["do", "undo"]) | texts,
            "in_doubt": st.booleans(),
            "force": st.booleans(),
            "result": json_values,
        },
    ),
    "step_result": st.fixed_dictionaries(
        {},
        optional={
            "outcome": st.sampled_from(["completed", "failed", "halted"]) | texts,
            "direction": st.sampled_from(["do", "undo"]) | texts,
            "error": json_values | st.fixed_dictionaries({"type": texts, "message": texts}),
            "result": json_values,
            "worker": json_values,
        },
    ),
    "timer": st.fixed_dictionaries(
        {}, optional={"kind": st.sampled_from(["sleep", "wait", "retry", "undo_retry"]) | texts}
    ),
}


@st.composite
def envelope_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """Messages of the right shape, with junk where the contract leaves room for it."""
    kind = draw(st.sampled_from(TYPES))
    optional = {
        "v": draw(maybe() | st.just(1)),
        "message_id": draw(maybe() | ids | st.just(f"start:{FINISHED}")),
        "saga": draw(maybe() | st.sampled_from(["pay", "measure", "nope"]) | texts),
        "position": draw(maybe() | st.integers(-2, 6)),
        "attempt": draw(maybe() | st.integers(-1, 4)),
        "idempotency_key": draw(maybe() | texts),
        "created_at": draw(maybe() | st.sampled_from(["2026-01-01T00:00:00Z", "yesterday"])),
        "trace": draw(maybe() | st.dictionaries(texts, texts, max_size=2)),
    }
    message = {"type": kind, "run_id": draw(run_ids), "payload": draw(payloads[kind])}
    message.update({k: v for k, v in optional.items() if v is not None})
    return message


wrong_types = st.builds(
    lambda base, override: {**base, **override},
    envelope_dicts(),
    st.dictionaries(st.sampled_from(FIELDS), json_values, min_size=1, max_size=3),
)


def encode(value: Any, ascii_only: bool) -> bytes:
    # Not ASCII-only, a lone surrogate becomes bytes that are not UTF-8.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(encode, json_values, st.booleans()),
    st.builds(encode, junk_dicts, st.booleans()),
    st.builds(encode, wrong_types, st.booleans()),
    st.builds(encode, envelope_dicts(), st.booleans()),
).filter(lambda body: VALID.encode() not in body)  # never addressed to the valid run

hostile = st.lists(st.tuples(st.sampled_from([EQ, SQ]), bodies), min_size=1, max_size=6)


def account(h: Harness, messages: list[tuple[str, bytes]], before: set[tuple[str, str]]) -> None:
    """Each message was dead-lettered with a reason, or was a well-formed message that is a
    duplicate or was addressed to an existing run (and so was harmlessly ignored)."""
    letters = dead(h)
    for _, _, reason in letters:
        assert isinstance(reason, str) and reason.strip(), letters
    assert not [d for d in letters if VALID.encode() in d[1]], "a valid message was refused"
    unused = Counter((queue, body) for queue, body, _ in letters)
    replies: Counter[tuple[str, int | None, int | None]] = Counter()
    for queue, body, _ in letters:
        env = as_envelope(body) if queue == EQ else None
        if env is not None and env.type == "step_result":
            replies[(env.run_id, env.position, env.attempt)] += 1
    ids_per_queue = Counter(
        (queue, env.message_id)
        for queue, body in messages
        if (env := as_envelope(body)) is not None
    )
    for queue, body in messages:
        if unused[(queue, body)]:
            unused[(queue, body)] -= 1
            continue
        env = as_envelope(body)
        assert env is not None, f"{body!r} on {queue} was neither dead-lettered nor valid"
        if queue == SQ and replies[(env.run_id, env.position, env.attempt)]:
            replies[(env.run_id, env.position, env.attempt)] -= 1  # its reply was dead-lettered
            continue
        if queue == SQ:
            assert env.type == "step", f"{body!r} reached a worker and was not refused"
        duplicate = (queue, env.message_id) in before or ids_per_queue[(queue, env.message_id)] > 1
        assert duplicate or h.store.get_run(env.run_id) is not None, (
            f"{body!r} on {queue} was accepted for a run that does not exist"
        )


# --- fuzz ------------------------------------------------------------------------------------


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(messages=hostile, split=st.integers(0, 6))
def test_junk_on_every_queue_is_refused_and_the_valid_run_completes(
    messages: list[tuple[str, bytes]], split: int
) -> None:
    h = harness()
    try:
        finished = snapshot(h, FINISHED)
        before = {(EQ, f"start:{FINISHED}")}  # in the engine's inbox already
        with errors_logged() as errors:
            for queue, body in messages[:split]:
                h.broker.publish_raw(queue, body)  # type: ignore[attr-defined]
            h.broker.publish_raw(EQ, valid_start())  # type: ignore[attr-defined]
            for queue, body in messages[split:]:
                h.broker.publish_raw(queue, body)  # type: ignore[attr-defined]
            drain(h)
            h.broker.publish_raw(EQ, go())  # type: ignore[attr-defined]
            drain(h)
        assert not errors, [r.getMessage() for r in errors]
        assert h.get(VALID).status == "completed" and h.get(VALID).output == ORDER["cents"]
        assert snapshot(h, FINISHED) == finished, "a stale message changed a finished run"
        assert h.store.queue_depths() == {}, "a message is stuck"
        account(h, messages, before)
    finally:
        h.close()


JSON_TYPES = {None, "application/json"}
content_types = st.one_of(
    st.sampled_from(
        [None, "application/json", "text/plain", "application/x-python-pickle", "", "JSON"]
    ),
    # A JSON type with parameters ("; charset=...") is left out: see the report on it.
    st.text(max_size=30).filter(lambda t: not t.lower().startswith("application/json")),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(
        st.tuples(
            st.sampled_from([EQ, SQ]),
            st.sampled_from(["start", "event", "junk"]),
            content_types,
        ),
        min_size=1,
        max_size=6,
    )
)
def test_only_json_is_deserialized(messages: list[tuple[str, str, str | None]]) -> None:
    h = harness(broker="memory")
    try:
        finished = snapshot(h, FINISHED)
        sent: list[tuple[str, bytes, str | None, str]] = []
        with errors_logged() as errors:
            for i, (queue, kind, content_type) in enumerate(messages):
                run_id = f"ct-{i}"
                body = {
                    "start": valid_start(run_id),
                    "event": go(FINISHED),
                    "junk": b"\x80 not json",
                }[kind]
                h.broker.publish_raw(queue, body, content_type)  # type: ignore[attr-defined]
                sent.append((queue, body, content_type, run_id))
            h.broker.publish_raw(EQ, valid_start())  # type: ignore[attr-defined]
            drain(h)
            h.broker.publish_raw(EQ, go())  # type: ignore[attr-defined]
            drain(h)
        assert not errors, [r.getMessage() for r in errors]
        letters = dead(h)

        def take(queue: str, body: bytes, reason: str) -> None:
            for letter in letters:
                if letter[:2] == (queue, body) and reason in letter[2]:
                    letters.remove(letter)
                    return
            raise AssertionError(f"no dead letter for {body!r} on {queue} with {reason!r}")

        for queue, body, content_type, run_id in sent:
            if content_type not in JSON_TYPES:
                take(queue, body, "content type")
                assert h.store.get_run(run_id) is None, "a message not sent as JSON was read"
        for queue, body, content_type, run_id in sent:
            if content_type not in JSON_TYPES:
                continue
            if queue == EQ and body == valid_start(run_id):
                assert h.store.get_run(run_id) is not None, "a valid start sent as JSON was lost"
            elif queue == EQ and body == go(FINISHED):
                pass  # an event for a finished run: ignored
            else:  # junk, or a start or an event sent to a worker
                take(queue, body, "")
        assert not letters, "a valid message was dead-lettered"
        assert h.get(VALID).status == "completed"
        assert snapshot(h, FINISHED) == finished
    finally:
        h.close()


# --- specific hostile messages ---------------------------------------------------------------


@pytest.fixture
def h() -> Iterator[Harness]:
    h = harness()
    try:
        yield h
    finally:
        h.close()


def publish_and_drain(h: Harness, queue: str, body: bytes, *, trusted: bool = False) -> str | None:
    """Publish one message, process everything; the reason if it was dead-lettered.
    ``trusted``: as if sagaloop wrote it (an internal message that is not is refused first)."""
    count = len(dead(h))
    h.broker.publish_raw(queue, body, trusted=trusted)  # type: ignore[attr-defined]
    drain(h)
    letters = dead(h)[count:]
    assert len(letters) <= 1, letters
    return letters[0][2] if letters else None


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


NESTED = nested(MAX_DEPTH)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[" * 100_000, ["nested too deeply"]),  # json.loads raised RecursionError
        (
            contract(type="event", run_id=FINISHED, payload={"name": "go", "data": NESTED}),
            ["deeper"],
        ),
        (b'{"type": "event", "run_id": "x", "payload": {"name": "\\ud800"}}', ["surrogate"]),
        (b'{"type": "event", "run_id": "x", "position": ' + b"9" * 5000 + b"}", ["JSON"]),
        (b"\xff\xfe\x00garbage", ["not JSON"]),
        (b"null", ["envelope"]),
        (b"[]", ["envelope"]),
        (contract(type="step", run_id="r"), ["not for the engine"]),
        (contract(type="telepathy", run_id="r"), ["type"]),
        (contract(type="event", run_id="", payload={"name": "go"}), ["run_id"]),
        (contract(type="event", run_id="r" * 201, payload={"name": "go"}), ["run_id"]),
        (contract(type="event", run_id="a\x00b", payload={"name": "go"}), ["run_id", "NUL"]),
        (
            contract(type="event", run_id=FINISHED, message_id="m\x00", payload={"name": "x"}),
            ["NUL"],
        ),
        (contract(type="event", run_id=FINISHED, payload={"name": "go\x00"}), ["name", "NUL"]),
        (contract(type="event", run_id=FINISHED, payload={"name": "x" * 201}), ["name"]),
        (contract(type="event", run_id=FINISHED, payload={"nom": "go"}), ["payload", "name"]),
        (contract(type="start", run_id="s", saga="pay", payload=[]), ["payload"]),
        (contract(type="start", run_id="s", saga="pay", extra=1), ["extra"]),
        (contract(type="start", run_id="s", saga="pay", position="1st"), ["position"]),
        (contract(type="start", run_id="s", saga="pay", v=2), ["v"]),
        (contract(type="step_result", run_id=FINISHED), ["position and attempt"]),
        (contract(type="timer", run_id=FINISHED), ["position"]),
    ],
)
def test_a_bad_engine_message_is_dead_lettered_with_a_reason(
    h: Harness, body: bytes, words: list[str]
) -> None:
    finished = snapshot(h, FINISHED)
    with errors_logged() as errors:
        reason = publish_and_drain(h, EQ, body, trusted=True)
    assert reason is not None, "not dead-lettered"
    for word in words:
        assert word in reason, reason
    assert not errors
    assert snapshot(h, FINISHED) == finished


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"\x00\x01", ["not JSON"]),
        (contract(type="event", run_id="r", payload={"name": "go"}), ["not for a worker"]),
        (contract(type="step", run_id="r", payload={"step": "nope"}), ["unknown step 'nope'"]),
        (contract(type="step", run_id="r", payload={"step": ["x"]}), ["invalid step", "step"]),
        (contract(type="step", run_id="r", payload={}), ["invalid step payload", "step"]),
    ],
)
def test_a_bad_step_message_is_dead_lettered_with_a_reason(
    h: Harness, body: bytes, words: list[str]
) -> None:
    reason = publish_and_drain(h, SQ, body, trusted=True)
    assert reason is not None
    for word in words:
        assert word in reason, reason


@pytest.mark.parametrize(
    ("queue", "body"),
    [
        (EQ, contract(type="step_result", run_id=FINISHED, position=2, attempt=1, payload={})),
        (EQ, contract(type="timer", run_id=FINISHED, position=1, payload={"kind": "wait"})),
        (EQ, contract(type="step", run_id=FINISHED)),
        (SQ, contract(type="step", run_id="r", payload={"step": "charge", "args": {}})),
        (SQ, contract(type="step", run_id="r", payload={"step": "charge", "direction": "undo"})),
    ],
)
def test_an_internal_message_sagaloop_did_not_send_is_refused_before_its_inbox(
    h: Harness, queue: str, body: bytes
) -> None:
    """Issue 10, defect 4: a step, step result or timer from outside sagaloop's processes
    (see tests/integration/test_forgery.py for the same through plain pika on RabbitMQ)."""
    finished, inbox = snapshot(h, FINISHED), inbox_rows(h)
    reason = publish_and_drain(h, queue, body)
    assert reason is not None and "not signed by sagaloop" in reason, reason
    assert snapshot(h, FINISHED) == finished
    assert inbox_rows(h) == inbox, "a refused message must not occupy an inbox id"


def inbox_rows(h: Harness) -> int:
    with h.store.engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT count(*) FROM sagaloop_inbox").scalar_one())


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"step": "charge", "args": [1]}, "args"),
        ({"step": "charge", "args": {}, "direction": "sideways"}, "direction"),
        ({"step": "charge", "args": {}, "in_doubt": {"no": 1}}, "in_doubt"),
        ({"step": "charge", "args": {}, "schedule_deadline": "soon"}, "schedule_deadline"),
    ],
)
def test_a_step_message_with_a_wrong_typed_field_is_dead_lettered_and_the_worker_goes_on(
    h: Harness, payload: dict[str, Any], field: str
) -> None:
    """The worker refuses it as it refuses any malformed message (no attempt, no reply, no
    crashed thread), naming the field; the next run's step is served as usual."""
    body = contract(type="step", run_id="r", position=1, attempt=1, payload=payload)
    with errors_logged() as errors:
        reason = publish_and_drain(h, SQ, body, trusted=True)
    assert reason is not None and "invalid step payload" in reason and field in reason, reason
    assert not errors
    run_id = h.start(measure, "abc")
    drain(h)
    assert h.get(run_id).status == "completed" and h.result(run_id) == 3


def test_internal_payloads_ignore_unknown_keys() -> None:
    """A rolling upgrade: a newer engine's extra field does not dead-letter an older worker's
    message, nor a newer worker's an older engine's reply; nothing else of it is changed."""
    task = contract(type="step", run_id="r", payload={"step": "charge", "new_field": {"x": 1}})
    assert StepTask.parse(Envelope.from_bytes(task)).to_payload() == {"step": "charge"}
    reply = {"outcome": "completed", "result": 3, "new_field": True}
    parsed = StepReply.parse(Envelope(type="step_result", run_id="r", payload=reply))
    assert parsed.to_payload() == {"outcome": "completed", "result": 3}


def test_a_malformed_step_result_for_a_step_in_flight_is_dead_lettered(h: Harness) -> None:
    """It used to raise AttributeError in the engine, which retried it every second for ever."""
    for i, payload in enumerate(
        [{"outcome": "failed", "error": "boom"}, {"outcome": "halted"}, {"error": [1]}]
    ):
        run_id = f"in-flight-{i}"
        h.start(pay, ORDER, run_id=run_id)
        drain(h)
        h.send_event(run_id, "go")
        for delivery in h.broker.receive([EQ], 1, 0):  # the engine only: the step is in flight
            h._engine_consumer.process(delivery)
        [pos] = [e.pos for e in h.history(run_id) if e.kind == hist.STEP_SCHEDULED]
        forged = contract(
            type="step_result", run_id=run_id, position=pos, attempt=1, payload=payload
        )
        with errors_logged() as errors:
            h.broker.publish_raw(EQ, forged, trusted=True)  # type: ignore[attr-defined]
            for delivery in h.broker.receive([EQ], 1, 0):
                h._engine_consumer.process(delivery)
        assert not errors
        reason = dead(h)[-1][2]
        assert dead(h)[-1][1] == forged and "invalid step_result payload" in reason
        assert "error" in reason, reason  # says which field is wrong
        drain(h)  # the real step result arrives: the run goes on
        assert h.get(run_id).status == "completed"


def test_a_start_over_the_size_limit_is_dead_lettered_naming_the_limit(h: Harness) -> None:
    body = valid_start("too-big", saga="measure", value="x" * MAX_MESSAGE_BYTES)
    assert len(body) > MAX_MESSAGE_BYTES
    reason = publish_and_drain(h, EQ, body)
    assert reason is not None and str(MAX_MESSAGE_BYTES) in reason and "limit" in reason
    assert h.store.get_run("too-big") is None


def test_a_large_input_under_the_limit_works(h: Harness) -> None:
    text = "é" * (MAX_MESSAGE_BYTES // 8)  # escaped in JSON: 6 bytes each
    body = valid_start("large", saga="measure", value=text)
    assert MAX_MESSAGE_BYTES * 0.6 < len(body) < MAX_MESSAGE_BYTES
    assert publish_and_drain(h, EQ, body) is None
    assert h.get("large").status == "completed" and h.get("large").output == len(text)


def test_deep_but_allowed_nesting_is_accepted(h: Harness) -> None:
    h.start(pay, ORDER, run_id="deep")
    drain(h)
    body = contract(type="event", run_id="deep", payload={"name": "go", "data": nested(100)})
    assert publish_and_drain(h, EQ, body) is None
    assert h.get("deep").status == "completed"


def test_the_client_refuses_a_message_over_the_limit_and_writes_nothing(h: Harness) -> None:
    """Before, the run was created and its start message dead-lettered: a run that never ran."""
    big = "x" * MAX_MESSAGE_BYTES
    with pytest.raises(ValidationError, match=f"limit of {MAX_MESSAGE_BYTES}"):
        h.start(measure, big, run_id="too-big")
    assert h.store.get_run("too-big") is None
    h.start(pay, ORDER, run_id="waits")
    drain(h)
    waiting = snapshot(h, "waits")
    with pytest.raises(ValidationError, match=f"limit of {MAX_MESSAGE_BYTES}"):
        h.send_event("waits", "go", big)
    assert h.store.queue_depths() == {}
    assert snapshot(h, "waits") == waiting


def test_a_saga_input_of_the_wrong_shape_is_dead_lettered_naming_the_field(h: Harness) -> None:
    reason = publish_and_drain(h, EQ, valid_start("bad", value={"id": "1", "cents": "lots"}))
    assert reason is not None and "cents" in reason and "pay" in reason
    reason = publish_and_drain(h, EQ, valid_start("bad", value={"id": "1"}))
    assert reason is not None and "cents" in reason
    run = h.store.get_run("bad")  # the run says why it never started, instead of hanging
    assert run is not None and run.status == "failed" and run.error is not None
    assert "cents" in run.error["message"] and "lots" not in str(run.input)


def test_a_start_for_an_unknown_saga_is_dead_lettered(h: Harness) -> None:
    reason = publish_and_drain(h, EQ, valid_start("who", saga="nope"))
    assert reason is not None and "unknown saga 'nope'" in reason
    run = h.store.get_run("who")
    assert run is not None and run.status == "failed" and run.error is not None
    assert "unknown saga 'nope'" in run.error["message"]


def test_an_event_for_an_unknown_run_is_dead_lettered(h: Harness) -> None:
    reason = publish_and_drain(h, EQ, go("no-such-run"))
    assert reason is not None and "no run with id 'no-such-run'" in reason


def test_stale_messages_for_a_finished_run_are_ignored(h: Harness) -> None:
    finished = snapshot(h, FINISHED)
    stale = [
        go(FINISHED),
        contract(type="cancel", run_id=FINISHED, payload={"reason": "late"}),
        contract(type="retry", run_id=FINISHED),
        contract(type="timer", run_id=FINISHED, position=1, payload={"kind": "wait"}),
        contract(  # (a malformed one is refused as malformed: see above)
            type="step_result", run_id=FINISHED, position=2, attempt=1, payload=LATE_REPLY
        ),
        valid_start(FINISHED),  # a duplicate start
    ]
    with errors_logged() as errors:
        for body in stale:
            assert publish_and_drain(h, EQ, body, trusted=True) is None
    assert not errors
    assert snapshot(h, FINISHED) == finished


def test_long_run_ids_work(h: Harness) -> None:
    """Message ids derive from the run id; with a run id of 190 to 200 characters they went past
    the 200-character limit: the engine failed on the run for ever, or Client.start raised a
    raw pydantic error."""
    for n in (180, 190, 200):
        run_id = "r" * n
        h.start(patient, n, run_id=run_id)
        drain(h)
        assert h.get(run_id).status == "completed" and h.get(run_id).output == n
    with pytest.raises(ValidationError, match="run_id must be 1 to 200"):
        h.start(patient, 1, run_id="r" * 201)


def test_the_client_refuses_events_for_unknown_and_finished_runs(h: Harness) -> None:
    with pytest.raises(RunNotFoundError, match="no run with id 'nope'"):
        h.send_event("nope", "go")
    with pytest.raises(RunFinishedError, match=f"run '{FINISHED}' is already completed"):
        h.send_event(FINISHED, "go")
    assert h.store.queue_depths() == {}


# --- the command line ------------------------------------------------------------------------

CLI_APP = textwrap.dedent(
    """
    from sagaloop import App, SagaContext, StepContext

    app = App("hostile_cli")

    @app.step(queue="q")
    def step(ctx: StepContext, n: int) -> int:
        return n

    @app.saga(name="s")
    async def s(ctx: SagaContext, n: int) -> int:
        await ctx.wait_for_event("go")
        return await ctx.call(step, n)

    @app.saga(name="text")
    async def text(ctx: SagaContext, text: str) -> int:
        return len(text)
    """
)


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return cli_database(tmp_path, monkeypatch, "hostile_cli", CLI_APP)


def written(path: Path) -> tuple[int, int, int]:
    """Runs, queued messages and history events in the CLI's database."""
    from sagaloop.store.sql import SqlStore

    store = SqlStore(f"sqlite:///{path}")
    try:
        runs = store.list_runs(limit=10_000)
        events = sum(len(store.load_history(None, r.run_id)) for r in runs)
        return len(runs), sum(store.queue_depths().values()), events
    finally:
        store.close()


def assert_one_line_error(result: Result, *words: str) -> None:
    assert result.exit_code != 0, result.output
    lines = [x for x in result.output.strip().splitlines() if x.startswith("Error")]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], result.output


def test_cli_send_event_to_an_unknown_or_finished_run_is_one_line(db: Path) -> None:
    from sagaloop.store.sql import SqlStore

    store = SqlStore(f"sqlite:///{db}")
    done = Client(store, "hostile_cli")
    run_id = done.start("s", 1)
    with store.transaction() as tx:  # finish it by hand: the CLI needs no engine for this
        record = store.lock_run(tx, run_id)
        assert record is not None
        record.status = "completed"
        store.save_run(tx, record)
    store.close()
    before = written(db)
    assert_one_line_error(run("send-event", "nope", "go"), "no run with id 'nope'")
    assert_one_line_error(run("send-event", run_id, "go"), "already completed")
    assert written(db) == before


LONG = "x" * 300


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["worker", "--app", "hostile_cli", "--queue", "q", "--concurrency", "0"], ["0"]),
        (["dev", "--app", "hostile_cli", "--concurrency", "0"], ["--concurrency"]),
        (["dev", "--app", "hostile_cli", "--concurrency", "100000"], ["--concurrency"]),
        (["list", "--limit", "-1"], ["--limit", "-1"]),
        (["list", "--limit", "0"], ["--limit"]),
        (["engine", "--app", "hostile_cli", "--poll", "0"], ["--poll"]),
        (["worker", "--app", "hostile_cli", "--queue", "q", "--poll", "0"], ["--poll"]),
        (["dev", "--app", "hostile_cli", "--poll", "-1"], ["--poll"]),
        (["health", "--max-outbox-age", "-1"], ["--max-outbox-age"]),
        (["send-event", "RUN", LONG], ["event name must be 1 to 200 characters"]),
        (["send-event", "RUN", ""], ["event name must be 1 to 200 characters"]),
        (["send-event", "RUN", "go", "--data", "[1,"], ["not valid JSON"]),
        (["send-event", "RUN", "go", "--data", json.dumps("x" * MAX_MESSAGE_BYTES)], ["limit"]),
        (["send-event", LONG, "go"], ["run_id must be 1 to 200 characters"]),
        (["status", LONG], ["run_id must be 1 to 200 characters"]),
        (["cancel", LONG], ["run_id must be 1 to 200 characters"]),
        (["retry", LONG], ["run_id must be 1 to 200 characters"]),
        (["start", "s", "--input", "1", "--run-id", LONG, "--app", "hostile_cli"], ["run_id"]),
        (["start", "s", "--input", '"one"', "--app", "hostile_cli"], ["input", "int"]),
        (
            [
                "start",
                "text",
                "--input",
                json.dumps("x" * MAX_MESSAGE_BYTES),
                "--app",
                "hostile_cli",
            ],
            ["limit"],
        ),
    ],
)
def test_cli_arguments_out_of_range_are_refused_and_write_nothing(
    db: Path, args: list[str], words: list[str]
) -> None:
    from sagaloop.store.sql import SqlStore

    store = SqlStore(f"sqlite:///{db}")
    run_id = Client(store, "hostile_cli").start("s", 1)  # running, waiting for "go"
    store.close()
    args = [run_id if a == "RUN" else a for a in args]
    before = written(db)
    result = run(*args)
    assert_one_line_error(result, *words)
    assert written(db) == before


# --- credentials -----------------------------------------------------------------------------

DB_WITH_SECRET = f"postgresql://u:{SECRET}@127.0.0.1:1/x"
DB_WITH_SECRET_IN_QUERY = f"postgresql://u@127.0.0.1:1/x?password={SECRET}&sslmode=disable"
BROKER_WITH_SECRET = f"amqp://u:{SECRET}@127.0.0.1:1/"


def assert_no_secret(result: Result, caplog: pytest.LogCaptureFixture) -> None:
    assert SECRET not in result.output
    assert SECRET not in (result.stderr or "")
    formatter = logging.Formatter()
    for record in caplog.records:
        assert SECRET not in formatter.format(record), record.getMessage()


@pytest.mark.parametrize("database_url", [DB_WITH_SECRET, DB_WITH_SECRET_IN_QUERY])
@pytest.mark.parametrize(
    "args",
    [
        ["list"],
        ["status", "r1"],
        ["start", "s", "--input", "1", "--app", "hostile_cli"],
        ["send-event", "r1", "go"],
        ["cancel", "r1"],
        ["retry", "r1"],
        ["db", "upgrade"],
        ["health"],
        ["health", "--json"],
    ],
)
def test_no_password_when_the_database_is_unreachable(
    db: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    database_url: str,
    args: list[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", database_url)
    monkeypatch.setenv("SAGALOOP_BROKER_URL", BROKER_WITH_SECRET)
    result = CliRunner().invoke(cli, ["-v", *args])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "127.0.0.1:1" in result.output, "the error names the database"
    assert_no_secret(result, caplog)


def test_no_password_when_the_broker_is_unreachable(
    db: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("SAGALOOP_BROKER_URL", BROKER_WITH_SECRET)
    result = CliRunner().invoke(cli, ["-v", "health", "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["database"] == "ok" and report["broker"].startswith("error")
    assert "u:***@127.0.0.1:1" in report["broker"]
    assert_no_secret(result, caplog)


def test_an_unparsable_broker_url_is_one_line_without_the_password(
    db: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """pika's ValueError used to escape as a traceback."""
    monkeypatch.setenv("SAGALOOP_BROKER_URL", f"amqp://u:{SECRET}@127.0.0.1:port/")
    result = CliRunner().invoke(cli, ["health", "--json"])
    assert result.exit_code == 1
    assert "invalid SAGALOOP_BROKER_URL" in json.loads(result.stdout)["broker"]
    assert_no_secret(result, caplog)


def test_services_keep_the_password_out_of_their_logs(db: Path, tmp_path: Path) -> None:
    """`sagaloop engine` waiting for an unreachable database and `sagaloop worker` waiting for
    an unreachable broker: both log that they retry, never the password."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    cases = {
        "engine": ({"SAGALOOP_DATABASE_URL": DB_WITH_SECRET}, ["engine"]),
        "worker": (
            {"SAGALOOP_DATABASE_URL": f"sqlite:///{db}", "SAGALOOP_BROKER_URL": BROKER_WITH_SECRET},
            ["worker", "--queue", "q"],
        ),
    }
    expected = {  # what each logs once it has retried a few times
        "engine": "database postgresql://u:***@127.0.0.1:1/x unavailable",
        "worker": "connecting to amqp://u:***@127.0.0.1:1/ failed",
    }
    logs = {name: tmp_path / f"{name}.log" for name in cases}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, (extra, args) in cases.items():
            with logs[name].open("wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "sagaloop", "-v", *args, "--app", "hostile_cli"],
                    env={**env, **extra},
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

        def retried() -> bool:
            return all(logs[n].read_text().count(expected[n]) >= 3 for n in cases)

        deadline = time.monotonic() + 30
        while not retried():
            assert time.monotonic() < deadline, {n: logs[n].read_text()[-3000:] for n in cases}
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} gave up:\n{logs[name].read_text()}"
            time.sleep(0.1)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    for name, path in logs.items():
        assert SECRET not in path.read_text(), f"{name} printed the password"


def test_a_message_without_an_id_is_deduplicated_by_its_bytes() -> None:
    from sagaloop.engine.messages import Envelope

    body = b'{"type": "event", "run_id": "r-1", "payload": {"name": "go"}}'
    assert Envelope.from_bytes(body).message_id == Envelope.from_bytes(body).message_id
    other = b'{"type": "event", "run_id": "r-1", "payload": {"name": "stop"}}'
    assert Envelope.from_bytes(other).message_id != Envelope.from_bytes(body).message_id
