"""The SQL store: runs, history, timers, inbox and outbox on SQLAlchemy Core.

SQLite (the embedded default) is used in WAL mode with ``BEGIN IMMEDIATE`` write transactions,
so that activations, claims and timer firings of several processes are serialized by the
database. On PostgreSQL, ``lock_run`` takes the run's row lock (``FOR UPDATE``) and claims skip
rows other transactions hold (``FOR UPDATE SKIP LOCKED``). Dialect specifics are chosen in
``store/`` and nowhere else; driver errors leave the store as :class:`~sagaloop.errors.StoreError`
or, when worth retrying, :class:`~sagaloop.errors.TransientStoreError` (see ``connect.py``).

``SqlStore`` is composed of one mixin per role of the store port
(:class:`~sagaloop.engine.ports.Store`), each in its module over the connection and
transaction core of ``core.py``:

=================  ===============  =====================================================
module             mixin            roles (``engine/ports.py``, ``feature_stores.py``)
=================  ===============  =====================================================
``core.py``        ``SqlCore``      ``Transactions``, ``check_schema``, ``close``
``runs.py``        ``SqlRuns``      ``RunStore``, ``RunQueries``, ``prune``
``checkpoint.py``  ``SqlCheckpoints``  ``RunStore.write_checkpoint`` (one statement on PG)
``timers.py``      ``SqlTimers``    ``TimerStore``
``inbox.py``       ``SqlInbox``     ``InboxStore``
``queue.py``       ``SqlOutbox``    ``OutboxQueue`` (and the dead letters)
``limits.py``      ``SqlRateLimits``  ``RateLimits``
``approvals.py``   ``SqlApprovals``   ``ApprovalStore``
``processes.py``   ``SqlRegistry``  ``ProcessRegistry`` (and the registry's writes)
``schedules.py``   ``SqlSchedules``   ``ScheduleStore`` (not a role of every ``Store``)
``concurrency.py``  ``SqlConcurrency``  ``ConcurrencySlots`` (run concurrency keys)
``subscriptions.py``  ``SqlSubscriptions``  ``SubscriptionStore`` (published events)
``debounce.py``    ``SqlDebounce``    ``DebounceStore`` (debounced starts)
``read.py``        ``SqlReadModels``  the operators' read models (metrics, health)
=================  ===============  =====================================================
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

import sqlalchemy as sa

from sagaloop.store import tables as t
from sagaloop.store.approvals import SqlApprovals
from sagaloop.store.checkpoint import SqlCheckpoints
from sagaloop.store.concurrency import SqlConcurrency
from sagaloop.store.connect import create_sa_engine
from sagaloop.store.debounce import SqlDebounce
from sagaloop.store.inbox import SqlInbox
from sagaloop.store.limits import SqlRateLimits
from sagaloop.store.processes import SqlRegistry
from sagaloop.store.queue import DELETE_CHUNK, SqlOutbox
from sagaloop.store.read import SqlReadModels, StepOutcome
from sagaloop.store.runs import FINISHED, SqlRuns
from sagaloop.store.schedules import SqlSchedules
from sagaloop.store.subscriptions import SqlSubscriptions
from sagaloop.store.timers import SqlTimers

__all__ = ["DELETE_CHUNK", "FINISHED", "SqlStore", "StepOutcome", "create_sa_engine"]

SIGNING_KEY = "message-signing-key"
"""The name of the signing key in ``sagaloop_secrets``."""


class SqlStore(
    SqlCheckpoints,
    SqlRuns,
    SqlTimers,
    SqlInbox,
    SqlOutbox,
    SqlRateLimits,
    SqlApprovals,
    SqlRegistry,
    SqlReadModels,
    SqlSchedules,
    SqlConcurrency,
    SqlSubscriptions,
    SqlDebounce,
):
    """The :class:`~sagaloop.engine.ports.Store` on SQLite or PostgreSQL.

    The keyword options size and bound the connection pool (see :func:`create_sa_engine`);
    they are ignored when an ``engine`` is given.
    """

    def signing_key(self) -> bytes:
        """The key that signs sagaloop's internal messages on a broker outside the database:
        32 random bytes, created by the first process that asks (race-free: insert if absent,
        then read what won), the same for every process of this database."""
        now = datetime.now(UTC)
        with self.transaction() as tx:
            values = {"name": SIGNING_KEY, "value": secrets.token_bytes(32), "created_at": now}
            self._insert_ignore(tx.conn, t.secrets, values)
            q = sa.select(t.secrets.c.value).where(t.secrets.c.name == SIGNING_KEY)
            return bytes(tx.conn.execute(q).scalar_one())
