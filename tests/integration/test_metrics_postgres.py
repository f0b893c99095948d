"""The metrics' queries on PostgreSQL (``SqlReadModels``: run counts, halted steps, the latest
published approvals, the outbox's lag, dead letters, start backlogs, step outcomes): the
scenarios of ``tests/unit/test_metrics.py`` (SQLite) run again here, each on a database of
its own, so every value is known; and the history read in batches of runs gives the same
numbers as in one."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sagaloop.observability import SagaloopCollector
from sagaloop.store import read
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness, VirtualClock, services
from tests.unit import test_metrics as m
from tests.unit.test_metrics import (  # collected here again, on this module's `world`
    test_a_scrape_reports_runs_steps_approvals_outbox_and_dead_letters,
    test_a_store_that_fails_is_reported_not_raised,
    test_counters_count_new_events_once_across_scrapes,
    test_labels_are_bounded_names_never_run_ids,
)

pytestmark = pytest.mark.integration

__all__ = [
    "test_a_scrape_reports_runs_steps_approvals_outbox_and_dead_letters",
    "test_a_store_that_fails_is_reported_not_raised",
    "test_counters_count_new_events_once_across_scrapes",
    "test_labels_are_bounded_names_never_run_ids",
]


@pytest.fixture
def world() -> Iterator[tuple[Harness, SagaloopCollector]]:
    """The unit tests' world on a fresh PostgreSQL database: only this test's runs in it."""
    url, drop = services.fresh_database(services.postgres_url())
    env = Harness(m.app, clock=m.clock, url=url)
    try:
        assert env.store.engine.dialect.name == "postgresql"
        yield env, SagaloopCollector(env.store, clock=m.clock)
    finally:
        env.close()
        drop()


def test_the_history_read_in_batches_gives_the_same_numbers(
    world: tuple[Harness, SagaloopCollector], monkeypatch: pytest.MonkeyPatch
) -> None:
    env, collector = world
    waiting = [env.start(m.refund, f"C-{n}") for n in range(5)]
    halted = [env.start(m.transfer_saga) for _ in range(3)]
    retried = [env.start(m.retry) for _ in range(4)]
    env.run_until_idle(skip_time=True)
    assert {env.get(r).status for r in waiting} == {"waiting"}
    assert {env.get(r).status for r in halted} == {"needs_attention"}
    assert {env.get(r).status for r in retried} == {"completed"}
    monkeypatch.setattr(read, "_BATCH", 2)  # 5 waiting runs: 3 queries of the history
    samples = m.collect(collector)
    assert m.value(samples, "sagaloop_approvals_pending", saga="refund", status="pending") == 5
    assert m.value(samples, "sagaloop_steps_in_doubt", saga="transfer", step="transfer") == 3
    assert m.value(samples, "sagaloop_runs_in_doubt", saga="transfer") == 3
    flaky = {"saga": "retry", "step": "flaky", "direction": "do"}
    assert m.value(samples, "sagaloop_step_retries_total", **flaky) == 4
    assert m.value(samples, "sagaloop_step_in_doubt_total", **flaky) == 4
    done = {**flaky, "outcome": "completed"}
    assert m.value(samples, "sagaloop_step_duration_seconds_count", **done) == 4
    assert m.value(samples, "sagaloop_runs", saga="retry", status="completed") == 4
    assert m.value(samples, "sagaloop_store_up") == 1


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_the_outbox_lag_is_that_of_the_oldest_row_nobody_holds(
    dialect: str, tmp_path: Path
) -> None:
    if dialect == "postgresql":
        url, drop = services.fresh_database(services.postgres_url())
    else:
        url, drop = f"sqlite:///{tmp_path / 'metrics.db'}", lambda: None
    store = SqlStore(url)
    try:
        store.upgrade()
        t0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
        queue = "m.q"
        store.enqueue_raw([(queue, b"held")], t0 - timedelta(seconds=120))
        (held,) = store.claim(None, 1, t0 - timedelta(seconds=120), timedelta(seconds=300))
        store.enqueue_raw([(queue, b"lapsed")], t0 - timedelta(seconds=100))
        (lapsed,) = store.claim(None, 1, t0 - timedelta(seconds=100), timedelta(seconds=60))
        assert (held.body, lapsed.body) == (b"held", b"lapsed")
        store.enqueue_raw([(queue, b"free")], t0 - timedelta(seconds=30))
        store.enqueue_raw([("m.other", b"held too")], t0 - timedelta(seconds=10))
        store.claim(["m.other"], 1, t0 - timedelta(seconds=10), timedelta(seconds=300))
        clock = VirtualClock(t0)
        samples = m.collect(SagaloopCollector(store, clock=clock))
        # 3 rows; the held one (120 s old) is not waiting: the lapsed claim's row is (100 s)
        assert m.value(samples, "sagaloop_outbox_messages", queue=queue) == 3
        assert m.value(samples, "sagaloop_outbox_lag_seconds", queue=queue) == 100
        # a queue whose rows are all held waits for nobody
        assert m.value(samples, "sagaloop_outbox_messages", queue="m.other") == 1
        assert m.value(samples, "sagaloop_outbox_lag_seconds", queue="m.other") == 0
    finally:
        store.close()
        drop()
