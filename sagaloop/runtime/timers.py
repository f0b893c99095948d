"""The timer scheduler: turns the due timers of an app's runs into messages to its engine.
``sagaloop.runtime.service`` runs it on a thread.
"""

from __future__ import annotations

from sagaloop.engine.messages import Envelope, TimerPayload, derived_id, engine_queue
from sagaloop.engine.ports import Clock, Outgoing, Store
from sagaloop.runtime.crashpoints import crash_point
from sagaloop.sagas.app import App


class TimerScheduler:
    """Turns due timers into messages to the engine, in the transaction that deletes them."""

    def __init__(self, app: App, store: Store, clock: Clock, *, batch: int = 100) -> None:
        self.app = app.name
        self.store = store
        self.clock = clock
        self.batch = batch
        self.queue = engine_queue(app.name)

    def fire_due(self) -> int:
        """Fire the due timers of this app's runs (never another app's). A look without a
        transaction first: polling while nothing is due costs one read."""
        now = self.clock.now()
        due_at = self.store.next_timer_at(app=self.app)
        if due_at is None or due_at > now:
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
