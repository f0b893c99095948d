"""Prometheus metrics read from the store at scrape time (``sagaloop.observability``): a
harness-made world of runs (completed, failed, halted in doubt, waiting for an approval), a
retried step, an outbox row and a dead letter, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sagaloop import App, ApplicationError, Client, RetryPolicy, SagaContext, StepContext
from sagaloop.engine.messages import engine_queue, start_queue
from sagaloop.extras import install_command
from sagaloop.observability import SagaloopCollector, serve_metrics
from sagaloop.testing import Harness, VirtualClock

app = App("metrics")
clock = VirtualClock()
FAST = RetryPolicy(max_attempts=3, initial_interval=timedelta(seconds=1))


@app.step()
def charge(ctx: StepContext, cents: int) -> str:
    clock.advance(timedelta(seconds=2))  # the attempt takes 2 s
    return f"charged {cents}"


@app.step(retry=FAST)
def flaky(ctx: StepContext) -> str:
    if ctx.attempt == 1:
        raise ConnectionError("the response was lost")  # in doubt: retried
    return "ok"


@app.step()
def hold(ctx: StepContext) -> str:
    return "held"


@hold.compensation
def release(ctx: StepContext, ref: str) -> None:
    pass


@app.step()
def refuse(ctx: StepContext) -> None:
    raise ApplicationError("card refused", non_retryable=True)


@app.step(idempotent=False, retry=FAST)
def transfer(ctx: StepContext) -> None:
    raise ConnectionError("timed out")  # in doubt, never re-attempted: halted


@app.saga(name="pay")
async def pay(ctx: SagaContext, cents: int) -> str:
    return await ctx.call(charge, cents)


@app.saga(name="retry")
async def retry(ctx: SagaContext) -> str:
    return await ctx.call(flaky)


@app.saga(name="refuse")
async def refuse_saga(ctx: SagaContext) -> None:
    await ctx.call(hold)
    await ctx.call(refuse)  # fails for good: the hold is released


@app.saga(name="transfer")
async def transfer_saga(ctx: SagaContext) -> None:
    await ctx.call(transfer)


@app.saga(name="refund")
async def refund(ctx: SagaContext, order: str) -> bool:
    ok = await ctx.approval("issue_refund", {"order": order})
    return ok.approved


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[str, Samples]:
    """What Prometheus reads at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return parse(response.read().decode())


def collect(collector: SagaloopCollector) -> Samples:
    """The same exposition, without a server (what ``serve_metrics`` serves)."""
    registry = CollectorRegistry()
    registry.register(collector)
    return parse(generate_latest(registry).decode())[1]


def parse(text: str) -> tuple[str, Samples]:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def world() -> Iterator[tuple[Harness, SagaloopCollector]]:
    env = Harness(app, clock=clock)
    collector = SagaloopCollector(env.store, clock=clock)  # counts what happens from now on
    try:
        yield env, collector
    finally:
        env.close()


def test_a_scrape_reports_runs_steps_approvals_outbox_and_dead_letters(
    world: tuple[Harness, SagaloopCollector],
) -> None:
    env, collector = world
    env.start(pay, 1299)
    env.start(retry)
    env.start(refuse_saga)
    halted = env.start(transfer_saga)
    answered, waiting = env.start(refund, "A-1"), env.start(refund, "A-2")
    env.run_until_idle(skip_time=True)
    env.approve(answered, "0")
    env.broker.publish_raw(engine_queue(app.name), b"not json")  # dead-lettered
    env.run_until_idle(skip_time=False)
    assert env.get(halted).status == "needs_attention"
    assert env.get(waiting).status == "waiting"
    env.start(pay, 1)  # its start message stays in the outbox...
    clock.advance(timedelta(seconds=30))  # ...for 30 s

    with serve_metrics(0, collector=collector) as server:
        text, samples = scrape(server.url)
        _, again = scrape(server.url)

    assert value(samples, "sagaloop_runs", saga="pay", status="completed") == 1
    assert value(samples, "sagaloop_runs", saga="pay", status="running") == 1
    assert value(samples, "sagaloop_runs", saga="retry", status="completed") == 1
    assert value(samples, "sagaloop_runs", saga="refuse", status="compensated") == 1
    assert value(samples, "sagaloop_runs", saga="transfer", status="needs_attention") == 1
    assert value(samples, "sagaloop_runs", saga="pay", status="needs_attention") == 0
    assert value(samples, "sagaloop_runs", saga="refund", status="waiting") == 1
    assert value(samples, "sagaloop_runs", saga="refund", status="completed") == 1
    assert value(samples, "sagaloop_steps_in_doubt", saga="transfer", step="transfer") == 1
    assert value(samples, "sagaloop_runs_in_doubt", saga="transfer") == 1
    assert value(samples, "sagaloop_runs_in_doubt", saga="pay") == 0
    assert value(samples, "sagaloop_approvals_pending", saga="refund", status="pending") == 1
    assert value(samples, "sagaloop_approvals_pending", saga="refund", status="escalated") == 0
    assert value(samples, "sagaloop_approvals_oldest_age_seconds", saga="refund") >= 30
    starts = start_queue(app.name)
    assert value(samples, "sagaloop_outbox_messages", queue=starts) == 1
    assert value(samples, "sagaloop_outbox_lag_seconds", queue=starts) == 30
    assert value(samples, "sagaloop_dead_letters", queue=engine_queue(app.name)) == 1
    assert value(samples, "sagaloop_start_backlog", app=app.name) == 1  # that run, not taken up
    assert value(samples, "sagaloop_start_backlog_limit") == 10_000
    assert value(samples, "sagaloop_store_up") == 1

    # the step outcomes: one per attempt, with its latency from dispatch to outcome
    do = {"direction": "do"}
    charged = {"saga": "pay", "step": "charge", **do, "outcome": "completed"}
    assert value(samples, "sagaloop_step_duration_seconds_count", **charged) == 1
    assert value(samples, "sagaloop_step_duration_seconds_sum", **charged) == 2
    assert value(samples, "sagaloop_step_duration_seconds_bucket", **charged, le="1.0") == 0
    assert value(samples, "sagaloop_step_duration_seconds_bucket", **charged, le="2.5") == 1
    assert value(samples, "sagaloop_step_duration_seconds_bucket", **charged, le="+Inf") == 1
    flaky_step = {"saga": "retry", "step": "flaky", **do}
    for outcome in ("retrying", "completed"):
        labels = {**flaky_step, "outcome": outcome}
        assert value(samples, "sagaloop_step_duration_seconds_count", **labels) == 1
    assert value(samples, "sagaloop_step_retries_total", **flaky_step) == 1
    assert value(samples, "sagaloop_step_in_doubt_total", **flaky_step) == 1
    refused = {"saga": "refuse", "step": "refuse", **do}
    assert value(samples, "sagaloop_step_duration_seconds_count", **refused, outcome="failed") == 1
    assert ("sagaloop_step_in_doubt_total", frozenset(refused.items())) not in samples  # proven
    released = {"saga": "refuse", "step": "hold", "direction": "undo", "outcome": "completed"}
    assert value(samples, "sagaloop_step_duration_seconds_count", **released) == 1
    transferred = {"saga": "transfer", "step": "transfer", **do}
    halted_attempt = {**transferred, "outcome": "halted"}
    assert value(samples, "sagaloop_step_duration_seconds_count", **halted_attempt) == 1
    assert value(samples, "sagaloop_step_in_doubt_total", **transferred) == 1

    # the exposition follows Prometheus' conventions, and a second scrape counts nothing twice
    assert "# TYPE sagaloop_step_retries_total counter" in text
    assert "# TYPE sagaloop_step_duration_seconds histogram" in text
    assert "# TYPE sagaloop_outbox_lag_seconds gauge" in text
    assert 'sagaloop_step_retries_total{direction="do",saga="retry",step="flaky"} 1.0' in text
    assert "python_info" in text  # and the process's own metrics
    counted = {k: v for k, v in samples.items() if k[0].startswith("sagaloop_step_")}
    assert {k: again[k] for k in counted} == counted


def test_counters_count_new_events_once_across_scrapes(
    world: tuple[Harness, SagaloopCollector],
) -> None:
    env, collector = world
    flaky_step = {"saga": "retry", "step": "flaky", "direction": "do"}
    with serve_metrics(0, collector=collector, process_metrics=False) as server:
        _, before = scrape(server.url)
        assert ("sagaloop_step_retries_total", frozenset(flaky_step.items())) not in before
        for expected in (1, 2):
            env.start(retry)
            env.run_until_idle()
            clock.advance(timedelta(seconds=5))  # within the overlap: read again, not counted
            _, samples = scrape(server.url)
            assert value(samples, "sagaloop_step_retries_total", **flaky_step) == expected
        clock.advance(timedelta(hours=1))  # past the overlap and the window: forgotten
        _, later = scrape(server.url)
        assert value(later, "sagaloop_step_retries_total", **flaky_step) == 2


def test_labels_are_bounded_names_never_run_ids(world: tuple[Harness, SagaloopCollector]) -> None:
    env, _ = world
    collector = SagaloopCollector(env.store, clock=clock, max_names=3)
    run_ids = {env.start(pay, n) for n in range(5)} | {env.start(retry), env.start(refund, "B")}
    env.run_until_idle()
    # a start of a saga nobody declared fails its run, but its name is stored
    by_name = Client(env.store, app.name, clock=clock)
    run_ids |= {by_name.start(f"unknown-{n}") for n in range(5)}
    env.run_until_idle()
    samples = collect(collector)
    label_names = {name for _, labels in samples for name, _ in labels}
    assert label_names <= {"saga", "step", "status", "queue", "direction", "outcome", "le"}
    values = {v for _, labels in samples for _, v in labels}
    assert not values & run_ids
    sagas = {v for _, labels in samples for k, v in labels if k == "saga"}
    assert len(sagas) == 4 and "_other" in sagas  # 3 names, then the rest together
    total = sum(v for (name, _), v in samples.items() if name == "sagaloop_runs")
    assert total == len(run_ids)


def test_a_store_that_fails_is_reported_not_raised(
    world: tuple[Harness, SagaloopCollector], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sagaloop.errors import StoreError

    env, collector = world

    def down(*_: Any, **__: Any) -> Any:
        raise StoreError("the database is down")

    monkeypatch.setattr(env.store, "outbox_summary", down)
    samples = collect(collector)
    assert value(samples, "sagaloop_store_up") == 0
    assert ("sagaloop_metrics_collect_duration_seconds", frozenset()) in samples


class Rabbit:
    """A broker outside the database, as the collector sees it."""

    uses_outbox = False

    def count_dead_letters(self) -> int:
        return 3


def test_a_broker_outside_the_database_reports_its_dead_letters(
    world: tuple[Harness, SagaloopCollector],
) -> None:
    env, _ = world
    samples = collect(SagaloopCollector(env.store, Rabbit(), clock=clock))
    assert value(samples, "sagaloop_broker_dead_letters") == 3
    # the database broker's are the store's, counted per queue
    samples = collect(SagaloopCollector(env.store, env.broker, clock=clock))
    assert ("sagaloop_broker_dead_letters", frozenset()) not in samples


def test_without_the_extra_the_error_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import sagaloop\n"
        "try:\n"
        "    import sagaloop.observability\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert install_command("metrics") in out.stdout, out.stdout
