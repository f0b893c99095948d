"""The metrics' queries on PostgreSQL (``SqlReadModels``: run counts, halted steps, the latest
published approvals, the outbox's lag, dead letters, start backlogs, step outcomes): the
scenarios of ``tests/unit/test_metrics.py`` (SQLite) run again here, each on a database of
its own, so every value is known; and the history read in batches of runs gives the same
numbers as in one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sagaloop.observability import SagaloopCollector
from sagaloop.store import read
from sagaloop.testing import Harness, services
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
