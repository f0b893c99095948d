"""Dead letters as an operator manages them: listed, shown, sent again, purged.

Each broker keeps its dead letters its own way (RabbitMQ: the queue ``<namespace>.dead``; the
database broker: the table ``sagaloop_dead_letters``; the memory broker: a list) and implements
:class:`DeadLetters` over them; ``BrokerContract`` (``sagaloop.testing.contracts``) checks the
three alike. ``sagaloop dead-letters`` and ``sagaloop health`` use nothing else.

Sending a dead letter again publishes its body unchanged, so its envelope keeps its
``message_id`` and the consumer's inbox still recognises a message it already processed. It
keeps its trust too: an internal message (step, step result, timer) comes back as sagaloop's
only if it was sagaloop's when it was dead-lettered, so resending everything never lets a
forged message in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from sagaloop.engine.messages import CONTENT_TYPE, INTERNAL_TYPES, Envelope
from sagaloop.errors import MessageError, ValidationError

UNSIGNED_MARK = "is not signed by sagaloop"
"""In the reason the engine gives when it refuses an internal message that sagaloop's processes
did not send (``sagaloop.runtime.consumers.decode``)."""


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """One dead letter. ``id`` names it for :class:`DeadLetters` (see each broker for how it is
    made); ``queue`` is the sagaloop queue it came from (``shop.engine``); ``at`` is when it
    was dead-lettered, when known."""

    id: str
    queue: str
    reason: str
    at: datetime | None
    body: bytes
    content_type: str | None = CONTENT_TYPE

    @property
    def size(self) -> int:
        return len(self.body)

    @functools.cached_property
    def document(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):
            return None

    @functools.cached_property
    def _fields(self) -> tuple[str | None, str | None, str | None]:
        """``(message_id, type, run_id)``: the engine's reading of a valid envelope (an id
        derived from the bytes when it has none), else what strings the JSON holds."""
        try:
            env = Envelope.from_bytes(self.body)
        except MessageError:
            doc = self.document if isinstance(self.document, dict) else {}
            values = (doc.get(k) for k in ("message_id", "type", "run_id"))
            mid, kind, run = (v if isinstance(v, str) else None for v in values)
            return mid, kind, run
        return env.message_id, env.type, env.run_id

    @property
    def message_id(self) -> str | None:
        return self._fields[0]

    @property
    def message_type(self) -> str | None:
        return self._fields[1]

    @property
    def run_id(self) -> str | None:
        return self._fields[2]

    def to_json(self, *, body: bool = False) -> dict[str, Any]:
        """A JSON object: the fields, and with ``body`` the envelope (``envelope``, the body's
        JSON) or, for a body that is not JSON, ``body`` as text."""
        out: dict[str, Any] = {
            "id": self.id,
            "queue": self.queue,
            "reason": self.reason,
            "at": self.at.isoformat() if self.at else None,
            "type": self.message_type,
            "message_id": self.message_id,
            "run_id": self.run_id,
            "size": self.size,
            "content_type": self.content_type,
        }
        if body:
            if self.document is None:
                out["body"] = self.body.decode("utf-8", "backslashreplace")
            else:
                out["envelope"] = self.document
        return out


@runtime_checkable
class DeadLetters(Protocol):
    """What a broker lets an operator do with its dead letters. ``ids`` None means all.

    ``resend_dead_letters`` publishes each body, unchanged, to the queue it came from and only
    then removes the dead letter: a failure (the queue is gone, the broker refused) leaves it
    in place and raises :class:`~sagaloop.errors.BrokerError` after those resent before it. It
    returns the dead letters it resent; ids it does not know are skipped, so the caller
    compares."""

    def list_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        """Up to ``limit`` dead letters, oldest first, left in place."""
        ...

    def find_dead_letter(self, id: str) -> DeadLetter | None: ...

    def count_dead_letters(self) -> int: ...

    def resend_dead_letters(self, ids: Sequence[str] | None = None) -> list[DeadLetter]: ...

    def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        """Delete dead letters for good; return how many."""
        ...


class UnknownDeadLetter(ValidationError):
    """No dead letter has this id (any more): resent or purged by someone else, or a typo."""

    def __init__(self, id: str) -> None:
        super().__init__(
            f"no dead letter with id {id!r}: `sagaloop dead-letters list` shows their ids"
        )
        self.id = id


def resend_one(broker: DeadLetters, id: str) -> DeadLetter:
    """Send dead letter ``id`` again to the queue it came from, unchanged (its envelope keeps
    its ``message_id``: a consumer that processed it already skips it), and remove it from
    the dead letters, as ``sagaloop dead-letters resend ID`` and the console's Resend do.
    Raises :class:`UnknownDeadLetter` when there is no such dead letter (two operators who
    resend it at once: one resends it, the other is told it is gone), and
    :class:`~sagaloop.errors.BrokerError` when the broker refused (it stays a dead letter)."""
    resent = broker.resend_dead_letters([id])
    if not resent:
        raise UnknownDeadLetter(id)
    return resent[0]


def resend_trusted(queue: str, body: bytes, reason: str) -> bool:
    """Whether a dead letter whose trust was not recorded (the database broker's table) may
    come back as sagaloop's own: all but an internal message that the engine refused because
    sagaloop's processes had not sent it. (A public message needs no trust.)"""
    if UNSIGNED_MARK not in reason:
        return True
    try:
        kind = json.loads(body).get("type")
    except (ValueError, RecursionError, AttributeError):
        return True
    return kind not in INTERNAL_TYPES


class Numbering:
    """Makes ids unique within one pass over the dead letters, oldest first: the second one
    with the same id gets ``-2`` after it, the third ``-3`` (the same on every pass, as long
    as the earlier ones are still there)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def __call__(self, base: str) -> str:
        n = self._seen.get(base, 0) + 1
        self._seen[base] = n
        return base if n == 1 else f"{base}-{n}"
