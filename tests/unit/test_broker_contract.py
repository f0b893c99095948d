"""The broker contract suite run against the memory and database brokers."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from sagaloop.brokers.database import DatabaseBroker
from sagaloop.brokers.memory import MemoryBroker
from sagaloop.engine.ports import Broker
from sagaloop.store.sql import SqlStore
from sagaloop.testing import VirtualClock
from sagaloop.testing.contracts import BrokerContract, BrokerUnderTest

LEASE = timedelta(seconds=30)


def _store(path: Path) -> SqlStore:
    store = SqlStore("sqlite:///" + str(path))
    store.upgrade()
    return store


class TestMemoryBroker(BrokerContract):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> Iterator[BrokerUnderTest]:
        clock = VirtualClock()
        store = _store(tmp_path / "settle.sqlite")
        broker = MemoryBroker(clock=clock, lease=LEASE)
        yield BrokerUnderTest(
            broker=broker,
            clock=clock,
            lease=LEASE,
            store=store,
            dead_letters=lambda: list(broker.dead),
            reopen=None,
        )
        broker.close()
        store.close()


class TestDatabaseBroker(BrokerContract):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> Iterator[BrokerUnderTest]:
        clock = VirtualClock()
        path = tmp_path / "queue.sqlite"
        store = _store(path)
        reopened: list[SqlStore] = []

        def reopen() -> Broker:
            other = SqlStore("sqlite:///" + str(path))
            other.check_schema()
            reopened.append(other)
            return DatabaseBroker(other, clock=clock, lease=LEASE)

        broker = DatabaseBroker(store, clock=clock, lease=LEASE)
        yield BrokerUnderTest(
            broker=broker,
            clock=clock,
            lease=LEASE,
            store=store,
            dead_letters=store.dead_letters,
            reopen=reopen,
        )
        broker.close()
        for s in [store, *reopened]:
            s.close()
