"""The crash matrix: every named crash point, on the embedded default (one `sagaloop dev`
process, SQLite, database broker) and on RabbitMQ + PostgreSQL (separate `sagaloop engine` and
`sagaloop worker` processes). Each cell arms one point at a pass in the middle of a saga, checks
that the process died of SIGKILL there, restarts it without the point, and checks from outside
the engine: the run's end state, every effect and compensation exactly once (newest first),
bodies re-run only where the guarantees allow it, sound histories, no dead letters.

The relay points do not exist on the embedded default (the outbox is the queue, no relay): there
the cell checks that the armed process is never killed. The cells are listed in matrix.py.

The points of in-process steps (``local.*``) kill the process that runs them (the engine on
RabbitMQ, dev on the embedded default) in sagas of ``local=True`` steps (matrix_app.py).

The primitives of issue 11 (child start, runs started and sent events by a run, continue-as-new,
a running step cancelled through its heartbeats) are crashed at the engine's and the worker's
commit points on both backends, with the same checks extended to every run the saga started;
those cells are listed in matrix_primitives.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from matrix import CELLS, EMBEDDED, RABBIT, RELAY_POINTS, Cell, System, check, drive, make_system
from matrix_primitives import (
    PRIMITIVE_CELLS,
    PrimitiveCell,
    check_primitive,
    drive_primitive,
    make_primitive_system,
)
from matrix_publish import PUBLISH_CELLS

from sagaloop.runtime.crashpoints import POINTS

pytestmark = pytest.mark.chaos


@pytest.fixture
def system(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[System]:
    cell: Cell | PrimitiveCell = request.param
    url = request.getfixturevalue("rabbitmq_url") if cell.backend == RABBIT else None
    if isinstance(cell, PrimitiveCell):
        s = make_primitive_system(cell, tmp_path, url)
    else:
        s = make_system(cell, tmp_path, url)
    try:
        yield s
    finally:
        s.close()


LOCAL_IN_MAKE_TEST = {
    (RABBIT, "local.before_commit", "local-sequence"),
    (EMBEDDED, "local.undo_before_commit", "local-then-fail"),
}
"""The cells of the in-process steps' points (``local.*``) that `make test` runs: one per
backend, the engine's on RabbitMQ and dev's on the embedded default; `make chaos` runs them all
(marker ``long``: the suite's time budget)."""


def _marks(cell: Cell) -> tuple[pytest.MarkDecorator, ...]:
    local = cell.point.startswith("local.")
    if local and (cell.backend, cell.point, cell.saga) not in LOCAL_IN_MAKE_TEST:
        return (pytest.mark.long,)
    return ()


@pytest.mark.parametrize(
    ("cell", "system"),
    [pytest.param(c, c, marks=_marks(c), id=c.id) for c in CELLS],
    indirect=["system"],
)
def test_crash_point(cell: Cell, system: System) -> None:
    run_id = drive(cell, system)
    check(cell, system, run_id)


IN_MAKE_TEST = {(RABBIT, "engine.before_commit"), (EMBEDDED, "worker.before_commit")}
"""The primitive cells `make test` runs (each primitive once per backend, at a commit point of
the engine on RabbitMQ and of the worker on the embedded default); `make chaos` runs them all
(marker ``long``: the suite's time budget)."""


@pytest.mark.parametrize(
    ("cell", "system"),
    [
        pytest.param(
            c, c, marks=() if (c.backend, c.point) in IN_MAKE_TEST else pytest.mark.long, id=c.id
        )
        for c in PRIMITIVE_CELLS
    ],
    indirect=["system"],
)
def test_crash_point_primitive(cell: PrimitiveCell, system: System) -> None:
    run_id = drive_primitive(cell, system)
    check_primitive(cell, system, run_id)


def test_the_matrix_covers_every_crash_point_on_both_backends() -> None:
    for backend in (EMBEDDED, RABBIT):
        cells = [c for c in CELLS if c.backend == backend]
        fanout = {c.point for c in PUBLISH_CELLS if c.backend == backend}  # matrix_publish.py
        assert {c.point for c in cells} | fanout == set(POINTS), backend
        absent = RELAY_POINTS if backend == EMBEDDED else frozenset()
        assert {c.point for c in cells if not c.reached} == absent, backend
    assert "worker.undo_before_commit" in {c.point for c in CELLS if c.saga == "then-fail"}
    assert {c.saga for c in CELLS if c.point == "timers.before_commit"} == {"naps"}
    assert {c.saga for c in CELLS if c.point == "debounce.before_commit"} == {"debounced"}
    for backend, role in ((EMBEDDED, "dev"), (RABBIT, "engine")):  # runs in-process steps
        local = [c for c in CELLS if c.backend == backend and c.point.startswith("local.")]
        assert {c.role for c in local} == {role}, backend
        assert all(c.reached and c.saga.startswith("local-") for c in local), backend
    points = {"engine.before_commit", "engine.after_commit"}
    points |= {"worker.before_commit", "worker.after_commit"}
    for backend in (EMBEDDED, RABBIT):
        for saga in ("family", "boss", "cycle", "long"):  # child start, send_event, ...
            cells = [c for c in PRIMITIVE_CELLS if c.backend == backend and c.saga == saga]
            assert {c.point for c in cells} >= points, (backend, saga)
