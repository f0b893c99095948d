"""The debouncer: starts the run of each debounced saga's window once it is due (``@app.saga(
debounce=Debounce(...))``). ``sagaloop.runtime.service`` runs it on the timers' thread of an
engine, beside the timers and the schedules; the harness steps it.

Exactly one run per window, however many engines look at it: the window's run id is chosen by
its first start and stored with it, and the engine that starts the run deletes the window by
compare-and-set (same run id, same count of starts) in the transaction that creates the run.
A start that comes in between moves the window on (the delete then deletes nothing and the
engine starts nothing: the window is due later, with the newer input); an engine that dies
before its commit (crash point ``debounce.before_commit``) leaves the window to the next look.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from sagaloop import tracing
from sagaloop.client import Client
from sagaloop.engine import state as s
from sagaloop.engine.messages import Envelope, derived_id
from sagaloop.engine.ports import Clock, Debounced, DebounceStore, RunRecord, Store
from sagaloop.runtime.crashpoints import crash_point
from sagaloop.runtime.registry import Outage
from sagaloop.sagas.app import App

logger = logging.getLogger(__name__)


class Debouncer:
    """Starts the due windows of ``app``'s debounced sagas."""

    def __init__(self, app: App, store: Store, clock: Clock, *, client: Client | None = None):
        if not isinstance(store, DebounceStore):
            raise TypeError("debounced sagas need a store with the DebounceStore role (a SqlStore)")
        self.app = app
        self.store = store
        self.debounces: DebounceStore = store
        self.clock = clock
        self.client = client or Client(store, app, clock=clock, start_backlog=0)

    def fire_due(self) -> int:
        """Start the runs of the due windows; return how many were started."""
        if not any(saga.debounce is not None for saga in self.app.sagas.values()):
            return 0  # nothing of this app is debounced: no read
        now = self.clock.now()
        started = 0
        for window in self.debounces.due_debounced(self.app.name, now):
            saga = self.app.get_saga(window.saga)
            if saga is None or saga.debounce is None:
                continue  # recorded by another version of the app: its engines start it
            started += self._start(window, now)
        return started

    def _start(self, window: Debounced, now: datetime) -> int:
        run_id, name = window.run_id, window.saga
        with tracing.start(run_id, name) as trace:  # the span sagaloop.start: the run's trace
            env = Envelope(
                type="start",
                message_id=derived_id("start", run_id),
                run_id=run_id,
                saga=name,
                payload={"input": window.input},
                created_at=now,
                trace=trace,
            )
            with self.store.transaction() as tx:
                if not self.debounces.take_debounced(tx, window):
                    return 0  # a start moved the window on, or another engine started it
                record = RunRecord(
                    run_id, self.app.name, name, s.RUNNING, window.input, now, now, 1
                )
                if self.store.create_run(tx, record):
                    self.client._begin(tx, env, self.app.get_saga(name), [], now)
                crash_point("debounce.before_commit")
        logger.info(
            "debounced saga %r started run %r (key %r, %d starts gathered; started once, by "
            "whichever engine took the window first)",
            name,
            run_id,
            window.key,
            window.starts,
            extra={"run_id": run_id},
        )
        return 1

    def beside(self, fire_timers: Callable[[], int]) -> Callable[[], int]:
        """One step of the timers' thread that starts the due windows too. A failure is said
        once per outage and does not hold the timers up."""
        outage = Outage()

        def fire() -> int:
            done = fire_timers()
            started = [0]

            def windows() -> None:
                started[0] = self.fire_due()

            warning = "the debounced starts of app %r could not start (%s); trying again"
            outage.attempt(windows, warning, self.app.name)
            return done + started[0]

        return fire
