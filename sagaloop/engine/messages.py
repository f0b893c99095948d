"""The message contract: a versioned JSON envelope. Any AMQP client can start runs and send
events by publishing these as JSON; ``sagaloop schema`` prints their JSON Schema."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, Self

import pydantic
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from sagaloop import tracing
from sagaloop.errors import MessageError

VERSION = 1
MAX_MESSAGE_BYTES = 1024 * 1024
MAX_DEPTH = 128
"""Objects and arrays nested deeper than this (the envelope and payload count) are refused."""
CONTENT_TYPE = "application/json"

MessageType = Literal[
    "start",
    "event",
    "cancel",
    "retry",
    "step",
    "step_result",
    "timer",
    "child_start",
    "child_result",
    "undo_run",
    "publish",
    "update",
]
PUBLIC_TYPES = frozenset({"start", "event", "cancel", "retry", "publish", "update"})
"""What anyone allowed to publish to the public exchange may send."""
INTERNAL_TYPES = frozenset(
    {"step", "step_result", "timer", "child_start", "child_result", "undo_run"}
)
"""What only sagaloop's own processes send (a compensation is a ``step`` with direction undo)."""


class Envelope(BaseModel):
    """Every sagaloop message. ``payload`` depends on ``type``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    message_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=200)
    type: MessageType
    run_id: str = Field(min_length=1, max_length=200)
    saga: str | None = None
    position: int | None = None
    attempt: int | None = None
    idempotency_key: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    trace: dict[str, str] | None = Field(
        default=None,
        description=(
            'W3C trace context of the message: {"traceparent": "00-<32 hex>-<16 hex>-<2 hex>", '
            '"tracestate": "..." (optional, at most 512 characters)}. A malformed value is '
            "dropped, never a reason to refuse the message; other keys are ignored."
        ),
        examples=[{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}],
    )

    @field_validator("message_id", "run_id", "saga", "idempotency_key")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return _no_nul(value)

    @field_validator("trace", mode="before")
    @classmethod
    def _trace(cls, value: Any) -> dict[str, str] | None:
        return tracing.clean(value)  # what is not a W3C trace context is dropped, not refused

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def from_bytes(cls, body: bytes, *, limit: int = MAX_MESSAGE_BYTES) -> Envelope:
        if len(body) > limit:
            raise MessageError(f"message of {len(body)} bytes exceeds the limit of {limit}")
        try:
            data = json.loads(body)
        except RecursionError as e:
            raise MessageError("message is not JSON sagaloop accepts: nested too deeply") from e
        except ValueError as e:  # also bad UTF-8, and integers of more than 4300 digits
            raise MessageError(f"message is not JSON: {e}") from e
        if not _plain(body):
            _check_values(data)
        if isinstance(data, dict) and "message_id" not in data:
            # A publisher that sets no id still gets deduplication of redeliveries: the id
            # derives from the bytes, the same on every delivery of the same message.
            data["message_id"] = "sha256:" + hashlib.sha256(body).hexdigest()[:40]
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as e:
            raise MessageError(f"message is not a valid sagaloop envelope: {_short(e)}") from e


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""The JSON escape of a UTF-16 surrogate (``\\ud800`` to ``\\udfff``): in UTF-8 JSON text, the
only way a string can come to hold one (raw surrogate bytes are not UTF-8)."""


def _plain(body: bytes) -> bool:
    """Whether ``body`` (which ``json.loads`` accepted) cannot hold what :func:`_check_values`
    refuses, as byte scans in C can tell: UTF-8 text with no surrogate escape and no more
    ``[`` and ``{`` in all than MAX_DEPTH (nesting past MAX_DEPTH needs more). Saves walking
    every value of every message; a body it cannot clear is walked."""
    return (
        isinstance(body, bytes | bytearray)
        and json.detect_encoding(body).startswith("utf-8")
        and body.count(b"[") + body.count(b"{") <= MAX_DEPTH
        and _SURROGATE_ESCAPE.search(body) is None
    )


def _check_values(data: Any) -> None:
    """Refuse JSON that ``json.loads`` accepts but that could not be stored or sent on, and so
    would fail its transaction for ever: nesting deeper than MAX_DEPTH (the recursion limit is
    near) and strings holding a lone surrogate (``"\\ud800"``: not encodable as UTF-8)."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as e:
                raise MessageError(
                    f"message is not JSON sagaloop accepts: a string holds a lone surrogate ({e})"
                ) from e
        elif isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise MessageError(
                    f"message is not JSON sagaloop accepts: nested deeper than {MAX_DEPTH} levels"
                )
            items = [*value, *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


def derived_id(*parts: object) -> str:
    """The message id ``part:part:...`` of a message whose id derives from others (so that every
    producer of the same message derives the same id). Each part has its ``%`` and ``:``
    escaped (``%25``, ``%3A``), so different parts never join to the same id (``acct:7`` +
    ``reply`` is not ``acct`` + ``7:reply``). One over 200 characters, which a long run id
    makes, keeps its start and ends with a hash of the whole."""
    text = ":".join(str(p).replace("%", "%25").replace(":", "%3A") for p in parts)
    if len(text) <= 200:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{text[:135]}~{digest}"


ENGINE_CONSUMER = "engine"
"""The consumer under which the engine's inbox records the messages it processed."""


def inbox_key(app: str, env: Envelope) -> str:
    """The id under which a consumer's inbox records ``env`` as processed: scoped by app,
    message type and run, so that no id a publisher chooses can collide with another app's,
    another run's or another kind of message's (``derived_id`` keeps it unambiguous)."""
    return derived_id(app, env.type, env.run_id, env.message_id)


def _no_nul(value: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL: such a message would fail its transaction forever.
    if value is not None and "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _short(e: pydantic.ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, x['loc'])) or '(root)'}: {x['msg']}" for x in e.errors())


class StartPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: Any = None


class EventPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    data: Any = None
    key: str | None = Field(default=None, min_length=1, max_length=200)
    """The key of a published event (``Client.publish_event``) delivered to a subscriber: what
    a wait on ``(name, key)`` compares. None for an event sent to the run by id."""

    @field_validator("name", "key")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return _no_nul(value)


class PublishPayload(BaseModel):
    """The payload of a ``publish``: the event ``name`` with its ``data`` (JSON) and optional
    ``key``, for every run subscribed to or waiting on it (the envelope's ``run_id`` is the
    event's id: a publish redelivered, or published again with the same id, is fanned out
    once)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    data: Any = None
    key: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("name", "key")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return _no_nul(value)


class UpdatePayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    data: Any = None
    update_id: str = Field(min_length=1, max_length=200)

    @field_validator("name", "update_id")
    @classmethod
    def _text(cls, value: str) -> str:
        return _no_nul(value) or ""


class CancelPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = None
    now: bool = False
    """Cancel without the saga's ``cancel_grace``: its code is stopped where it waits (a run
    whose concurrency slot another run took must not run its code on), also that of a run
    already ``cancelling`` (``Client.cancel(now=True)``, ``sagaloop cancel --now``)."""


class StartMessage(Envelope):
    """Publish to the engine queue to start a run (a duplicate run_id never starts a second)."""

    type: Literal["start"]
    saga: str
    payload: StartPayload  # type: ignore[assignment]


class EventMessage(Envelope):
    """Publish to the engine queue to deliver an event to a waiting (or future) wait."""

    type: Literal["event"]
    payload: EventPayload  # type: ignore[assignment]


class PublishMessage(Envelope):
    """Publish to the engine queue to publish an event: the engine delivers it, in one
    transaction, to every run subscribed to or waiting on ``(name, key)`` and starts the runs of
    the sagas declared with ``on_event=name``. ``run_id`` is the event's id."""

    type: Literal["publish"]
    payload: PublishPayload  # type: ignore[assignment]


class UpdateMessage(Envelope):
    """Publish to the engine queue to update a run (``ctx.on_update``): its answer is recorded
    in the run's history (``update_completed`` or ``update_refused``, naming ``update_id``).
    Give it the id ``update:{run_id}:{update_id}`` so a retry is applied once."""

    type: Literal["update"]
    payload: UpdatePayload  # type: ignore[assignment]


class Direction(StrEnum):
    """Which way a step message goes: the step itself, or its compensation. A member is its
    string, on the wire and in the store (``sagaloop.engine.contract`` has ``DO``/``UNDO``)."""

    DO = "do"
    UNDO = "undo"


class Outcome(StrEnum):
    """How a step attempt ended, in its ``step_result``."""

    COMPLETED = "completed"
    FAILED = "failed"
    HALTED = "halted"
    """Not run, or given up on: the run is parked until a person retries it."""
    HANDED_OFF = "handed_off"
    """The step's body handed the attempt to an outside system (``ctx.complete_async()``): the
    attempt stays in flight until a ``step_result`` that ``Client.complete_step`` or
    ``Client.fail_step`` sends for its task token (completed or failed), or until the step's
    ``timeout``/``heartbeat_timeout`` fails it (``attempt_timeout`` timer)."""


class InternalPayload(BaseModel):
    """The payload of a message only sagaloop's own processes send: built with the model, put
    on the wire as the keys that were set (:meth:`to_payload`), so its JSON is what a dict
    built by hand gave; read back with :meth:`parse`, which refuses a malformed one with a
    ``MessageError`` as :func:`parse_payload` does. Unknown keys are ignored, not refused: in a
    rolling upgrade a newer engine may add a field, and an older worker must not dead-letter
    its messages for it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    @classmethod
    def parse(cls, env: Envelope) -> Self:
        """The payload of ``env``; ``MessageError`` if it is not one of these."""
        result: Self = parse_payload(cls, env)
        return result

    def to_payload(self) -> dict[str, Any]:
        """The wire form: the fields that were set, in their declared order."""
        return self.model_dump(exclude_unset=True)


class StepTask(InternalPayload):
    """The payload of a ``step`` message: one attempt of a step (``direction`` do) or of its
    compensation (undo). Only the keys the engine sets travel: ``result`` (the step's result,
    or None) with an undo, ``schedule_deadline`` when the step has a ``schedule_to_close``,
    ``force`` when a ``retry`` forces an attempt in doubt to run again."""

    step: str
    direction: Direction = Direction.DO
    args: dict[str, Any] = Field(default_factory=dict)
    in_doubt: bool = False
    result: Any = None
    schedule_deadline: datetime | None = None
    force: bool = False

    @field_serializer("schedule_deadline")
    def _iso(self, value: datetime | None) -> str | None:
        return None if value is None else value.isoformat()  # as the engine always wrote it


class StepReply(InternalPayload):
    """The payload of a ``step_result``: how an attempt ended (``outcome`` completed, failed
    or halted), with the step's JSON ``result`` or the ``error`` (an ``ErrorInfo``'s JSON, which
    a halted reply must have), whether a reconcile found an earlier attempt's effect
    (``reconciled``) or an undo had nothing to undo (``skipped``), and what the attempt took."""

    direction: Direction = Direction.DO
    worker: str | None = None
    outcome: Outcome
    result: Any = None
    reconciled: bool = False
    skipped: bool = False
    error: dict[str, Any] | None = None
    took_s: int | float | None = None

    @model_validator(mode="after")
    def _halted_says_why(self) -> Self:
        if self.outcome == Outcome.HALTED and self.error is None:
            raise ValueError("a halted reply needs its error (an object)")
        return self


class TimerKind(StrEnum):
    """What a run's timer is for: a ``ctx.sleep``, a wait's timeout, the next attempt of a step
    or of its compensation."""

    SLEEP = "sleep"
    WAIT = "wait"
    RETRY = "retry"
    UNDO_RETRY = "undo_retry"
    CANCEL_GRACE = "cancel_grace"
    """The end of a cancelled run's ``cancel_grace`` (its position is ``-1``: no command)."""
    ATTEMPT_TIMEOUT = "attempt_timeout"
    """The end of the step's ``timeout`` (from the attempt's dispatch) or ``heartbeat_timeout``
    (from its hand-off or last ``Client.heartbeat_step``) for an attempt handed off to an
    outside system: if it is still handed off, it fails as a timeout, in doubt."""


class TimerPayload(InternalPayload):
    """The payload of a ``timer`` message (the run and its command's position are the
    envelope's): which of the command's timers fired (``sleep``, ``wait``, ``retry``,
    ``undo_retry``; a kind this engine does not know is stale, and ignored)."""

    kind: str


class ChildStart(InternalPayload):
    """The payload of a ``child_start``: the child run's input, and its parent run (the call's
    position is the envelope's)."""

    input: Any = None
    parent: str


class ChildResult(InternalPayload):
    """The payload of a ``child_result``: how the child run ``child`` ended (its final
    ``status``), with its ``output`` or its ``error`` (an ``ErrorInfo``'s JSON)."""

    child: str
    status: str | None = None
    output: Any = None
    error: dict[str, Any] | None = None


class UndoRun(InternalPayload):
    """The payload of an ``undo_run``: the parent run and the position of its call that asks
    its child run to be undone as a whole."""

    parent: str
    position: int


def step_result(task: Envelope, reply: StepReply | dict[str, Any], now: datetime) -> Envelope:
    """The engine's reply to a step message. Its id derives from the task's, so a reply sent
    again for a redelivered task is recognised by the engine's inbox. (A dict is a reply
    payload built by hand: ``sagaloop.outbox`` still builds its own.)"""
    return Envelope(
        type="step_result",
        message_id=derived_id("result", task.message_id),
        run_id=task.run_id,
        saga=task.saga,
        position=task.position,
        attempt=task.attempt,
        idempotency_key=task.idempotency_key,
        payload=reply.to_payload() if isinstance(reply, StepReply) else reply,
        created_at=now,
        trace=task.trace,  # back to the activation that sent the task (its next one links it)
    )


def parse_payload(model: type[BaseModel], env: Envelope) -> Any:
    try:
        return model.model_validate(env.payload)
    except pydantic.ValidationError as e:
        raise MessageError(f"invalid {env.type} payload: {_short(e)}") from e


def engine_queue(app: str) -> str:
    """The engine's queue of work already started: step results, events, timers, cancels,
    retries and the start of a child run. It goes before :func:`start_queue`."""
    return f"{app}.engine"


def start_queue(app: str) -> str:
    """The engine's queue of new runs (``Client.start``, ``sagaloop start``, a publisher's
    start message): served after :func:`engine_queue`, so that a burst of starts never delays
    the runs in flight."""
    return f"{app}.starts"


def step_queue(app: str, queue: str) -> str:
    return f"{app}.steps.{queue}"


LOCAL_SUFFIX = "/local"
"""Ends the name of an app's in-process lane. A ``/`` is in no app or queue name, so no other
queue ends this way."""


def local_queue(app: str) -> str:
    """The in-process lane of ``app``: the outbox rows of its ``local=True`` steps. Only its
    engine processes consume it, from the database; no relay publishes it to a broker."""
    return f"{app}{LOCAL_SUFFIX}"
