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
from typing import Any, Final

RUN_STARTED: Final = "run_started"
STEP_SCHEDULED: Final = "step_scheduled"
STEP_RETRYING: Final = "step_retrying"
STEP_DISPATCHED: Final = "step_dispatched"
STEP_COMPLETED: Final = "step_completed"
STEP_FAILED: Final = "step_failed"
STEP_HALTED: Final = "step_halted"
TIMER_STARTED: Final = "timer_started"
TIMER_FIRED: Final = "timer_fired"
EVENT_WAITING: Final = "event_waiting"
EVENT_ARRIVED: Final = "event_arrived"
EVENT_REJECTED: Final = "event_rejected"
"""An event whose data did not fit the wait it reached: recorded, and the wait goes on."""
EVENTS_DECLARED: Final = "events_declared"
"""The events the saga declares it accepts (``@app.saga(events=...)``), for clients without
its code, when the engine wrote the run's start (a client records them in ``run_started``)."""
MARKER: Final = "marker"
COMPENSATE_REQUESTED: Final = "compensate_requested"
"""Saga code asked to undo the steps completed so far (``ctx.compensate``) and goes on after."""
COMPENSATE_DONE: Final = "compensate_done"
PUBLISHED: Final = "published"
RUN_CONTINUED: Final = "run_continued"
"""Saga code continued as new (``ctx.continue_as_new``): the history restarts with this input."""
CHILD_STARTED: Final = "child_started"
"""Saga code called a saga (``await ctx.call(saga, input)``): a child run, awaited."""
CHILD_COMPLETED: Final = "child_completed"
CHILD_FAILED: Final = "child_failed"
UNDO_REQUESTED: Final = "undo_requested"
"""A completed child run is undone as a whole: its parent compensates."""
EVENT_SENT: Final = "event_sent"
"""Saga code sent an event to another run (``ctx.send_event``), through the outbox."""
RUN_SPAWNED: Final = "run_spawned"
"""Saga code started another run, fire-and-forget (``ctx.start``), through the outbox."""
"""A value saga code published (``ctx.publish``): readable from outside, the latest per key."""
CANCEL_REQUESTED: Final = "cancel_requested"
RUN_RESUMED: Final = "run_resumed"
RUN_PARKED: Final = "run_parked"
SAGA_FINISHED: Final = "saga_finished"
COMPENSATION_SCHEDULED: Final = "compensation_scheduled"
COMPENSATION_RETRYING: Final = "compensation_retrying"
COMPENSATION_COMPLETED: Final = "compensation_completed"
COMPENSATION_FAILED: Final = "compensation_failed"
RUN_FINISHED: Final = "run_finished"

COMMAND_KINDS: Final = frozenset(
    {
        STEP_SCHEDULED,
        TIMER_STARTED,
        EVENT_WAITING,
        MARKER,
        PUBLISHED,
        COMPENSATE_REQUESTED,
        EVENT_SENT,
        RUN_SPAWNED,
        CHILD_STARTED,
    }
)
COMMAND_LABEL: Final = {
    STEP_SCHEDULED: "call",
    TIMER_STARTED: "sleep",
    EVENT_WAITING: "wait_for_event",
    MARKER: "patched",
    PUBLISHED: "publish",
    COMPENSATE_REQUESTED: "compensate",
    EVENT_SENT: "send_event",
    RUN_SPAWNED: "start",
    CHILD_STARTED: "call",
}
INSTANT_KINDS: Final = frozenset({MARKER, PUBLISHED, EVENT_SENT, RUN_SPAWNED})
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
