"""The one assembly of a process's parts: from an app, a store, a broker, the :class:`Roles` it
plays and its :class:`Tuning`, :func:`assemble` builds the step runner, the engine's consumer,
the in-process lane and its worker, the worker consumer of the step queues, the timer scheduler,
the scheduler of the app's schedules and the outbox relay, once. Two drivers run the parts:
threads (``sagaloop.runtime.service``: ``Service``, which ``sagaloop dev``, ``engine`` and
``worker`` and embedders start) and stepping (``sagaloop.testing.Harness``: one message at a
time, on the caller's thread)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine.activation import Engine
from sagaloop.engine.history import Event
from sagaloop.engine.messages import engine_queue, local_queue, start_queue, step_queue
from sagaloop.engine.ports import (
    Broker,
    Clock,
    DebounceStore,
    Delivery,
    ScheduleStore,
    Store,
    Streams,
)
from sagaloop.engine.watchdog import DEADLINE, Watchdog
from sagaloop.runtime.consumers import EngineConsumer
from sagaloop.runtime.debounce import Debouncer
from sagaloop.runtime.lane import LOCAL_LEASE, LocalLane
from sagaloop.runtime.local import LocalWorker
from sagaloop.runtime.relay import Relay
from sagaloop.runtime.schedules import Scheduler
from sagaloop.runtime.steps import StepRunner
from sagaloop.runtime.timers import TimerScheduler
from sagaloop.runtime.worker import WorkerConsumer
from sagaloop.sagas.app import App
from sagaloop.store.sql import SqlStore

if TYPE_CHECKING:
    from sqlalchemy import Connection


@dataclass(frozen=True)
class Roles:
    """What a process does. ``queues``: the step queues it works on (None: every queue of the
    app). ``relay`` and ``lane`` (None: as needed) are the outbox relay, for a broker outside
    the database, and the in-process lane of an engine of an app with ``local=True`` steps.
    ``retention``: delete finished runs older than this (None: keep them). ``registry``: keep
    this process's row in the store's process registry (and its liveness file)."""

    engine: bool = True
    queues: Sequence[str] | None = None
    timers: bool = True
    relay: bool | None = None
    lane: bool | None = None
    retention: timedelta | None = None
    registry: bool = False


SERVICE_THREADS = 6
"""The threads of a service besides its step threads that may use the store at once: the
engine's consumer, its start consumer, the timers, retention, the relay and the registry (the
outbox listener has a connection of its own)."""


@dataclass(frozen=True)
class Tuning:
    """How a process does it: ``concurrency`` step attempts at once (per queue group);
    ``batch`` engine messages per activation batch; ``poll`` seconds between looks at an idle
    queue; ``heartbeat`` seconds between extensions of a running step's message (None: none);
    ``lease`` on the messages and outbox rows it claims; ``activation_deadline`` seconds of
    CPU for saga code between two ``await``; ``cache_size`` suspended runs kept in memory."""

    concurrency: int = 4
    batch: int = 16
    poll: float = 0.2
    heartbeat: float | None = 10.0
    lease: timedelta = timedelta(seconds=30)
    activation_deadline: float = DEADLINE
    cache_size: int = 1024

    @property
    def connections(self) -> int:
        """The pooled connections a :class:`~sagaloop.runtime.service.Service` of this tuning
        may use at once, at most: one per step thread (``concurrency`` each for the worker and
        for an engine's in-process lane, both in ``sagaloop dev``), one for each of its other
        threads that use the store (engine, starts, timers, retention, relay, registry) and
        two for other users in the process (a client, the metrics endpoint). Open its store
        with a pool this large (``open_store(url, connections=...)``; the pool opens them only
        as they are needed): a pool smaller than the threads that use it at once opens and
        closes a connection (a PostgreSQL backend) for each transaction beyond its size."""
        return 2 * self.concurrency + SERVICE_THREADS + 2


@dataclass
class Parts:
    """What :func:`assemble` built; a part of a role the process does not play is None."""

    runner: StepRunner
    watchdog: Watchdog
    engine: EngineConsumer | None
    lane: DatabaseBroker | None
    local: LocalWorker | None
    worker: WorkerConsumer | None
    timers: TimerScheduler | None
    relay: Relay | None
    step_queues: list[str] = field(default_factory=list)
    """The step queues this process consumes."""
    schedules: Scheduler | None = None
    """The scheduler of the app's schedules: in an engine that fires timers, on a store that
    keeps schedules."""
    debounce: Debouncer | None = None
    """What starts the runs of the app's debounced sagas: in an engine that fires timers, on a
    store that keeps debounce windows."""

    def route(self, queue: str) -> tuple[str, Callable[[Delivery], None]]:
        """Who takes a delivery of ``queue``: its role (``engine`` for the engine's queues,
        else ``worker``: the in-process lane's steps are a worker's too) and the part's
        ``process``. A part this process does not have raises LookupError."""
        engine, local, worker = self.engine, self.local, self.worker
        if engine is not None and queue in (engine.queue, engine.start_queue):
            return "engine", engine.process
        if local is not None and self.lane is not None and queue == lane_queue(local.app):
            return "worker", local.process
        if worker is not None:
            return "worker", worker.process
        raise LookupError(f"this process consumes no queue {queue!r}")


def assemble(
    app: App,
    store: Store,
    broker: Broker,
    roles: Roles,
    tuning: Tuning,
    *,
    clock: Clock,
    streams: Streams,
    name: str,
    stepping: bool = False,
    steps: App | None = None,
) -> Parts:
    """Build the parts of a process playing ``roles``. ``steps``: the app as step runners see
    it (default ``app``; the harness's has overridden bodies).

    The stepping driver runs every attempt on the caller's thread (``inline``), with a runner
    of its own for in-process steps (named ``engine``, as the engine that runs them), no
    heartbeat for them, and a lane that claims from the database at once (the threads' lane
    waits for rows handed over, and looks at the database only now and then)."""
    steps = steps or app

    def history(run_id: str, within: Connection | None = None, after: int = 0) -> list[Event]:
        tx = None if within is None else store.attach(within)
        return store.load_history(tx, run_id, after_seq=after)

    if stepping:
        runner = StepRunner(steps, worker=name, inline=True, history=history, streams=streams)
    else:
        threads = max(tuning.concurrency, 1) * 2
        runner = StepRunner(steps, threads=threads, worker=name, history=history, streams=streams)
    watchdog = Watchdog(tuning.activation_deadline)
    parts = Parts(runner, watchdog, None, None, None, None, None, None)
    if roles.engine:
        engine = Engine(app, store, clock=clock, cache_size=tuning.cache_size, watchdog=watchdog)
        parts.engine = EngineConsumer(engine, store)
        lane = roles.lane
        if lane is None:
            lane = any(step.local for step in app.steps.values())
        if lane:
            args = (app, store, runner, parts.engine, tuning, clock)
            parts.lane, parts.local = _lane(*args, stepping=stepping)
    if roles.queues is None or roles.queues:
        parts.step_queues = [
            step_queue(app.name, q) for q in (app.queues if roles.queues is None else roles.queues)
        ]
        parts.worker = WorkerConsumer(
            app, store, runner, clock, heartbeat=tuning.heartbeat, lease=tuning.lease
        )
    if roles.timers:
        parts.timers = TimerScheduler(app, store, clock)
        if parts.engine is not None:  # the timers it sets: no look at the database for them
            parts.engine.engine.on_timers = parts.timers.wake
        if roles.engine and isinstance(store, ScheduleStore):
            parts.schedules = Scheduler(app, store, clock)
        if roles.engine and isinstance(store, DebounceStore):
            parts.debounce = Debouncer(app, store, clock)
    if roles.relay or (roles.relay is None and not broker.uses_outbox):
        parts.relay = Relay(store, broker, clock=clock, lease=tuning.lease)
    return parts


def _lane(
    app: App,
    store: Store,
    runner: StepRunner,
    consumer: EngineConsumer,
    tuning: Tuning,
    clock: Clock,
    *,
    stepping: bool,
) -> tuple[DatabaseBroker, LocalWorker]:
    """The in-process lane and the worker of its steps (``sagaloop.runtime.local``)."""
    if not isinstance(store, SqlStore):
        raise TypeError("in-process steps need a SqlStore")
    lane: DatabaseBroker
    if stepping:
        lane = DatabaseBroker(store, clock=clock, lease=tuning.lease)
        runner = StepRunner(
            runner.app,
            worker="engine",
            inline=True,
            history=runner.history,
            streams=runner.streams,
        )
        heartbeat = None
    else:
        lease = min(LOCAL_LEASE, tuning.lease)  # short leases in tests: quick recovery
        lane = LocalLane(store, app.name, clock=clock, lease=lease, poll=tuning.poll)
        heartbeat = lane.lease.total_seconds() / 3
    local = LocalWorker(
        app,
        store,
        runner,
        clock,
        consumer=consumer,
        heartbeat=heartbeat,
        lease=tuning.lease,
    )
    return lane, local


def engine_queues(app: App) -> list[str]:
    """The engine's queues: its own and its start queue."""
    return [engine_queue(app.name), start_queue(app.name)]


def lane_queue(app: App) -> str:
    """The in-process steps' queue: always in the database, as in production."""
    return local_queue(app.name)
