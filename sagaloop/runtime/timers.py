"""The timer scheduler: turns the due timers of an app's runs into messages to its engine.
``sagaloop.runtime.service`` runs it on a thread.

Polling when nothing is due costs no read: a look at the database says when the app's next
timer is due, and the engine of this process says (:meth:`TimerScheduler.wake`) when it commits
an earlier one, so the scheduler reads again at that time, or after ``RELOOK`` seconds, for the
timers other processes' engines set (each of which fires its own as soon as they fall due: a
timer waits up to ``RELOOK`` only for a process that set it and died before its due time).
"""

from __future__ import annotations

import threading
import time
from datetime import datetime

from sagaloop.engine.messages import Envelope, TimerPayload, derived_id, engine_queue
from sagaloop.engine.ports import Clock, Outgoing, Store
from sagaloop.runtime.crashpoints import crash_point
from sagaloop.sagas.app import App

RELOOK = 1.0
"""Seconds after which the scheduler reads the next due time again, though it knows of no
timer due before it (another process may have set one)."""


class TimerScheduler:
    """Turns due timers into messages to the engine, in the transaction that deletes them."""

    def __init__(self, app: App, store: Store, clock: Clock, *, batch: int = 100) -> None:
        self.app = app.name
        self.store = store
        self.clock = clock
        self.batch = batch
        self.queue = engine_queue(app.name)
        self._lock = threading.Lock()
        self._quiet: tuple[datetime | None, float] | None = None
        """After a look that found nothing due: the next timer's due time then (None: there
        was none) and the ``time.monotonic()`` until which that look holds."""
        self._woken: datetime | None = None
        """The earliest due time :meth:`wake` was told of since the last call."""

    def wake(self, fire_at: datetime) -> None:
        """This process's engine committed a timer due at ``fire_at`` (any thread)."""
        with self._lock:
            if self._woken is None or fire_at < self._woken:
                self._woken = fire_at

    def fire_due(self) -> int:
        """Fire the due timers of this app's runs (never another app's). Nothing due: no
        read at all while the last look holds (see the module's docstring), else one read
        without a transaction."""
        now = self.clock.now()
        if self._still_quiet(now):
            return 0
        due_at = self.store.next_timer_at(app=self.app)
        if due_at is None or due_at > now:
            with self._lock:  # a wake since the read is kept in _woken for the next call
                self._quiet = (due_at, time.monotonic() + RELOOK)
            return 0
        with self.store.transaction() as tx:
            due = self.store.take_due_timers(tx, now, self.batch, app=self.app)
            messages = [
                Outgoing(
                    self.queue,
                    Envelope(
                        type="timer",
                        message_id=derived_id("timer", t.run_id, t.pos, t.kind, t.attempt),
                        run_id=t.run_id,
                        position=t.pos,
                        attempt=t.attempt or None,
                        payload=TimerPayload(kind=t.kind).to_payload(),
                        created_at=now,
                    ),
                )
                for t in due
            ]
            self.store.enqueue(tx, messages, now)
            if due:
                crash_point("timers.before_commit")
        return len(due)

    def _still_quiet(self, now: datetime) -> bool:
        with self._lock:
            quiet, woken, self._woken = self._quiet, self._woken, None
            if quiet is None:
                return False
            next_at, until = quiet
            if woken is not None and (next_at is None or woken < next_at):
                next_at = woken
                self._quiet = (next_at, until)
            if time.monotonic() >= until or (next_at is not None and next_at <= now):
                self._quiet = None
                return False
            return True
