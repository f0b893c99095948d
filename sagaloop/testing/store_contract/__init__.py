"""The store contract suite: the behaviour every :class:`~sagaloop.engine.ports.Store` must
show, written once and run against each implementation (SQLite, PostgreSQL, and yours).

Run it by subclassing :class:`StoreContract` in a test module under a name that starts with
``Test`` and providing a ``store`` fixture that returns a fresh store, schema upgraded::

    import pytest
    from sagaloop.store.sql import SqlStore
    from sagaloop.testing.store_contract import StoreContract

    class TestMyStore(StoreContract):
        @pytest.fixture
        def store(self, tmp_path):
            store = SqlStore("sqlite:///" + str(tmp_path / "db.sqlite"))
            store.upgrade()
            yield store
            store.close()

"Fresh" means empty: some operations are global (``take_due_timers``, ``claim`` of every
queue, ``prune``, ``count_runs``), so each test must start with no runs, timers, inbox or
outbox rows. The store must be safe to use from several threads at once, each thread with its
own transactions, as several engine processes would.

Several tests are races: threads start together on a barrier, and a store that does not
serialize or skip locked rows produces duplicates, lost updates or errors. One test measures
that a second transaction on a run starts its critical section only after the first committed;
:attr:`StoreContract.hold` is how long the first one holds the run.

The assertions carry their own messages; call
``pytest.register_assert_rewrite("sagaloop.testing.store_contract")`` in a ``conftest.py`` for
more detail.
"""

from __future__ import annotations

from sagaloop.testing.store_contract.checkpoint import CheckpointContract
from sagaloop.testing.store_contract.listing import ListingContract
from sagaloop.testing.store_contract.messages import MessageContract
from sagaloop.testing.store_contract.retention import RetentionContract
from sagaloop.testing.store_contract.runs import RunContract
from sagaloop.testing.store_contract.timers import TimerContract

__all__ = ["StoreContract"]


class StoreContract(
    RunContract,
    CheckpointContract,
    ListingContract,
    TimerContract,
    MessageContract,
    RetentionContract,
):
    """The contract tests. Subclass it as ``TestXxx`` and provide a ``store`` fixture. Its
    parts, one module each by store role: ``runs`` (runs and history), ``checkpoint`` (a
    message's writes as one), ``timers``, ``listing`` (the runs listing's search, orders and
    pages), ``messages`` (inbox, outbox queue, rate limits) and ``retention`` (prune, large
    payloads).
    """
