"""The process registry contract (tests/unit/test_processes.py) on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sagaloop.store.sql import SqlStore
from tests.unit.test_processes import RegistryContract

pytestmark = pytest.mark.integration


class TestRegistryOnPostgres(RegistryContract):
    @pytest.fixture
    def store(self, postgres_url: str) -> Iterator[SqlStore]:
        store = SqlStore(postgres_url)
        yield store
        store.close()
