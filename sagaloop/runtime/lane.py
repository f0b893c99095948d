"""The in-process lane of an app (see ``sagaloop.runtime.local``): the outbox rows of its
``local=True`` steps, served by its engine processes from the database, whatever the broker.

- **hand-over** (the hot path): the store writes a row already claimed by the process that
  committed it (for ``LOCAL_LEASE``, renewed while the step runs) and hands it to the lane in
  memory after the commit;
- **recovery**: the lane claims from the database the rows nobody holds (their engine died and
  their claim ran out, or they were given back), looking at most every ``poll`` seconds.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta

from sagaloop.brokers.database import DatabaseBroker, DatabaseDelivery
from sagaloop.engine.messages import local_queue
from sagaloop.engine.ports import Clock, Delivery, Handoff, QueuedMessage
from sagaloop.store.sql import SqlStore

logger = logging.getLogger(__name__)

LOCAL_LEASE = timedelta(seconds=15)
"""How long an in-process step's row stays claimed by the engine running it (renewed every
third of it while the step runs): how long the step of an engine that died waits before another
engine of the app runs it again."""


LOOK_EVERY = 1.0
"""The least time between two looks of an engine at the database for in-process steps."""


class LocalLane(DatabaseBroker):
    """The in-process lane of an app as a queue: rows handed over in memory first, else rows
    claimed from the database, looked for every ``poll`` seconds (at least ``LOOK_EVERY``) by
    one of the threads."""

    def __init__(
        self,
        store: SqlStore,
        app: str,
        *,
        clock: Clock | None = None,
        lease: timedelta = LOCAL_LEASE,
        poll: float = 0.1,
    ) -> None:
        # Rows are handed over at once; the database holds only those of a dead engine (or
        # given back), which wait for their claim to run out anyway: no need to look often.
        super().__init__(store, lease=lease, clock=clock, poll_interval=max(poll, LOOK_EVERY))
        self.queue = local_queue(app)
        self._handed: collections.deque[tuple[float, QueuedMessage]] = collections.deque()
        self._ready = threading.Condition()
        self._next_look = 0.0

    def take(self, rows: Sequence[QueuedMessage]) -> None:
        """Called by the store after a commit (any thread): run these rows soon."""
        now = time.monotonic()
        with self._ready:
            self._handed.extend((now, r) for r in rows)
            self._ready.notify(len(rows))

    def receive(self, queues: Sequence[str], max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        while True:
            rows = self._pop(max_messages)
            if not rows and self._look_now():
                at = self.clock.now()
                rows = self.store.claim([self.queue], max_messages, at, self.lease, probe=True)
            if rows:
                return [DatabaseDelivery(self, r) for r in rows]
            now = time.monotonic()
            if now >= deadline:
                return []
            with self._ready:
                wait = min(deadline, self._next_look) - now
                self._ready.wait_for(lambda: self._handed, max(wait, 0.001))

    def release_handed(self) -> None:
        """Give back the rows handed over and not taken (at stop): any engine may take them."""
        with self._ready:
            rows, self._handed = [r for _, r in self._handed], collections.deque()
        for row in rows:
            try:
                self.store.release([row.id], row.claim_token, self.clock.now())
            except Exception as e:  # their claim runs out anyway
                logger.warning("could not give back in-process step row %s: %s", row.id, e)

    def _pop(self, limit: int) -> list[QueuedMessage]:
        """Up to ``limit`` rows handed over; one held longer than half its lease is left to a
        look at the database (its claim is about to run out: another engine may take it)."""
        fresh_after = time.monotonic() - self.lease.total_seconds() / 2
        rows: list[QueuedMessage] = []
        with self._ready:
            while self._handed and len(rows) < limit:
                held_since, row = self._handed.popleft()
                if held_since >= fresh_after:
                    rows.append(row)
        return rows

    def _look_now(self) -> bool:
        """Whether this thread looks at the database now (one thread per ``poll`` seconds)."""
        now = time.monotonic()
        with self._ready:
            if now < self._next_look:
                return False
            self._next_look = now + self.poll_interval
            return True


class Handoffs:
    """What the store hands over after a commit, split by queue: the in-process lane's rows to
    the lane (claimed for its lease), the others to the relay, or, without a relay, to the
    database broker (``broker``: the store's own, whose consumers in this process take the rows
    of the queues they wait on; rows of other queues are written unclaimed, for any process)."""

    def __init__(
        self,
        lane: LocalLane | None,
        relay: Handoff | None,
        *,
        owner: str | None = None,
        broker: DatabaseBroker | None = None,
    ) -> None:
        self.lane = lane
        self.relay = relay
        self.broker = broker if relay is None else None
        fresh = f"{owner}.{uuid.uuid4().hex}" if owner else uuid.uuid4().hex
        self.token = relay.token if relay is not None else fresh

    def lease_for(self, queue: str) -> timedelta | None:
        if self.lane is not None and queue == self.lane.queue:
            return self.lane.lease
        if self.relay is not None:
            return self.relay.lease_for(queue)
        return self.broker.lease_for(queue) if self.broker is not None else None

    def take(self, rows: Sequence[QueuedMessage]) -> None:
        lane = self.lane.queue if self.lane is not None else None
        local = [r for r in rows if r.queue == lane]
        if local and self.lane is not None:
            self.lane.take(local)
        if len(local) < len(rows):
            others = self.relay if self.relay is not None else self.broker
            if others is not None:
                others.take([r for r in rows if r.queue != lane])
