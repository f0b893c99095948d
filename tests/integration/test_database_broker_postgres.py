"""The broker contract suite for the database broker on PostgreSQL (SKIP LOCKED claims)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine.ports import Broker
from sagaloop.store.sql import SqlStore
from sagaloop.testing import VirtualClock, services
from sagaloop.testing.contracts import BrokerContract, BrokerUnderTest

pytestmark = pytest.mark.integration
LEASE = timedelta(seconds=30)


class TestDatabaseBrokerOnPostgres(BrokerContract):
    @pytest.fixture
    def harness(self) -> Iterator[BrokerUnderTest]:
        url, drop = services.fresh_database(services.postgres_url())
        clock = VirtualClock()
        store = SqlStore(url)
        store.upgrade()
        opened = [store]

        def reopen() -> Broker:
            other = SqlStore(url)
            other.check_schema()
            opened.append(other)
            return DatabaseBroker(other, clock=clock, lease=LEASE)

        broker = DatabaseBroker(store, clock=clock, lease=LEASE)
        try:
            yield BrokerUnderTest(
                broker=broker,
                clock=clock,
                lease=LEASE,
                store=store,
                dead_letters=store.dead_letters,
                reopen=reopen,
            )
        finally:
            broker.close()
            for s in opened:
                s.close()
            drop()
