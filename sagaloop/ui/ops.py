"""The console's operations views: the Workers page (the service processes of the process
registry, what each consumes and whether it is judged alive; the depth of each queue and the
age of its oldest message on the broker in use; the runs whose steps wait on a queue that no
live process consumes, Temporal's "no pollers"), and resending a dead letter.

Everything here is read the way ``sagaloop health`` and ``sagaloop dead-letters`` read it:
the registry's rows judged by :mod:`sagaloop.runtime.registry`, the runs judged by
:func:`sagaloop.client.serving.served`, the dead letters through the broker's
:class:`~sagaloop.brokers.dead_letters.DeadLetters`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any

from sagaloop.brokers.dead_letters import DeadLetter, DeadLetters, resend_one
from sagaloop.client import Client
from sagaloop.client.serving import served
from sagaloop.client.timeline import timeline
from sagaloop.engine import state as s
from sagaloop.engine.messages import engine_queue
from sagaloop.errors import BrokerError, SagaloopError
from sagaloop.runtime.registry import LIVE_WITHIN, SEEN_EVERY, assess, fleet
from sagaloop.ui.views import version

BrokerOpener = Callable[[], AbstractContextManager[Any]]
"""Opens the broker in use for one read or action and closes it after (``sagaloop ui`` builds
it from the settings: ``sagaloop.cli.ui.broker_of``)."""

SCAN = 100
"""The most unfinished runs of each status that the Workers page looks at for steps waiting
on a queue nobody consumes (only while such a queue, or an app without engine, exists)."""
POLL = SEEN_EVERY
"""The Workers page asks whether it moved at most this often (seconds): as often as the
processes refresh their rows, since each look may open a connection to the broker."""
SCANNED = (s.RUNNING, s.WAITING, s.COMPENSATING, s.CANCELLING)
RABBITMQ_AGE = (
    "RabbitMQ tells a queue's depth (messages ready; those delivered and not yet acked are "
    "not counted) but not the age of its oldest message: AMQP has no way to ask short of "
    "taking the message, so the age shows as -."
)
DATABASE_AGE = (
    "The database broker's queues are rows of sagaloop_outbox: the depth counts due, delayed "
    "(retries, timers) and claimed messages; the age is that of the oldest due message."
)


@dataclasses.dataclass(frozen=True)
class Process:
    """One row of the registry, as health judges it."""

    name: str
    role: str
    app: str
    state: str
    """``running``, ``not seen for N s``, ``stopped N s ago``, ``exited ... problem``."""
    alive: bool
    """Seen within the registry's ``LIVE_WITHIN`` seconds and not stopped."""
    consumes: list[str]
    started_at: datetime
    seen_at: datetime
    problem: str | None
    notes: str | None


@dataclasses.dataclass(frozen=True)
class Queue:
    name: str
    """The full queue name (``shop.engine``, ``shop.steps.work``)."""
    consumers: list[str]
    """The live processes that consume it."""
    depth: int | None
    """Messages on it (None: the broker could not tell)."""
    oldest_s: float | None
    """Seconds the oldest due message has waited (None: none waits, or the broker cannot
    tell)."""


@dataclasses.dataclass(frozen=True)
class Stranded:
    """A run with steps scheduled on a queue no live process consumes."""

    run_id: str
    saga: str
    status: str
    queues: list[str]
    why: list[str]


@dataclasses.dataclass
class Workers:
    processes: list[Process]
    queues: list[Queue]
    stranded: list[Stranded]
    problems: list[str]
    """What ``sagaloop health`` fails for: an app with runs in flight and no live engine or
    with a queue nobody consumes; a process reporting a problem."""
    broker: str
    """Which broker the depths come from, and what it cannot tell."""
    broker_error: str | None
    version: str


def dead_letter_reader(
    client: Client, broker: BrokerOpener | None
) -> Callable[[int], list[DeadLetter]] | None:
    """What reads up to N dead letters, oldest first, with the ids Resend names them by: on
    the broker ``broker`` opens, else the database broker's table (None: the client's store
    is not SQL)."""
    if broker is None:
        table = _database_broker(client)
        return None if table is None else table.list_dead_letters
    opener = broker

    def read(limit: int) -> list[DeadLetter]:
        with opener() as opened:
            if not isinstance(opened, DeadLetters):
                raise BrokerError(f"the broker {type(opened).__name__} cannot list dead letters")
            return opened.list_dead_letters(limit)

    return read


def resend(client: Client, broker: BrokerOpener | None, id: str) -> DeadLetter:
    """Resend dead letter ``id`` as ``sagaloop dead-letters resend ID`` does
    (:func:`~sagaloop.brokers.dead_letters.resend_one`), on the broker ``broker`` opens
    (None: the database broker over the client's store)."""
    if broker is None:
        table = _database_broker(client)
        if table is None:
            raise BrokerError("this console's store keeps no dead letters")
        return resend_one(table, id)
    with broker() as opened:
        if not isinstance(opened, DeadLetters):
            raise BrokerError(f"the broker {type(opened).__name__} cannot resend dead letters")
        return resend_one(opened, id)


def workers(client: Client, broker: BrokerOpener | None, *, scan: int = SCAN) -> Workers:
    """The Workers page of ``client``'s app (of every app when the console has none), with
    queue depths from the broker ``broker`` opens (None: the database broker's table)."""
    store: Any = client.store
    now = client.clock.now()
    rows: list[Any] = store.processes()  # the registry's ProcessRecords
    in_flight: dict[str, int] = store.runs_in_flight()
    if client.app_name:
        rows = [r for r in rows if r.app == client.app_name]
        in_flight = {a: n for a, n in in_flight.items() if a == client.app_name}
    listed, problems = assess(rows, now)
    processes = [_process(r, e) for r, e in zip(rows, listed, strict=True)]
    _, missing = fleet(rows, now, in_flight)  # what health fails for, about the fleet
    names = _queue_names(rows, processes, in_flight)
    depths, ages, about, error = _depths(client, broker, names, now)
    queues = [
        Queue(
            name,
            [p.name for p in processes if p.alive and name in p.consumes],
            depths.get(name),
            ages.get(name),
        )
        for name in sorted(set(names) | set(depths))
        if not client.app_name or name.startswith((f"{client.app_name}.", f"{client.app_name}/"))
    ]
    stranded = _stranded(client, now, scan) if missing else []
    shown = (
        [(p.name, p.alive, p.seen_at, p.problem, p.notes, p.state.split()[0]) for p in processes],
        queues,
        stranded,
        problems + missing,
        error,
    )
    return Workers(processes, queues, stranded, problems + missing, about, error, version(shown))


def _process(row: Any, entry: dict[str, Any]) -> Process:
    alive = row.stopped_at is None and entry["seen_s_ago"] <= LIVE_WITHIN
    return Process(
        row.name,
        row.role,
        row.app,
        entry["state"],
        alive,
        list(row.queues or []),
        row.started_at,
        row.seen_at,
        row.problem,
        entry["notes"],
    )


def _queue_names(rows: list[Any], processes: list[Process], in_flight: dict[str, int]) -> list[str]:
    """The queues worth a row: those a live process consumes, those the apps declare, and
    the engine queue of every app the registry or the runs name."""
    names = {q for p in processes if p.alive for q in p.consumes}
    names |= {q for r in rows for q in r.app_queues or []}
    names |= {engine_queue(app) for app in {r.app for r in rows} | set(in_flight)}
    return sorted(names)


def _depths(
    client: Client, broker: BrokerOpener | None, names: list[str], now: datetime
) -> tuple[dict[str, int | None], dict[str, float | None], str, str | None]:
    """(depth by queue, age of the oldest due message by queue, what the broker tells, the
    error that kept it from telling)."""
    if broker is None:
        store: Any = client.store
        stats: dict[str, tuple[int, datetime | None]] = store.queue_stats(now)
        depths: dict[str, int | None] = {q: 0 for q in names}
        ages: dict[str, float | None] = {}
        for queue, (depth, oldest) in stats.items():
            depths[queue] = depth
            ages[queue] = None if oldest is None else (now - oldest).total_seconds()
        return depths, ages, DATABASE_AGE, None
    try:
        with broker() as opened:
            ask = getattr(opened, "queue_depth", None)
            if ask is None:
                return {}, {}, f"The broker {type(opened).__name__} does not tell depths.", None
            return {q: ask(q) for q in names}, {}, RABBITMQ_AGE, None
    except SagaloopError as e:
        return {}, {}, RABBITMQ_AGE, f"the broker could not be asked: {e}"


def _stranded(client: Client, now: datetime, scan: int) -> list[Stranded]:
    """The unfinished runs (up to ``scan`` of each status) with a step scheduled on a queue
    that no live process consumes, as ``sagaloop status`` judges them."""
    out: list[Stranded] = []
    for status in SCANNED:
        for run in client.list(status=status, limit=scan):
            try:
                tl = served(
                    timeline(run, client.history(run.run_id), now), run.app, client.store, now
                )
            except SagaloopError:
                continue  # gone since listed
            if tl.unserved:
                out.append(Stranded(run.run_id, run.saga, run.status, tl.unserved, tl.waiting_for))
    return out


def _database_broker(client: Client) -> Any:
    """The database broker over the client's store, on the client's clock (None: the store
    is not SQL and keeps no queue table)."""
    from sagaloop.brokers.database import DatabaseBroker

    store: Any = client.store  # an SqlStore (the console imports no store module)
    if not hasattr(store, "requeue_dead_letters"):
        return None
    return DatabaseBroker(store, clock=client.clock)
