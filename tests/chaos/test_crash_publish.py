"""The crash cells of published events (listed in matrix_publish.py): the engine SIGKILLed in
the middle of a fan-out, restarted, and every subscriber served exactly once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from matrix_publish import (
    PUBLISH_CELLS,
    PublishCell,
    drive_and_check_publish,
    make_publish_system,
)
from system import System

pytestmark = pytest.mark.chaos


@pytest.fixture
def system(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[System]:
    cell: PublishCell = request.param
    url = request.getfixturevalue("rabbitmq_url") if cell.backend == "rabbit" else None
    made = make_publish_system(cell, tmp_path, url)
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize(
    ("cell", "system"), [pytest.param(c, c, id=c.id) for c in PUBLISH_CELLS], indirect=["system"]
)
def test_crash_point_publish(cell: PublishCell, system: System) -> None:
    drive_and_check_publish(cell, system)
