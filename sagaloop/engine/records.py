"""The records the store's ports take and return (``sagaloop.engine.ports`` re-exports them):
plain data, no behaviour beyond a field's meaning, so that the ports module holds the protocols
and nothing else."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import Envelope


@dataclasses.dataclass(frozen=True, slots=True)
class Outgoing:
    """A message to send: it goes to the outbox in the transaction that decided to send it."""

    queue: str
    envelope: Envelope
    available_at: datetime | None = None


InboxRow = tuple[str, str, Any]
"""(consumer, message_id, result): an inbox row."""


@dataclasses.dataclass(slots=True)
class Checkpoint:
    """What one message writes in the transaction that processes it (see
    ``RunStore.write_checkpoint``): its inbox row, its run's update, the run's new events and
    the messages it sends. A store may send it all in one statement."""

    now: datetime
    """When: the inbox row's and the messages' time."""
    inbox: InboxRow | None = None
    run: RunRecord | None = None
    """The run as saved, if its ``last_seq`` is still ``base_seq``; None: no run to update."""
    base_seq: int = 0
    events: Sequence[NewEvent] = ()
    """Appended to ``run``'s history as ``base_seq + 1, ...``, stamped ``events_at``."""
    events_at: datetime | None = None
    messages: Sequence[Outgoing] = ()
    create: bool = False
    """``run`` does not exist yet: it is created as saved (``base_seq`` 0), a conflict if a row
    of its id exists."""


class Written(StrEnum):
    """What :class:`Checkpoint` did: all of it, nothing (its inbox row existed: the message
    was processed already), or not the run's update (the run moved: roll back, whatever else
    was written)."""

    WRITTEN = "written"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"


@dataclasses.dataclass(slots=True)
class RunRecord:
    run_id: str
    app: str
    """The app whose engine queue receives the run's messages."""
    saga: str
    status: str
    input: Any
    created_at: datetime
    updated_at: datetime
    last_seq: int = 0
    processed_seq: int = 0
    output: Any = None
    error: dict[str, Any] | None = None
    reason: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Timer:
    run_id: str
    pos: int
    kind: str
    fire_at: datetime
    attempt: int = 0
    app: str = ""
    """The app of the run (the store sets it from the run: ``add_timer`` ignores this)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """A stored schedule of an app (``sagaloop.sagas.schedules``): ``spec`` as stored
    (``cron:<expr>`` or ``every:<seconds>``), ``input`` as JSON, ``origin`` 'code' or 'cli'."""

    app: str
    name: str
    saga: str
    spec: str
    input: Any
    catch_up: str
    paused: bool
    origin: str
    next_tick: datetime
    last_tick: datetime | None = None
    last_run_id: str | None = None
    updated_at: datetime | None = None
    note: str | None = None
    """Why it was paused (``pause(note=)``); cleared on resume."""


@dataclasses.dataclass(frozen=True, slots=True)
class QueuedMessage:
    """A row of the outbox claimed by a consumer or a relay."""

    id: int
    queue: str
    body: bytes
    deliveries: int
    claim_token: str
    trusted: bool = True
    """Written by sagaloop's store (``enqueue``), not put there raw (``enqueue_raw``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class HeldSlot:
    """The rate-limit slot that a step message held while it was given back to its queue."""

    key: str
    slot: datetime
    in_doubt: bool
    """An earlier delivery of the message may have run its attempt."""
    give_backs: int
    """How often the message was given back for its rate limit (deliveries that ran nothing)."""
    fresh: bool
    """This delivery is the first to take the hold since the give-back: the slot is its own.
    False: an earlier delivery took it, then went away (it may have run the attempt)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ApprovalRow:
    """An approval a run asked for, as the approvals index holds it."""

    run_id: str
    call_id: str
    app: str
    saga: str
    status: str
    request: dict[str, Any]
    """The request as the run last published it (``sagas.approvals.ApprovalRequest``)."""
    request_id: str
    """Random, made when the request was recorded: the answers name it."""
    requested_at: datetime
    answer_id: str | None
    """The message id of the answer that won, once one did."""
    answer: dict[str, Any] | None
    """What the winning answer said (``approved``, ``by``, ``at``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class KeySlots:
    """The run-concurrency state of one key of one saga (``@app.saga(concurrency=...)``)."""

    held: dict[int, str]
    """Slot index -> the run id holding it."""
    waiting: list[str]
    """The run ids queued for a slot: oldest start first, then in the order they joined."""


@dataclasses.dataclass(frozen=True, slots=True)
class Debounced:
    """The open window of a debounced saga's key (``sagaloop.sagas.debounce``): the run it
    will start (``run_id``, chosen by the window's first start) with ``input`` (JSON, the last
    start's) at ``due_at``; ``starts`` counts the starts it gathered (the compare-and-set
    version: the engine that starts the run takes the window only as it read it)."""

    app: str
    saga: str
    key: str
    run_id: str
    input: Any
    first_at: datetime
    last_at: datetime
    due_at: datetime
    starts: int = 1
