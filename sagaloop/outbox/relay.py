"""The outbox relay: publishes what transactions wrote to the outbox, for brokers whose queues
live outside the database. (With the database broker the outbox *is* the queue: no relay.)

Rows are claimed with a lease and a claim token, published as one confirmed batch, then deleted
by claim token. A relay killed after publishing and before deleting leaves rows that are
published again when their lease expires: consumers deduplicate them by ``message_id`` in their
inbox, so a duplicate publish never becomes a duplicate effect. A row the broker will never
accept (unroutable, too large) is moved to the dead letters with the reason, so that it cannot
block the rows behind it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

from sagaloop.engine.crashpoints import crash_point
from sagaloop.engine.ports import Broker, Clock, QueuedMessage, Store, SystemClock
from sagaloop.errors import UndeliverableError

logger = logging.getLogger(__name__)


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

    def relay_once(self) -> int:
        """Publish one batch; return how many rows left the outbox."""
        rows = self.store.claim(None, self.batch, self.clock.now(), self.lease)
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
        try:
            self.broker.publish([(r.queue, r.body) for r in rows])
        except UndeliverableError as e:
            if len(rows) > 1:
                raise
            logger.error("outbox row %s to %r dead-lettered: %s", rows[0].id, rows[0].queue, e)
            self.store.dead_letter(rows[0].id, rows[0].claim_token, str(e), self.clock.now())
            return
        except Exception:
            # Some may have gone out: publishing them again is safe (consumers deduplicate by
            # message_id), losing them is not. Release the claim so they go in the next batch.
            now = self.clock.now()
            for r in rows:
                self.store.release(r.id, r.claim_token, now)
            raise
        crash_point("relay.after_publish")
        self.store.delete_claimed(None, [r.id for r in rows], rows[0].claim_token)
