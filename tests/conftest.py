"""Fixtures shared by every test folder: real services for integration tests, found as
DESIGN.md section 12 says (env vars, testcontainers, local defaults, else a clear failure)."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("sagaloop.testing.contracts", "sagaloop.testing.store_contract")

from collections.abc import Iterator  # noqa: E402

from sagaloop.testing import services  # noqa: E402


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A database of its own for this test session, schema upgraded, dropped at the end."""
    with services.migrated_database(services.postgres_url()) as url:
        yield url


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """The broker for this test session (give each test its own queue prefix or vhost)."""
    return services.rabbitmq_url()
