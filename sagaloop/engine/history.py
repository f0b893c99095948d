"""The history of a run: an append-only list of events. The history is the truth.

Command events are the ones saga code causes (``step_scheduled``, ``timer_started``,
``event_waiting``, ``marker``); each carries the *position* the code gave the command, numbered
in the order the code issued them. Outcome events (``step_completed``, ``timer_fired``...) name
the position they resolve. Everything else (attempts, compensations, parking) is bookkeeping of
the engine that replay does not feed to saga code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, Final


class EventKind(StrEnum):
    """The kind of a history event. A member is its string: it is stored, sent and read back
    as that string, and compares equal to it. The module's constants are its members, typed
    ``str`` as they always were (``Event.kind`` is the stored string)."""

    RUN_STARTED = "run_started"
    STEP_SCHEDULED = "step_scheduled"
    STEP_RETRYING = "step_retrying"
    STEP_DISPATCHED = "step_dispatched"
    STEP_COMPLETED = "step_completed"
    STEP_FAILED = "step_failed"
    STEP_HALTED = "step_halted"
    STEP_HANDED_OFF = "step_handed_off"
    """The step's body handed its attempt (``data``: ``attempt``, ``token``, ``worker``) to an
    outside system (``ctx.complete_async()``): it stays in flight until completed or failed
    through the client with its task token, or until its timeout. Bookkeeping, never fed."""
    STEP_HEARTBEAT = "step_heartbeat"
    """The outside system holding a handed-off attempt said it is alive
    (``Client.heartbeat_step``; ``data``: ``attempt``, ``details``): its
    ``heartbeat_timeout`` starts again. Bookkeeping, never fed."""
    TIMER_STARTED = "timer_started"
    TIMER_FIRED = "timer_fired"
    TIMER_CANCELLED = "timer_cancelled"
    """Saga code stopped waiting for the timer at ``pos`` (the timeout of a wait that ended
    first, a cancelled ``asyncio.sleep``): the run no longer sleeps on it, and its timer's row
    is deleted (one left by an older engine fires for nothing). Bookkeeping, never fed."""
    EVENT_WAITING = "event_waiting"
    EVENT_ARRIVED = "event_arrived"
    EVENT_REJECTED = "event_rejected"
    """An event whose data did not fit the wait it reached: recorded, and the wait goes on."""
    EVENTS_DECLARED = "events_declared"
    """The events the saga declares it accepts (``@app.saga(events=...)``), for clients
    without its code, when the engine wrote the run's start (a client records them in
    ``run_started``)."""
    MARKER = "marker"
    CONDITION_MET = "condition_met"
    """A ``ctx.wait_condition`` of saga code found its condition true here and resumed: a
    replay resumes the code at the same position (``engine/handlers.py``)."""
    COMPENSATE_REQUESTED = "compensate_requested"
    """Saga code asked to undo the steps completed so far (``ctx.compensate``) and goes on
    after."""
    COMPENSATE_DONE = "compensate_done"
    PUBLISHED = "published"
    """A value saga code published (``ctx.publish``): readable from outside, the latest per
    key."""
    RUN_CONTINUED = "run_continued"
    """Saga code continued as new (``ctx.continue_as_new``): the history restarts with this
    input."""
    CHILD_STARTED = "child_started"
    """Saga code called a saga (``await ctx.call(saga, input)``): a child run, awaited."""
    CHILD_COMPLETED = "child_completed"
    CHILD_FAILED = "child_failed"
    CHILD_CANCEL_REQUESTED = "child_cancel_requested"
    """Saga code cancelled its await of a child run (it lost a race, say): the child run is
    asked to cancel. Its outcome still settles the call in the parent's state, so a child that
    completed first is undone with the parent's compensations."""
    UNDO_REQUESTED = "undo_requested"
    """A completed child run is undone as a whole: its parent compensates."""
    EVENT_SENT = "event_sent"
    """Saga code sent an event to another run (``ctx.send_event``), through the outbox."""
    RUN_SPAWNED = "run_spawned"
    """Saga code started another run, fire-and-forget (``ctx.start``), through the outbox."""
    CANCEL_REQUESTED = "cancel_requested"
    RUN_RESUMED = "run_resumed"
    RUN_PARKED = "run_parked"
    SAGA_FINISHED = "saga_finished"
    COMPENSATION_SCHEDULED = "compensation_scheduled"
    COMPENSATION_RETRYING = "compensation_retrying"
    COMPENSATION_COMPLETED = "compensation_completed"
    COMPENSATION_FAILED = "compensation_failed"
    RUN_FINISHED = "run_finished"
    SUBSCRIBED = "subscribed"
    """Saga code subscribed to published events of a name and key (``ctx.subscribe``): those
    published from now on are delivered to the run and kept until a wait takes them."""
    UNSUBSCRIBED = "unsubscribed"
    """Saga code ended a subscription (``ctx.unsubscribe``)."""
    EVENT_PUBLISHED = "event_published"
    """Saga code published an event (``ctx.publish_event``), sent through the outbox."""
    EVENT_TAKEN = "event_taken"
    """Once a run subscribed or waited on published events, which wait (``pos``) took the
    event that arrived at ``seq``: which event a key or a predicate chose, for readers without
    the saga's code, and checked on replay. Without ``pos``: an ``on_event`` handler took it;
    without ``seq``: the wait ended without one (its await was cancelled, its ``match``
    raised). Bookkeeping, never fed."""
    SLOT_CLAIMED = "slot_claimed"
    """A run of a saga with a concurrency limit claimed its key's slot: its code starts here,
    at this event's time (a queued run's, later than its ``run_started``)."""
    UPDATE_ACCEPTED = "update_accepted"
    """An update (``Client.update``) its validator let through: fed to its handler
    (``ctx.on_update``), in history order. ``data``: ``update_id`` and the update's data."""
    UPDATE_REFUSED = "update_refused"
    """An update refused before it was recorded as accepted (its validator raised, no
    handler...): the answer its sender reads; never fed to saga code."""
    UPDATE_COMPLETED = "update_completed"
    """An update's handler returned (``result``) or raised (``error``): the answer its sender
    reads."""
    CANCEL_DELIVERED = "cancel_delivered"
    """A cancel was delivered into the saga code: ``asyncio.CancelledError`` raised at its
    pending await, so that its ``finally``/``except`` may clean up (``cancel_grace``). The run
    is ``cancelling``; ``steps`` are the positions of the steps whose await it cancelled."""
    CANCEL_GRACE_EXPIRED = "cancel_grace_expired"
    """The saga code did not end within its ``cancel_grace``: the run is cancelled as a run
    without it is (``cancel_requested`` follows)."""


RUN_STARTED: Final[str] = EventKind.RUN_STARTED
STEP_SCHEDULED: Final[str] = EventKind.STEP_SCHEDULED
STEP_RETRYING: Final[str] = EventKind.STEP_RETRYING
STEP_DISPATCHED: Final[str] = EventKind.STEP_DISPATCHED
STEP_COMPLETED: Final[str] = EventKind.STEP_COMPLETED
STEP_FAILED: Final[str] = EventKind.STEP_FAILED
STEP_HALTED: Final[str] = EventKind.STEP_HALTED
STEP_HANDED_OFF: Final[str] = EventKind.STEP_HANDED_OFF
STEP_HEARTBEAT: Final[str] = EventKind.STEP_HEARTBEAT
TIMER_STARTED: Final[str] = EventKind.TIMER_STARTED
TIMER_FIRED: Final[str] = EventKind.TIMER_FIRED
TIMER_CANCELLED: Final[str] = EventKind.TIMER_CANCELLED
EVENT_WAITING: Final[str] = EventKind.EVENT_WAITING
EVENT_ARRIVED: Final[str] = EventKind.EVENT_ARRIVED
EVENT_REJECTED: Final[str] = EventKind.EVENT_REJECTED
EVENTS_DECLARED: Final[str] = EventKind.EVENTS_DECLARED
MARKER: Final[str] = EventKind.MARKER
CONDITION_MET: Final[str] = EventKind.CONDITION_MET
COMPENSATE_REQUESTED: Final[str] = EventKind.COMPENSATE_REQUESTED
COMPENSATE_DONE: Final[str] = EventKind.COMPENSATE_DONE
PUBLISHED: Final[str] = EventKind.PUBLISHED
RUN_CONTINUED: Final[str] = EventKind.RUN_CONTINUED
CHILD_STARTED: Final[str] = EventKind.CHILD_STARTED
CHILD_COMPLETED: Final[str] = EventKind.CHILD_COMPLETED
CHILD_FAILED: Final[str] = EventKind.CHILD_FAILED
CHILD_CANCEL_REQUESTED: Final[str] = EventKind.CHILD_CANCEL_REQUESTED
UNDO_REQUESTED: Final[str] = EventKind.UNDO_REQUESTED
EVENT_SENT: Final[str] = EventKind.EVENT_SENT
RUN_SPAWNED: Final[str] = EventKind.RUN_SPAWNED
CANCEL_REQUESTED: Final[str] = EventKind.CANCEL_REQUESTED
RUN_RESUMED: Final[str] = EventKind.RUN_RESUMED
RUN_PARKED: Final[str] = EventKind.RUN_PARKED
SAGA_FINISHED: Final[str] = EventKind.SAGA_FINISHED
COMPENSATION_SCHEDULED: Final[str] = EventKind.COMPENSATION_SCHEDULED
COMPENSATION_RETRYING: Final[str] = EventKind.COMPENSATION_RETRYING
COMPENSATION_COMPLETED: Final[str] = EventKind.COMPENSATION_COMPLETED
COMPENSATION_FAILED: Final[str] = EventKind.COMPENSATION_FAILED
RUN_FINISHED: Final[str] = EventKind.RUN_FINISHED
SUBSCRIBED: Final[str] = EventKind.SUBSCRIBED
UNSUBSCRIBED: Final[str] = EventKind.UNSUBSCRIBED
EVENT_PUBLISHED: Final[str] = EventKind.EVENT_PUBLISHED
EVENT_TAKEN: Final[str] = EventKind.EVENT_TAKEN
SLOT_CLAIMED: Final[str] = EventKind.SLOT_CLAIMED
UPDATE_ACCEPTED: Final[str] = EventKind.UPDATE_ACCEPTED
UPDATE_REFUSED: Final[str] = EventKind.UPDATE_REFUSED
UPDATE_COMPLETED: Final[str] = EventKind.UPDATE_COMPLETED
CANCEL_DELIVERED: Final[str] = EventKind.CANCEL_DELIVERED
CANCEL_GRACE_EXPIRED: Final[str] = EventKind.CANCEL_GRACE_EXPIRED

COMMAND_KINDS: Final = frozenset(
    {
        STEP_SCHEDULED,
        TIMER_STARTED,
        EVENT_WAITING,
        MARKER,
        CONDITION_MET,
        PUBLISHED,
        COMPENSATE_REQUESTED,
        EVENT_SENT,
        RUN_SPAWNED,
        CHILD_STARTED,
        SUBSCRIBED,
        UNSUBSCRIBED,
        EVENT_PUBLISHED,
    }
)
COMMAND_LABEL: Final = {
    STEP_SCHEDULED: "call",
    TIMER_STARTED: "sleep",
    EVENT_WAITING: "wait_for_event",
    MARKER: "patched",
    CONDITION_MET: "wait_condition",
    PUBLISHED: "publish",
    COMPENSATE_REQUESTED: "compensate",
    EVENT_SENT: "send_event",
    RUN_SPAWNED: "start",
    CHILD_STARTED: "call",
    SUBSCRIBED: "subscribe",
    UNSUBSCRIBED: "unsubscribe",
    EVENT_PUBLISHED: "publish_event",
}
INSTANT_KINDS: Final = frozenset(
    {
        MARKER,
        CONDITION_MET,
        PUBLISHED,
        EVENT_SENT,
        RUN_SPAWNED,
        SUBSCRIBED,
        UNSUBSCRIBED,
        EVENT_PUBLISHED,
    }
)
"""Commands that complete when issued: nothing resolves them later."""


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One history event. ``seq`` is gap-free per run, starting at 1."""

    seq: int
    kind: str
    at: datetime
    pos: int | None = None
    name: str | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """A short human form of a command, used in non-determinism errors."""
        label = COMMAND_LABEL.get(self.kind, self.kind)
        return f"{label}({self.name!r}) at position {self.pos}"


@dataclasses.dataclass(slots=True)
class NewEvent:
    """An event to append; the store assigns ``seq``."""

    kind: str
    pos: int | None = None
    name: str | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


def number(after_seq: int, events: Sequence[NewEvent], at: datetime) -> list[Event]:
    """The events as they are stored after ``after_seq``: ``after_seq + 1, ...``."""
    return [
        Event(after_seq + i, e.kind, at, e.pos, e.name, e.data)
        for i, e in enumerate(events, start=1)
    ]
