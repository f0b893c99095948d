"""Who serves a run: whether a live process consumes the queue each of its outstanding steps
waits on, and whether its app has a live engine, from the process registry (each service
process records the queues it consumes). A step nobody will run must not look like one that
is running: ``status``, ``status --json`` and the console say so, naming the queue."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sagaloop.engine.messages import engine_queue, step_queue

if TYPE_CHECKING:
    from sagaloop.client.timeline import Timeline
    from sagaloop.engine.ports import Store

LIVE = timedelta(seconds=15)
"""A process seen within this long is live (the registry's ``LIVE_WITHIN``)."""

WAITING_STATES = frozenset({"scheduled", "in doubt"})
"""The states of a step line whose message waits on its queue (or runs)."""


@dataclasses.dataclass(frozen=True)
class Serving:
    """What the live processes of one app consume."""

    consumed: frozenset[str]
    """Full queue names consumed by a live process (``<app>.engine``, ``<app>.steps.<q>``)."""
    declared: frozenset[str]
    """The step queues of the app's remote steps, as its live processes declare them (an
    in-process step's queue is none of them: the app's engines run it)."""
    registered: bool
    """Whether any live process of any app is registered (none: nothing can be told)."""

    @classmethod
    def of(cls, app: str, live: Iterable[tuple[str, list[str], list[str]]]) -> Serving:
        rows = list(live)
        mine = [(queues, declared) for row_app, queues, declared in rows if row_app == app]
        consumed = frozenset(q for queues, _ in mine for q in queues)
        return cls(consumed, frozenset(q for _, declared in mine for q in declared), bool(rows))


def unserved(tl: Timeline, app: str, serving: Serving) -> Timeline:
    """``tl`` with ``unserved`` set to the queues its outstanding steps wait on that no live
    process consumes, and ``waiting_for`` saying so (and that the app has no live engine)."""
    if tl.status in {"completed", "failed", "compensated", "cancelled"} or not tl.waiting_for:
        return tl
    if not serving.registered:
        return tl  # no registry rows at all (an embedded engine, tests): nothing to tell
    no_engine = engine_queue(app) not in serving.consumed
    queues: list[str] = []
    for line in tl.steps:
        if line.state in WAITING_STATES and line.queue and line.queue not in queues:
            full = step_queue(app, line.queue)
            if full in serving.declared and full not in serving.consumed:
                queues.append(line.queue)
    why: list[str] = []
    for text in tl.waiting_for:
        queue = next((q for q in queues if f" queued or running on {q} for " in text), None)
        if queue is not None:
            text = text.replace(" queued or running on ", " queued on ", 1) + (
                f"; no live process consumes queue {queue!r}: nothing runs it until a worker "
                f"does (`sagaloop worker --queue {queue}`)"
            )
        why.append(text)
    if no_engine:
        why.insert(
            0,
            f"no live engine of app {app!r}: nothing moves this run until one starts "
            "(`sagaloop engine`, or `sagaloop dev`)",
        )
    tl.waiting_for = why
    tl.unserved = queues
    tl.no_live_engine = no_engine
    return tl


def served(tl: Timeline, app: str, store: Store, now: datetime) -> Timeline:
    """:func:`unserved` from the registry that ``store`` holds."""
    return unserved(tl, app, Serving.of(app, store.live_queues(seen_after=now - LIVE)))
