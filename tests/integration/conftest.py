"""Fixtures of the integration tests: a whole sagaloop system on PostgreSQL and RabbitMQ."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from system import System

from sagaloop.testing import services


@pytest.fixture(scope="module")
def database(postgres_url: str) -> Iterator[str]:
    """A database of the test module's own, on the session's server, schema upgraded."""
    with services.migrated_database(postgres_url) as url:
        yield url


@pytest.fixture
def system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    """A fresh database and RabbitMQ namespace; the test starts the processes it needs."""
    s = System(tmp_path, rabbitmq_url)
    try:
        yield s
    finally:
        s.close()
