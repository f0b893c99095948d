"""Fixtures of the integration tests: a whole sagaloop system on PostgreSQL and RabbitMQ."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from system import System


@pytest.fixture
def system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    """A fresh database and RabbitMQ namespace; the test starts the processes it needs."""
    s = System(tmp_path, rabbitmq_url)
    try:
        yield s
    finally:
        s.close()
