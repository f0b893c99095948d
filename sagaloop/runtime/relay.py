"""The outbox relay: publishes what transactions wrote to the outbox, for brokers whose queues
live outside the database. (With the database broker the outbox *is* the queue: no relay.)

Two ways in, one way out:

- **Hand-over** (the hot path): the store gives the relay the rows a transaction of this process
  wrote, in memory, right after the commit. The rows were written already claimed with the
  relay's token for a short lease (``handoff_lease``), so no one else publishes them meanwhile.
  The relay publishes them in one confirmed batch.
- **Sweep** (:meth:`Relay.relay_once`): claims, with a lease and a fresh token, rows nobody
  holds (written by another process, such as a client's start, or left by a process that died
  before publishing or deleting them: their lease ran out), and publishes them.

Published rows are deleted by token in the next sweep's transaction (``Store.delete_later``),
so no deletion sits on a message's way. A row is deleted only after the broker confirmed it, so
a crash at any instant loses nothing; it can publish a row twice (killed after the confirm and
before the delete), and consumers deduplicate by ``message_id`` in their inbox, so a duplicate
publish never becomes a duplicate effect. A row the broker will never accept (unroutable, too
large) is moved to the dead letters with the reason, so that it cannot block the rows behind
it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta

from sagaloop import tracing
from sagaloop.engine.ports import Broker, Clock, QueuedMessage, Store, SystemClock
from sagaloop.errors import UndeliverableError
from sagaloop.runtime.crashpoints import crash_point

logger = logging.getLogger(__name__)

HANDOFF_LEASE = timedelta(seconds=2)
"""How long rows handed over in memory stay claimed by their writer's relay: the longest that a
row written just before its process died waits before another relay's sweep publishes it."""


class Relay:
    def __init__(
        self,
        store: Store,
        broker: Broker,
        *,
        clock: Clock | None = None,
        batch: int = 256,
        lease: timedelta = timedelta(seconds=30),
    ) -> None:
        self.store = store
        self.broker = broker
        self.clock = clock or SystemClock()
        self.batch = batch
        self.lease = lease
        self.token = uuid.uuid4().hex
        self.handoff_lease = min(lease, HANDOFF_LEASE)
        self._handed: collections.deque[tuple[float, QueuedMessage]] = collections.deque()
        self._ready = threading.Condition()
        self._poked = False

    # --- hand-over ---------------------------------------------------------------------------

    def lease_for(self, queue: str) -> timedelta | None:
        """How long a row handed over stays claimed (the same for every queue)."""
        return self.handoff_lease

    def take(self, rows: Sequence[QueuedMessage]) -> None:
        """Called by the store after a commit (any thread): publish these rows soon."""
        now = time.monotonic()
        with self._ready:
            self._handed.extend((now, r) for r in rows)
            self._ready.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait until rows are handed over or :meth:`poke` is called, at most ``timeout``
        seconds; return whether it was poked (then sweep at once)."""
        with self._ready:
            self._ready.wait_for(lambda: self._handed or self._poked, timeout)
            poked, self._poked = self._poked, False
            return poked

    def poke(self) -> None:
        """Another process committed rows nobody holds (any thread): sweep now."""
        with self._ready:
            self._poked = True
            self._ready.notify_all()

    def send_handed(self) -> int:
        """Publish up to one batch of the rows handed over; return how many left the outbox.

        A row held longer than half its lease is left to the sweep instead (its lease is about
        to run out, and a sweep elsewhere may be publishing it already)."""
        fresh_after = time.monotonic() - self.handoff_lease.total_seconds() / 2
        rows: list[QueuedMessage] = []
        with self._ready:
            while self._handed and len(rows) < self.batch:
                held_since, row = self._handed.popleft()
                if held_since >= fresh_after:
                    rows.append(row)
        return self._send(rows)

    # --- sweep -------------------------------------------------------------------------------

    def relay_once(self) -> int:
        """Claim and publish one batch of the rows nobody holds; return how many left."""
        rows = self.store.claim(None, self.batch, self.clock.now(), self.lease, probe=True)
        return self._send(rows)

    # --- both ----------------------------------------------------------------------------------

    def _send(self, rows: Sequence[QueuedMessage]) -> int:
        if not rows:
            return 0
        crash_point("relay.before_publish")
        try:
            self._publish(rows)
        except UndeliverableError:
            # Find the rows at fault one by one; the others go out with them.
            for row in rows:
                self._publish([row])
        return len(rows)

    def _publish(self, rows: Sequence[QueuedMessage]) -> None:
        token = rows[0].claim_token
        try:
            with tracing.publish([r.body for r in rows]):  # the span sagaloop.relay.publish
                self.broker.publish([(r.queue, r.body) for r in rows])
        except UndeliverableError as e:
            if len(rows) > 1:
                raise
            logger.error("outbox row %s to %r dead-lettered: %s", rows[0].id, rows[0].queue, e)
            self.store.dead_letter(rows[0].id, token, str(e), self.clock.now())
            return
        except Exception:
            # Some may have gone out: publishing them again is safe (consumers deduplicate by
            # message_id), losing them is not. Release the claim so that a sweep sends them.
            self.store.release([r.id for r in rows], token, self.clock.now())
            raise
        crash_point("relay.after_publish")
        self.store.delete_later([r.id for r in rows], token)
