"""Replaying a recorded history against the current code: the first brick of upgrade safety.

Record the history of a run (``sagaloop export RUN -o trip.json`` from production,
``env.history(run_id)`` in a test, ``Client.history``), keep it as JSON, and check in a test
that the code you are about to deploy still takes the same path::

    replay(app, Path("tests/histories/trip.json").read_text())

The JSON form of an event is ``{"seq", "kind", "at", "pos", "name", "data"}`` with ``at`` in
ISO 8601 (:func:`history_to_json`). A history is given as the document ``sagaloop export``
writes (:func:`history_document`: ``{"format": "sagaloop-history", "version", "app", "saga",
"run_id", "status", "commands", "events"}``), a bare list of events, the JSON text of either,
or a list of :class:`~sagaloop.engine.history.Event`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sagaloop.client.fork import settled_commands
from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.engine.ports import RunRecord
from sagaloop.engine.replay import check_replay
from sagaloop.sagas.app import App

History = Sequence[Event] | Sequence[Mapping[str, Any]] | Mapping[str, Any] | str | bytes
FORMAT = "sagaloop-history"
"""The ``format`` of the document ``sagaloop export`` writes."""
FORMAT_VERSION = 1
"""Its ``version``: a reader refuses a newer one, and reads every older one."""


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


def history_document(run: RunRecord, events: Sequence[Event]) -> dict[str, Any]:
    """The document ``sagaloop export`` writes for ``run`` and its history: what it is (format
    and version), the run (app, saga, id, status, times, the run it was forked from), the
    index of its commands by position (``{position, command, name, done}``: ``done`` when the
    history records the outcome, which a fork after that position keeps) and the events."""
    started = next((e for e in events if e.kind == h.RUN_STARTED), None)
    settled = settled_commands(events)
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "app": run.app,
        "saga": run.saga,
        "run_id": run.run_id,
        "status": run.status,
        "created_at": run.created_at.isoformat(),
        "updated_at": run.updated_at.isoformat(),
        "forked_from": started.data.get("forked_from") if started is not None else None,
        "commands": [
            {
                "position": e.pos,
                "command": h.COMMAND_LABEL.get(e.kind, e.kind),
                "name": e.name,
                "done": e.pos in settled,
            }
            for e in sorted(events, key=lambda e: e.pos or 0)
            if e.kind in h.COMMAND_KINDS and e.pos is not None
        ],
        "events": history_to_json(events),
    }


def read_history(history: History) -> tuple[list[Event], str | None]:
    """The events of ``history`` (any form :func:`replay` takes) and the run id its document
    names (None for a bare list). ValueError, saying what is wrong, for anything else."""
    items: Any = history
    if isinstance(history, str | bytes):
        try:
            items = json.loads(history)
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise ValueError(f"not JSON: {e}") from None
    run_id: str | None = None
    if isinstance(items, Mapping):
        if items.get("format", FORMAT) != FORMAT or "events" not in items:
            raise ValueError(
                "not a history: an object must be the document `sagaloop export` writes "
                f'({{"format": "{FORMAT}", ..., "events": [...]}})'
            )
        version = items.get("version", FORMAT_VERSION)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"history format version {version!r}: this sagaloop reads versions up to "
                f"{FORMAT_VERSION} (upgrade sagaloop)"
            )
        found = items.get("run_id")
        run_id = found if isinstance(found, str) else None
        items = items["events"]
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise ValueError("a history is a list of events ({seq, kind, at, pos, name, data})")
    events = [item if isinstance(item, Event) else _event(i, item) for i, item in enumerate(items)]
    return events, run_id


def history_from_json(history: History) -> list[Event]:
    """Events from their JSON form, the export document, or the text of either; Events are
    returned as they are."""
    return read_history(history)[0]


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


def replay(app: App, history: History, *, run_id: str | None = None) -> None:
    """Replay ``history`` against the saga code of ``app`` as it is now. Returns if the code
    takes the recorded path; raises NonDeterminismError naming the first divergence (a command
    the code issues in place of, or beyond, the recorded ones; a recorded one it no longer
    issues), ActivationDeadlineError for saga code that runs on without yielding (the engine
    would park the run for either), ValueError for what is not a history of a saga of ``app``.

    ``run_id`` is the run's own by default (the one the export document names; else
    ``"replay"``): ``ctx.random()`` and ``ctx.uuid4()`` are seeded with it."""
    found, named = read_history(history)
    run_id = run_id or named or "replay"
    events = sorted(found, key=lambda e: e.seq)
    started = next((e for e in events if e.kind == h.RUN_STARTED), None)
    if started is None:
        raise ValueError("the history has no run_started event: give the whole history of a run")
    saga = app.get_saga(str(started.name))
    if saga is None:
        raise ValueError(
            f"saga {started.name!r} is not registered in app {app.name!r}: replay the history "
            "against the app that declares it"
        )
    check_replay(app, saga, run_id, events, whole=True)
