"""Replaying a recorded history against the current code: the first brick of upgrade safety.

Record the history of a run (``env.history(run_id)`` in a test, ``Client.history`` in
production), keep it as JSON with :func:`history_to_json`, and check in a test that the code
you are about to deploy still takes the same path::

    replay(app, json.loads(Path("tests/histories/trip.json").read_text()), run_id="trip-1")

The JSON form of an event is ``{"seq", "kind", "at", "pos", "name", "data"}`` with ``at`` in
ISO 8601; a list of them, its JSON text, or a list of :class:`~sagaloop.engine.history.Event`
are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.engine.replay import Replayer
from sagaloop.errors import NonDeterminismError
from sagaloop.sagas.app import App

History = Sequence[Event] | Sequence[Mapping[str, Any]] | str | bytes


def history_to_json(events: Sequence[Event]) -> list[dict[str, Any]]:
    """The events in their JSON form (``json.dumps`` it to store it)."""
    return [
        {
            "seq": e.seq,
            "kind": e.kind,
            "at": e.at.isoformat(),
            "pos": e.pos,
            "name": e.name,
            "data": e.data,
        }
        for e in events
    ]


def history_from_json(history: History) -> list[Event]:
    """Events from their JSON form (or its text); Events are returned as they are."""
    items: Any = json.loads(history) if isinstance(history, str | bytes) else history
    if not isinstance(items, Sequence):
        raise ValueError("a history is a list of events ({seq, kind, at, pos, name, data})")
    return [item if isinstance(item, Event) else _event(i, item) for i, item in enumerate(items)]


def _event(index: int, item: Any) -> Event:
    if not isinstance(item, Mapping):
        raise ValueError(f"event {index} of the history is not an object: {item!r}")
    try:
        at = item["at"]
        return Event(
            seq=int(item["seq"]),
            kind=str(item["kind"]),
            at=at if isinstance(at, datetime) else datetime.fromisoformat(at),
            pos=None if item.get("pos") is None else int(item["pos"]),
            name=item.get("name"),
            data=dict(item.get("data") or {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"event {index} of the history is not {{seq, kind, at, pos, name, data}}: {e}"
        ) from e


def replay(app: App, history: History, *, run_id: str = "replay") -> None:
    """Replay ``history`` against the saga code of ``app`` as it is now. Returns if the code
    takes the recorded path; raises NonDeterminismError naming the first divergence (a command
    the code issues in place of, or beyond, the recorded ones; a recorded one it no longer
    issues).

    Give the run's own ``run_id`` when the saga uses ``ctx.random()`` or ``ctx.uuid4()``: they
    are seeded with it."""
    events = sorted(history_from_json(history), key=lambda e: e.seq)
    started = next((e for e in events if e.kind == h.RUN_STARTED), None)
    if started is None:
        raise ValueError("the history has no run_started event: give the whole history of a run")
    saga = app.get_saga(str(started.name))
    if saga is None:
        raise ValueError(
            f"saga {started.name!r} is not registered in app {app.name!r}: replay the history "
            "against the app that declares it"
        )
    code = Replayer(app, saga, run_id)
    code.feed(events, replaying=True)
    recorded = sorted(e.pos for e in events if e.kind in h.COMMAND_KINDS and e.pos is not None)
    missing = [pos for pos in recorded if pos >= code.next_pos]
    if missing:
        first = next(e for e in events if e.kind in h.COMMAND_KINDS and e.pos == missing[0])
        raise _diverged(
            run_id,
            first.pos,
            f"the history has {first.describe()} but the saga code no longer issues it",
        )
    new = code.take_new_commands()
    if new:
        issued = Event(0, new[0].kind, events[-1].at, new[0].pos, new[0].name)
        raise _diverged(
            run_id,
            new[0].pos,
            f"the history ends at event {events[-1].seq}, the code now issues {issued.describe()}",
        )


def _diverged(run_id: str, pos: int | None, message: str) -> NonDeterminismError:
    return NonDeterminismError(
        f"run {run_id!r}: non-deterministic saga code: {message}",
        run_id=run_id,
        position=-1 if pos is None else pos,
    )
