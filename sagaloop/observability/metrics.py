"""Prometheus metrics, read from the store when Prometheus scrapes them.

Nothing in the engine or the workers is instrumented: :class:`SagaloopCollector` runs a few
bounded aggregate queries against the store on each scrape (``SqlStore.run_counts``,
``outbox_summary``, ``dead_letters_per_queue``, ``latest_published``, ``halted_steps``,
``step_outcomes``), so the numbers are those of the whole database, whichever process serves
them. The step counters and the latency histogram are this process's tally of the history
events recorded since it started: the history has no global order to keep a high-water mark
on, so each scrape reads the step outcomes recorded in a time window (since the previous
scrape, less ``overlap`` for transactions that committed late or clocks that differ), and
remembers the events of that overlap so that none is counted twice.

Labels are saga and step names, queue names and statuses, never run ids; each kind of name
admits at most ``max_names`` distinct values (the first seen), later ones are counted under
``_other`` (a raw start message can name any saga: its run fails, but its name is stored).

docs/operations.md ("Metrics") lists the metrics and what they mean.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

try:
    from prometheus_client import (
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        start_http_server,
    )
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector
    from prometheus_client.utils import floatToGoString as _floatToGoString
except ModuleNotFoundError as e:  # pragma: no cover - the extra is missing
    from sagaloop.extras import missing_extra

    raise missing_extra("sagaloop's metrics", "metrics", e) from e

from sagaloop.client.admission import START_BACKLOG, limit_from_env
from sagaloop.engine import history as h
from sagaloop.engine.ports import Clock, SystemClock
from sagaloop.engine.state import ALL_STATUSES, FINAL_STATUSES
from sagaloop.errors import SagaloopError
from sagaloop.sagas.approvals import KEY_PREFIX, OPEN_STATUSES
from sagaloop.store.sql import SqlStore, StepOutcome

__all__ = ["DEFAULT_BUCKETS", "MetricsServer", "SagaloopCollector", "serve_metrics"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
"""Upper bounds (seconds) of the step latency histogram: from local steps to LLM calls and
steps that waited in a queue."""
OTHER = "_other"
"""The label value of the names past ``max_names``."""

_OUTCOMES = {
    h.STEP_COMPLETED: ("do", "completed"),
    h.STEP_RETRYING: ("do", "retrying"),
    h.STEP_FAILED: ("do", "failed"),
    h.STEP_HALTED: ("do", "halted"),
    h.COMPENSATION_COMPLETED: ("undo", "completed"),
    h.COMPENSATION_RETRYING: ("undo", "retrying"),
    h.COMPENSATION_FAILED: ("undo", "failed"),
}
_OPEN_RUN_STATUSES = [s for s in ALL_STATUSES if s not in FINAL_STATUSES]
_STEP_LABELS = ["saga", "step", "direction"]
_le: Callable[[float], str] = _floatToGoString
"""A bucket's bound as Prometheus writes it (``0.5``, ``+Inf``)."""

StepKey = tuple[str, str, str]
"""(saga, step, direction)."""


@runtime_checkable
class CountsDeadLetters(Protocol):
    """A broker that can say how many dead letters it holds (``count_dead_letters``, of the
    brokers' ``DeadLetters``) and whether the outbox is its queue (then its dead letters are
    the store's, counted per queue already)."""

    uses_outbox: bool

    def count_dead_letters(self) -> int: ...


class _Names:
    """The first ``limit`` distinct values of a label, kept as they are; later ones: OTHER."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._admitted: set[str] = set()

    def __call__(self, name: str) -> str:
        if name in self._admitted:
            return name
        if len(self._admitted) >= self.limit:
            return OTHER
        self._admitted.add(name)
        return name


class SagaloopCollector(Collector):
    """The metrics of the runs, steps, outbox, dead letters and approvals in ``store``.

    ``broker``: with one outside the database that counts its dead letters
    (:class:`CountsDeadLetters`: RabbitMQ), ``sagaloop_broker_dead_letters`` too. Step outcomes
    recorded before this collector was made are not counted; a gap between two scrapes longer
    than ``max_window`` is read only for its last ``max_window``. Each read of a scrape takes
    at most ``max_rows`` runs (and step outcomes): past that, the numbers are short
    (``sagaloop_metrics_truncated_reads`` counts it for the step outcomes).
    """

    def __init__(
        self,
        store: SqlStore,
        broker: object | None = None,
        *,
        clock: Clock | None = None,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        overlap: timedelta = timedelta(seconds=60),
        max_window: timedelta = timedelta(minutes=10),
        max_rows: int = 100_000,
        max_names: int = 500,
    ) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("buckets must be increasing upper bounds, in seconds")
        self.store = store
        self.broker = broker
        self.clock: Clock = clock or SystemClock()
        self.buckets = tuple(float(b) for b in buckets)
        self.overlap = overlap
        self.max_window = max_window
        self.max_rows = max_rows
        self._sagas, self._steps, self._queues = (_Names(max_names) for _ in range(3))
        self._lock = threading.Lock()
        self._started = self._last = self.clock.now()
        self._seen: dict[tuple[str, int, datetime], datetime] = {}
        """The outcomes already counted that the next window may read again."""
        self._histograms: dict[tuple[str, str, str, str], list[int]] = {}
        self._sums: dict[tuple[str, str, str, str], float] = {}
        self._retries: Counter[StepKey] = Counter()
        self._in_doubt: Counter[StepKey] = Counter()
        self._truncated = 0

    # --- prometheus_client's Collector -------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        """The families, without samples and without a query (what a registry checks names
        with)."""
        with self._lock:
            return self._families(now=None)

    def collect(self) -> Iterable[Metric]:
        with self._lock:  # the HTTP server answers scrapes on threads of their own
            began = time.perf_counter()
            families = self._families(now=self.clock.now())
            took = GaugeMetricFamily(
                "sagaloop_metrics_collect_duration_seconds",
                "Time this scrape took to read the store.",
                value=time.perf_counter() - began,
            )
        return [*families, took]

    # --- the families ------------------------------------------------------------------------

    def _families(self, now: datetime | None) -> list[Metric]:
        """Every family; with ``now`` None, empty ones (nothing read)."""
        failed: list[str] = []

        def read(what: str, fn: Callable[[], Any], default: Any) -> Any:
            if now is None or failed:  # after a failure (the database is down?), skip the rest
                return default
            try:
                return fn()
            except SagaloopError as e:  # the scrape still answers, with sagaloop_store_up 0
                failed.append(what)
                logger.warning("metrics: reading the %s failed: %s", what, e)
                return default

        runs: dict[tuple[str, str], int] = read("runs", self.store.run_counts, {})
        halted: list[tuple[str, str, str]] = read(
            "halted steps", lambda: self.store.halted_steps(limit=self.max_rows), []
        )
        approvals: list[tuple[str, str, str, Any]] = read(
            "approvals",
            lambda: self.store.latest_published(
                KEY_PREFIX, _OPEN_RUN_STATUSES, limit=self.max_rows
            ),
            [],
        )
        outbox: dict[str, tuple[int, datetime | None]] = read(
            "outbox", lambda: self.store.outbox_summary(now or self._last), {}
        )
        dead: dict[str, int] = read("dead letters", self.store.dead_letters_per_queue, {})
        backlogs: dict[str, int] = read("start backlog", self.store.start_backlogs, {})
        if now is not None:
            read("step outcomes", lambda: self._observe_steps(now), None)
        sagas = sorted({self._sagas(saga) for saga, _ in runs})
        out = [
            *self._run_families(runs, sagas),
            *self._doubt_families(halted, sagas),
            *self._approval_families(approvals, sagas, now),
            *self._queue_families(outbox, dead, now),
            *self._admission_families(backlogs, now),
            *self._step_families(),
        ]
        up = GaugeMetricFamily(
            "sagaloop_store_up",
            "1 when every read of the store in this scrape succeeded; 0 when one failed (the "
            "log says why): what it and the reads after it report is missing.",
        )
        if now is not None:
            up.add_metric([], 0.0 if failed else 1.0)
        out.append(up)
        broker = self._broker_dead_letters(now)
        if broker is not None:
            out.append(broker)
        return out

    def _run_families(self, runs: dict[tuple[str, str], int], sagas: list[str]) -> list[Metric]:
        family = GaugeMetricFamily(
            "sagaloop_runs",
            "Runs in the store, per saga and status (every status listed, 0 included: "
            'status="needs_attention" is what waits for an operator).',
            labels=["saga", "status"],
        )
        counts: Counter[tuple[str, str]] = Counter()
        for (saga, status), n in runs.items():
            counts[(self._sagas(saga), status)] += n
        statuses = [*ALL_STATUSES, *sorted({st for _, st in counts} - set(ALL_STATUSES))]
        for saga in sagas:
            for status in statuses:
                family.add_metric([saga, status], counts[(saga, status)])
        return [family]

    def _admission_families(self, backlogs: dict[str, int], now: datetime | None) -> list[Metric]:
        backlog = GaugeMetricFamily(
            "sagaloop_start_backlog",
            "Runs started that no engine took up yet, per app: they wait in the start queue "
            "(the engine serves the runs in flight first, within its start window).",
            labels=["app"],
        )
        for app, n in sorted(backlogs.items()):
            backlog.add_metric([app], n)
        limit = GaugeMetricFamily(
            "sagaloop_start_backlog_limit",
            "The start backlog at which Client.start refuses new runs (SAGALOOP_START_BACKLOG "
            "of this process; 0: no limit).",
        )
        if now is not None:
            limit.add_metric([], limit_from_env("SAGALOOP_START_BACKLOG", None, START_BACKLOG))
        return [backlog, limit]

    def _doubt_families(self, halted: list[tuple[str, str, str]], sagas: list[str]) -> list[Metric]:
        steps = GaugeMetricFamily(
            "sagaloop_steps_in_doubt",
            "Steps halted in doubt (they may have taken effect; not re-attempted) in runs that "
            "need attention: check the effect, then `sagaloop retry` the run.",
            labels=["saga", "step"],
        )
        runs = GaugeMetricFamily(
            "sagaloop_runs_in_doubt",
            "Runs that need attention because a step of theirs is halted in doubt.",
            labels=["saga"],
        )
        per_step: Counter[tuple[str, str]] = Counter()
        per_run: dict[str, set[str]] = {}
        for saga, run_id, step in halted:
            saga = self._sagas(saga)
            per_step[(saga, self._steps(step))] += 1
            per_run.setdefault(saga, set()).add(run_id)
        for (saga, step), n in sorted(per_step.items()):
            steps.add_metric([saga, step], n)
        for saga in sorted(set(sagas) | set(per_run)):
            runs.add_metric([saga], len(per_run.get(saga, ())))
        return [steps, runs]

    def _approval_families(
        self, approvals: list[tuple[str, str, str, Any]], sagas: list[str], now: datetime | None
    ) -> list[Metric]:
        pending = GaugeMetricFamily(
            "sagaloop_approvals_pending",
            "Approvals (ctx.approval) that unfinished runs wait for, per saga and status "
            "(pending, or escalated: its deadline passed and it still waits).",
            labels=["saga", "status"],
        )
        oldest_age = GaugeMetricFamily(
            "sagaloop_approvals_oldest_age_seconds",
            "Age of the oldest approval still waiting for an answer, per saga.",
            labels=["saga"],
        )
        counts: Counter[tuple[str, str]] = Counter()
        oldest: dict[str, datetime] = {}
        for saga, _run_id, _key, value in approvals:
            status = value.get("status") if isinstance(value, dict) else None
            if status not in OPEN_STATUSES:
                continue
            saga = self._sagas(saga)
            counts[(saga, str(status))] += 1
            requested = _datetime(value.get("requested_at"))
            if requested is not None and (saga not in oldest or requested < oldest[saga]):
                oldest[saga] = requested
        for saga in sorted(set(sagas) | {saga for saga, _ in counts}):
            for status in sorted(OPEN_STATUSES):
                pending.add_metric([saga, status], counts[(saga, status)])
        if now is not None:
            for saga, at in sorted(oldest.items()):
                oldest_age.add_metric([saga], max(0.0, (now - at).total_seconds()))
        return [pending, oldest_age]

    def _queue_families(
        self,
        outbox: dict[str, tuple[int, datetime | None]],
        dead: dict[str, int],
        now: datetime | None,
    ) -> list[Metric]:
        size = GaugeMetricFamily(
            "sagaloop_outbox_messages",
            "Rows in the outbox, per queue: not yet published (a broker outside the database), "
            "or not yet processed (the database broker, whose queue the outbox is).",
            labels=["queue"],
        )
        lag = GaugeMetricFamily(
            "sagaloop_outbox_lag_seconds",
            "Per queue, how long the longest-waiting outbox row that nobody holds has been "
            "available (0 when every row is claimed or due later).",
            labels=["queue"],
        )
        letters = GaugeMetricFamily(
            "sagaloop_dead_letters",
            "Dead letters of the database broker, per queue they came from.",
            labels=["queue"],
        )
        sizes: Counter[str] = Counter()
        ages: dict[str, float] = {}
        for queue, (n, since) in outbox.items():
            queue = self._queues(queue)
            sizes[queue] += n
            age = 0.0 if since is None or now is None else (now - since).total_seconds()
            ages[queue] = max(ages.get(queue, 0.0), age, 0.0)
        for queue in sorted(sizes):
            size.add_metric([queue], sizes[queue])
            lag.add_metric([queue], ages[queue])
        per_queue: Counter[str] = Counter()
        for queue, n in dead.items():
            per_queue[self._queues(queue)] += n
        for queue, n in sorted(per_queue.items()):
            letters.add_metric([queue], n)
        return [size, lag, letters]

    def _broker_dead_letters(self, now: datetime | None) -> Metric | None:
        if not isinstance(self.broker, CountsDeadLetters) or self.broker.uses_outbox:
            return None
        family = GaugeMetricFamily(
            "sagaloop_broker_dead_letters",
            "Dead letters the broker holds (RabbitMQ: the queue {namespace}.dead).",
        )
        if now is None:
            return family
        try:
            family.add_metric([], self.broker.count_dead_letters())
        except SagaloopError as e:
            logger.warning("metrics: counting the broker's dead letters failed: %s", e)
            return None
        return family

    # --- step outcomes: counted once, from the history -------------------------------------

    def _observe_steps(self, now: datetime) -> None:
        since = max(self._last - self.overlap, now - self.max_window, self._started)
        outcomes, truncated = self.store.step_outcomes(since, limit=self.max_rows)
        if truncated:
            self._truncated += 1
            logger.warning(
                "metrics: over %d runs or step outcomes since %s: some are not counted",
                self.max_rows,
                since.isoformat(),
            )
        for outcome in outcomes:
            key = (outcome.run_id, outcome.seq, outcome.at)
            if key not in self._seen:
                self._seen[key] = outcome.at
                self._count(outcome)
        self._last = now
        forget = now - self.overlap  # the next window starts at this or later
        self._seen = {key: at for key, at in self._seen.items() if at >= forget}

    def _count(self, o: StepOutcome) -> None:
        direction, outcome = _OUTCOMES[o.kind]
        step: StepKey = (self._sagas(o.saga), self._steps(o.step), direction)
        if outcome == "retrying":
            self._retries[step] += 1
        if o.in_doubt:
            self._in_doubt[step] += 1
        if o.started_at is None:
            return
        seconds = max(0.0, (o.at - o.started_at).total_seconds())
        labels = (*step, outcome)
        counts = self._histograms.setdefault(labels, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self._sums[labels] = self._sums.get(labels, 0.0) + seconds

    def _step_families(self) -> list[Metric]:
        duration = HistogramMetricFamily(
            "sagaloop_step_duration_seconds",
            "Attempts of steps (direction=do) and compensations (undo), from their dispatch to "
            "their recorded outcome (queue wait included), per outcome: completed, retrying "
            "(failed, retried later), failed (for good) or halted (in doubt, not re-attempted).",
            labels=[*_STEP_LABELS, "outcome"],
        )
        for labels, counts in sorted(self._histograms.items()):
            cumulative, buckets = 0, []
            for bound, n in zip([*self.buckets, float("inf")], counts, strict=True):
                cumulative += n
                buckets.append((_le(bound), float(cumulative)))
            duration.add_metric(list(labels), buckets, self._sums[labels])
        retries = CounterMetricFamily(
            "sagaloop_step_retries",
            "Attempts that failed and were retried later.",
            labels=_STEP_LABELS,
        )
        for key, n in sorted(self._retries.items()):
            retries.add_metric(list(key), n)
        in_doubt = CounterMetricFamily(
            "sagaloop_step_in_doubt",
            "Attempts that failed in doubt: without proof that they took no effect (a lost "
            "response, a crash, a timeout).",
            labels=_STEP_LABELS,
        )
        for key, n in sorted(self._in_doubt.items()):
            in_doubt.add_metric(list(key), n)
        truncated = CounterMetricFamily(
            "sagaloop_metrics_truncated_reads",
            "Scrapes that found more runs or step outcomes than they read (max_rows): some "
            "attempts are missing from the step counters.",
        )
        truncated.add_metric([], self._truncated)
        return [duration, retries, in_doubt, truncated]


def _datetime(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None


class MetricsServer:
    """The HTTP endpoint that :func:`serve_metrics` started (``GET /metrics``)."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.host: str = server.server_address[0]
        self.port: int = server.server_address[1]
        """The port it listens on (the one the system chose, when asked for port 0)."""

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop answering and close the socket (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_metrics(
    port: int,
    host: str = "127.0.0.1",
    *,
    collector: Collector,
    process_metrics: bool = True,
) -> MetricsServer:
    """Serve ``collector``'s metrics (and, with ``process_metrics``, the process's CPU, memory
    and garbage collection) at ``http://host:port/metrics`` from a daemon thread; port 0 picks a
    free one. Each call has a registry of its own: nothing global is registered."""
    registry = CollectorRegistry()
    registry.register(collector)
    if process_metrics:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    try:
        server, thread = start_http_server(port, host, registry)
    except OSError as e:
        raise SagaloopError(
            f"cannot serve metrics on {host}:{port}: {e.strerror or e}: choose a free port "
            "(--metrics-port)"
        ) from e
    return MetricsServer(server, thread)
