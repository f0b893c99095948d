"""The outbox relay: publishes what transactions wrote to the outbox, for brokers whose queues
live outside the database. (With the database broker the outbox *is* the queue: no relay.)

Two ways in, one way out:

- **Hand-over** (the hot path): the store gives the relay the rows a transaction of this process
  wrote, in memory, right after the commit. The rows were written already claimed with the
  relay's token for a short lease (``handoff_lease``), so no one else publishes them meanwhile.
  With a broker that can publish without waiting (``publish_later``: RabbitMQ), the committing
  thread writes them to the broker itself and goes on; their confirms, on the broker's I/O
  thread, mark them for deletion. That takes the relay's thread off a message's way (two
  thread wake-ups per message: to publish and, for the confirm, back). A batch that fails there
  goes to the relay's thread, which publishes it the usual way. Otherwise the relay's thread
  publishes them, in one confirmed batch.
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
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol, cast

from sagaloop import tracing
from sagaloop.engine.ports import Broker, Clock, QueuedMessage, Store, SystemClock
from sagaloop.errors import BrokerError, UndeliverableError
from sagaloop.runtime.crashpoints import crash_point

logger = logging.getLogger(__name__)

HANDOFF_LEASE = timedelta(seconds=2)
"""How long rows handed over in memory stay claimed by their writer's relay: the longest that a
row written just before its process died waits before another relay's sweep publishes it."""


class _PublishLater(Protocol):
    """A broker's publish that does not wait: ``then(error)`` follows on another thread, with
    None once the broker confirmed every message (``RabbitBroker.publish_later``)."""

    def __call__(
        self, batch: Sequence[tuple[str, bytes]], then: Callable[[BrokerError | None], None]
    ) -> None: ...


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
        self._in_flight = 0  # batches published without waiting, not yet confirmed or failed
        later = getattr(broker, "publish_later", None)
        self._later = cast(_PublishLater, later) if callable(later) else None

    # --- hand-over ---------------------------------------------------------------------------

    def lease_for(self, queue: str) -> timedelta | None:
        """How long a row handed over stays claimed (the same for every queue)."""
        return self.handoff_lease

    def take(self, rows: Sequence[QueuedMessage]) -> None:
        """Called by the store after a commit (any thread): publish these rows now, from this
        thread, if the broker publishes without waiting; else soon, from the relay's thread."""
        now = time.monotonic()
        if self._later is not None and rows:
            try:
                self._send_later(list(rows), now)
                return
            except Exception as e:  # not connected, too large...: the relay's thread sees to it
                logger.debug("relay: %d rows to the relay's thread (%s)", len(rows), e)
        self._hand(rows, now)

    def _hand(self, rows: Sequence[QueuedMessage], now: float) -> None:
        with self._ready:
            self._handed.extend((now, r) for r in rows)
            self._ready.notify_all()

    def _send_later(self, rows: list[QueuedMessage], held_since: float) -> None:
        """Write ``rows`` to the broker without waiting for its confirms (see the module)."""
        assert self._later is not None
        crash_point("relay.before_publish")
        ids, token = [r.id for r in rows], rows[0].claim_token

        def then(error: BrokerError | None) -> None:  # on the broker's I/O thread: never raises
            try:
                if error is None:
                    crash_point("relay.after_publish")
                    self.store.delete_later(ids, token)
                else:
                    logger.debug("relay: %d rows to the relay's thread (%s)", len(rows), error)
                    self._hand(rows, held_since)
            except Exception:
                logger.exception("relay: after publishing %d rows", len(rows))
            finally:
                self._landed()

        with self._ready:
            self._in_flight += 1
        try:
            with tracing.publish([r.body for r in rows]):  # the span sagaloop.relay.publish
                self._later([(r.queue, r.body) for r in rows], then)
        except BaseException:
            self._landed()
            raise

    def _landed(self) -> None:
        with self._ready:
            self._in_flight -= 1
            self._ready.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the batches published without waiting to be
        confirmed or handed back (at stop); return whether none is left."""
        with self._ready:
            return self._ready.wait_for(lambda: self._in_flight == 0, timeout)

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
