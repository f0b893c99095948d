"""Schema version 2 on PostgreSQL: the checks of tests/unit/test_schema_v2.py, each on a fresh
database of its own."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sagaloop.testing import services

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))

from test_schema_v2 import check_signing_key_is_created_once, check_upgrade_from_v1

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("check", [check_upgrade_from_v1, check_signing_key_is_created_once])
def test_on_postgres(postgres_url: str, check: Callable[[str], None]) -> None:
    url, drop = services.fresh_database(postgres_url)
    try:
        check(url)
    finally:
        drop()
