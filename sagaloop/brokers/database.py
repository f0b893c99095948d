"""The database broker: the outbox table is the queue. No server needed.

A consumer claims rows with a lease and a claim token; it deletes the row in the same
transaction that records the processing, so a message is gone exactly when its effects are
committed. A consumer killed mid-message leaves its lease to expire, and the row becomes
visible again with a higher delivery count. Durable across SIGKILL.

Only rows that sagaloop's store wrote (``Store.enqueue``) are trusted deliveries; bodies put
with :meth:`DatabaseBroker.publish` are not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from sagaloop.brokers.dead_letters import DeadLetter, resend_trusted
from sagaloop.engine.messages import CONTENT_TYPE
from sagaloop.engine.ports import Clock, Delivery, QueuedMessage, SystemClock, Tx
from sagaloop.errors import BrokerError
from sagaloop.store.queue import DeadLetterRow
from sagaloop.store.sql import SqlStore

logger = logging.getLogger(__name__)


class LeaseLostError(BrokerError):
    """The message's lease expired and another consumer claimed it: this work is discarded."""


class DatabaseDelivery:
    content_type: str | None = CONTENT_TYPE

    def __init__(self, broker: DatabaseBroker, row: QueuedMessage) -> None:
        self._broker = broker
        self._row = row
        self.body = row.body
        self.deliveries = row.deliveries
        self.queue = row.queue
        self.trusted = row.trusted

    def settle(self, tx: Tx) -> None:
        if self._broker.store.delete_claimed(tx, [self._row.id], self._row.claim_token) != 1:
            raise LeaseLostError(
                f"lease of message {self._row.id} on {self._row.queue!r} expired: the message "
                "was claimed again, so this attempt's result is discarded"
            )

    def ack(self) -> None:
        pass  # settled in the processing transaction

    def extend(self) -> bool:
        until = self._broker.clock.now() + self._broker.lease
        return self._broker.store.extend_claim(self._row.id, self._row.claim_token, until)

    def retry_later(self, delay: timedelta) -> None:
        now = self._broker.clock.now()
        self._broker.store.release([self._row.id], self._row.claim_token, now + delay)

    def dead_letter(self, reason: str) -> None:
        logger.warning("dead-lettering message %s from %s: %s", self._row.id, self.queue, reason)
        self._broker.store.dead_letter(
            self._row.id, self._row.claim_token, reason, self._broker.clock.now()
        )


class DatabaseBroker:
    uses_outbox = True

    def __init__(
        self,
        store: SqlStore,
        *,
        lease: timedelta = timedelta(seconds=60),
        clock: Clock | None = None,
        poll_interval: float = 0.05,
    ) -> None:
        self.store = store
        self.lease = lease
        self.clock = clock or SystemClock()
        self.poll_interval = poll_interval
        self._looks_due: dict[tuple[str, ...], float] = {}
        """Per set of queues consumed, when its idle consumers look next (see ``receive``)."""
        self._looks_lock = threading.Lock()
        self._thread = threading.local()
        """``busy``: whether this thread's last look found rows (then it looks at once)."""

    def declare(self, queues: Sequence[str]) -> None:
        pass  # rows name their queue; nothing to declare

    def publish(self, batch: Sequence[tuple[str, bytes]]) -> None:
        """Put raw bodies on the queues. Nothing of sagaloop's own goes this way (its rows are
        written by the store in the transaction that decided them), so their deliveries are
        not trusted: a step, step result or timer put here is refused."""
        self.store.enqueue_raw(batch, self.clock.now())

    def publish_raw(self, queue: str, body: bytes, *, trusted: bool = False) -> None:
        """Put one raw body on ``queue`` (for tests); ``trusted`` makes it pass for a message
        sagaloop wrote, as anyone with write access to the database can."""
        self.store.enqueue_raw([(queue, body)], self.clock.now(), trusted=trusted)

    def receive(self, queues: Sequence[str], max_messages: int, timeout: float) -> list[Delivery]:
        """Claim up to ``max_messages`` rows of ``queues``.

        - A consumer waiting for rows is woken at once by a commit of this process that queued
          one there (one consumer per row: see ``SqlCore.wait_for_writes``) and claims.
        - Rows that other processes queued (and rows that became available later) are found by
          looking: the idle consumers of the same ``queues`` take turns, so that one of them
          looks every ``poll_interval`` seconds (the most a row of another process waits for
          an idle consumer); a consumer back from work looks at once, and one whose look
          found a full batch wakes another to look too. A look without a wake is a read first
          (a claim only if a row is there): idle consumers do not write (on SQLite, a claim
          takes the database's write lock).
        """
        deadline = time.monotonic() + timeout
        key = tuple(queues)
        woken = False
        look = timeout <= 0 or getattr(self._thread, "busy", True)
        while True:
            if look and not woken:  # a wake left for this queue while its consumers worked
                woken = self.store.wait_for_writes(0, queues)
            turn = not (woken or look) and self._turn_to_look(key)
            if woken or look or turn:
                now = self.clock.now()
                rows = self.store.claim(queues, max_messages, now, self.lease, probe=not woken)
                self._thread.busy = bool(rows)
                if rows:
                    # Rows of this process's commits taken without their wake: drop the
                    # wakes (else idle consumers would claim for them in vain).
                    self.store.drop_wakes([r.queue for r in rows[1 if woken else 0 :]])
                    if turn and len(rows) == max_messages:
                        self.store.nudge([rows[-1].queue])  # maybe more there: another looks
                    return [DatabaseDelivery(self, r) for r in rows]
            look = False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            wait = min(remaining, self._until_look(key))
            woken = self.store.wait_for_writes(wait, queues)

    def _turn_to_look(self, key: tuple[str, ...]) -> bool:
        """Whether this consumer of ``key`` looks now (one per ``poll_interval`` seconds)."""
        now = time.monotonic()
        with self._looks_lock:
            if now < self._looks_due.get(key, 0.0):
                return False
            self._looks_due[key] = now + self.poll_interval
            return True

    def _until_look(self, key: tuple[str, ...]) -> float:
        with self._looks_lock:
            due = self._looks_due.get(key, 0.0)
        return max(due - time.monotonic(), 0.001)

    def close(self) -> None:
        pass

    # --- dead letters (sagaloop.brokers.dead_letters.DeadLetters) ----------------------------
    # Rows of sagaloop_dead_letters; a dead letter's id is its row's id. Their trust was not
    # recorded: see ``resend_trusted``.

    def list_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        return [_letter(r) for r in self.store.dead_letter_rows(limit=limit)]

    def find_dead_letter(self, id: str) -> DeadLetter | None:
        rows = self.store.dead_letter_rows(ids=_row_ids([id]))
        return _letter(rows[0]) if rows else None

    def count_dead_letters(self) -> int:
        return self.store.count_dead_letters()

    def resend_dead_letters(self, ids: Sequence[str] | None = None) -> list[DeadLetter]:
        """Back to their queues in one transaction (so, all or none)."""
        rows = self.store.requeue_dead_letters(
            _row_ids(ids), self.clock.now(), trusted=resend_trusted
        )
        return [_letter(r) for r in rows]

    def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        return self.store.delete_dead_letters(_row_ids(ids))


def _row_ids(ids: Sequence[str] | None) -> list[int] | None:
    """The row ids among ``ids`` (what is not one names no dead letter)."""
    if ids is None:
        return None
    return [int(i) for i in ids if i.isascii() and i.isdigit() and len(i) < 19]


def _letter(row: DeadLetterRow) -> DeadLetter:
    return DeadLetter(str(row.id), row.queue, row.reason, row.at, row.body, CONTENT_TYPE)
