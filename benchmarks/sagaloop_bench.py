"""sagaloop measured as it is deployed: ``sagaloop engine`` and ``sagaloop worker`` as separate
processes on RabbitMQ + PostgreSQL (``sagaloop engine`` alone for in-process steps; or ``sagaloop
dev``, one process, on the embedded default: SQLite and the database broker), driven from this
process.

Runs are started by publishing plain JSON start messages (the documented message contract) in
one batch, so that a wave of runs reaches the engine at once. Every figure comes from the
history's timestamps, all taken by the engine process's clock: a step's latency is the time
between two consecutive engine decisions of one run (``step_scheduled`` to the next
``step_scheduled``, or to ``run_finished`` for the last), the same span as the floor's; a wave's
window runs from its first ``step_scheduled`` to its last ``run_finished``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks.common import (
    ROOT,
    cpu_seconds,
    delete_rabbit,
    fresh_database,
    latency,
    rabbitmq_url,
    rss_mb,
    wait_until,
)
from sagaloop.engine.contract import task_message_id
from sagaloop.engine.messages import Envelope, derived_id, engine_queue
from sagaloop.store import tables as t
from sagaloop.store.sql import SqlStore

APP = "benchmarks.benchapp"
APP_NAME = "bench"
FINAL = ("completed", "failed", "compensated", "cancelled", "needs_attention")


class System:
    """A fresh store (and RabbitMQ namespace), sagaloop processes on it, a publisher of start
    messages, and read access to the history."""

    def __init__(self, database_url: str, broker_url: str, tmp: Path, app: str = APP) -> None:
        self.app = app  # the module of the processes' --app (its App is named APP_NAME)
        self.database_url = database_url
        self.broker_url = broker_url
        self.tmp = tmp
        self.namespace = f"bench-{uuid.uuid4().hex[:8]}"
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": database_url,
            "SAGALOOP_BROKER_URL": broker_url,
            "SAGALOOP_NAMESPACE": self.namespace,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        subprocess.run(
            [sys.executable, "-m", "sagaloop", "db", "upgrade"],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        self.store = SqlStore(database_url, pool_size=2)
        self._broker: Any = None
        self.last_segments: dict[str, float] = {}

    # --- processes ---------------------------------------------------------------------------

    def spawn(self, role: str, *args: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{role}-{len(self.logs)}.log"
        self.logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", role, "--app", self.app, *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        self.procs.append(proc)
        return proc

    def engine(self, concurrency: int | None = None) -> subprocess.Popen[bytes]:
        """``sagaloop engine``; with ``concurrency``, ``--concurrency N`` (its threads for
        in-process steps)."""
        args = () if concurrency is None else ("--concurrency", str(concurrency))
        return self.spawn("engine", *args)

    def worker(self, concurrency: int = 2) -> subprocess.Popen[bytes]:
        return self.spawn("worker", "--queue", "bench", "--concurrency", str(concurrency))

    def dev(self, concurrency: int = 2) -> subprocess.Popen[bytes]:
        return self.spawn("dev", "--concurrency", str(concurrency))

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs
        )

    # --- starting runs -----------------------------------------------------------------------

    @property
    def broker(self) -> Any:
        if self._broker is None:
            if self.broker_url == "database":
                from sagaloop.brokers.database import DatabaseBroker

                self._broker = DatabaseBroker(self.store)
            else:
                from sagaloop.brokers.rabbitmq import RabbitBroker

                self._broker = RabbitBroker(self.broker_url, namespace=self.namespace)
                self._broker.declare([engine_queue(APP_NAME), f"{APP_NAME}.steps.bench"])
        return self._broker

    def start(self, saga: str, inputs: Sequence[Any]) -> list[str]:
        """Start one run per input, in one batch of plain JSON start messages."""
        ids = [uuid.uuid4().hex for _ in inputs]
        batch = [
            (
                engine_queue(APP_NAME),
                Envelope(
                    type="start",
                    message_id=f"start:{run_id}",
                    run_id=run_id,
                    saga=saga,
                    payload={"input": value},
                ).to_bytes(),
            )
            for run_id, value in zip(ids, inputs, strict=True)
        ]
        for i in range(0, len(batch), 500):
            self.broker.publish(batch[i : i + 500])
        return ids

    # --- reading what happened ---------------------------------------------------------------

    def read(self) -> Any:
        """A connection for reading. (On SQLite, sagaloop begins every other transaction with
        ``BEGIN IMMEDIATE``, which would take the write lock from the processes measured.)"""
        return self.store.engine.connect().execution_options(sagaloop_read=True)

    def count(self, query: Any) -> int:
        with self.read() as conn:
            return int(conn.execute(query).scalar() or 0)

    def finished(self, ids: Sequence[str]) -> int:
        r = t.runs.c
        return self.count(
            sa.select(sa.func.count()).where(r.run_id.in_(list(ids)), r.status.in_(FINAL))
        )

    def wait_finished(self, ids: Sequence[str], timeout: float) -> None:
        try:
            wait_until(lambda: self.finished(ids) == len(ids), timeout, f"{len(ids)} runs")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.log_tail()}") from None

    def events(self, ids: Sequence[str]) -> dict[str, list[tuple[str, float]]]:
        """Each run's (kind, at) in history order."""
        h = t.history.c
        q = (
            sa.select(h.run_id, h.kind, h.at)
            .where(h.run_id.in_(list(ids)))
            .order_by(h.run_id, h.seq)
        )
        out: dict[str, list[tuple[str, float]]] = {i: [] for i in ids}
        with self.read() as conn:
            for run_id, kind, at in conn.execute(q):
                out[run_id].append((kind, at.timestamp()))
        return out

    def probe(self) -> dict[str, list[int]]:
        """RabbitMQ's view of the queues now: ``[messages ready, consumers]`` per queue."""
        if self.broker_url == "database":
            return {}
        import pika

        out: dict[str, list[int]] = {}
        conn = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        try:
            for q in ("engine", "steps.bench"):
                ok = conn.channel().queue_declare(f"{self.namespace}.{APP_NAME}.{q}", passive=True)
                out[q] = [ok.method.message_count, ok.method.consumer_count]
        finally:
            conn.close()
        return out

    def close(self) -> None:
        for proc in self.procs:
            self.stop(proc)
        if self._broker is not None:
            self._broker.close()
        self.store.close()
        if self.broker_url != "database":
            queues = [f"{APP_NAME}.engine", f"{APP_NAME}.steps.bench", "dead"]
            delete_rabbit(
                self.broker_url,
                [f"{self.namespace}.{q}" for q in queues],
                [self.namespace, f"{self.namespace}.dlx"],
            )


@contextlib.contextmanager
def system(kind: str, app: str = APP) -> Iterator[System]:
    """``rabbitmq``: RabbitMQ + a fresh PostgreSQL database; ``sqlite``: the embedded default
    (a SQLite file and the database broker) in a temporary folder. ``app``: the processes'
    ``--app`` module."""
    tmp = Path(tempfile.mkdtemp(prefix="sagaloop-bench-"))
    try:
        if kind == "rabbitmq":
            with fresh_database() as url:
                s = System(url, rabbitmq_url(), tmp, app)
                try:
                    yield s
                finally:
                    s.close()
        else:
            s = System(f"sqlite:///{tmp / 'bench.db'}", "database", tmp, app)
            try:
                yield s
            finally:
                s.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- figures from histories ------------------------------------------------------------------

DECISIONS = ("step_scheduled", "run_finished")


def step_gaps(events: dict[str, list[tuple[str, float]]]) -> list[float]:
    """Time between consecutive engine decisions of each run (one per step)."""
    gaps: list[float] = []
    for evs in events.values():
        times = [at for kind, at in evs if kind in DECISIONS]
        gaps += [b - a for a, b in itertools.pairwise(times)]
    return gaps


def window(events: dict[str, list[tuple[str, float]]]) -> float:
    firsts = [at for evs in events.values() for kind, at in evs if kind == "step_scheduled"]
    lasts = [at for evs in events.values() for kind, at in evs if kind == "run_finished"]
    return max(lasts) - min(firsts)


def completed_steps(events: dict[str, list[tuple[str, float]]]) -> int:
    return sum(1 for evs in events.values() for kind, _ in evs if kind == "step_completed")


def run_waves(
    s: System, saga: str, sagas: int, steps: int, waves: int, pids: Sequence[int] = ()
) -> dict[str, Any]:
    """``waves`` waves of ``sagas`` runs of ``steps`` steps started at once; the next wave
    starts when the last finished. ``pids``: processes whose CPU time per step to report."""
    gaps: list[float] = []
    total_window, total_steps = 0.0, 0
    cpu0 = [cpu_seconds(p) for p in pids]
    probes = []
    for _ in range(waves):
        ids = s.start(saga, [steps] * sagas)
        if sagas >= 8:
            time.sleep(0.3)
            probes.append(s.probe())
        s.wait_finished(ids, timeout=120 + sagas * steps * 0.1)
        events = s.events(ids)
        s.last_segments = segments(s, ids)
        gaps += step_gaps(events)
        total_window += window(events)
        total_steps += completed_steps(events)
    cpu = [(cpu_seconds(p) - c) / total_steps * 1000 for p, c in zip(pids, cpu0, strict=True)]
    return {
        **latency(gaps),
        "steps": total_steps,
        "steps_per_s": total_steps / total_window,
        "cpu_ms_per_step": cpu,
        "queues_mid_wave": probes[:1],
    }


def segments(s: System, ids: Sequence[str]) -> dict[str, float]:
    """Where a step's time goes (p50 in ms): from the engine's decision to the worker's reply
    transaction (engine commit, relay, RabbitMQ, worker receive, inbox check, the step itself:
    the worker's inbox row's timestamp), and from there to the next decision (worker commit,
    relay, RabbitMQ, engine receive, the activation's saga code). The engine's inbox row is
    stamped when the activation writes, after its saga code and decision, so it splits
    nothing."""
    h, i = t.history.c, t.inbox.c
    with s.read() as conn:
        inbox = {
            m: at.timestamp()
            for m, at in conn.execute(
                sa.select(i.message_id, i.at).where(
                    sa.or_(*[i.message_id.like(f"%{run_id}%") for run_id in ids])
                )
            )
        }
        rows = conn.execute(
            sa.select(h.run_id, h.pos, h.at).where(
                h.run_id.in_(list(ids)), h.kind == "step_scheduled"
            )
        )
        scheduled = {(r, p): at.timestamp() for r, p, at in rows}
    parts: dict[str, list[float]] = {"to_worker": [], "to_engine": []}
    for (run_id, pos), t1 in scheduled.items():
        task = task_message_id(run_id, pos, "do", 1)  # the worker inbox's key (inbox_key)
        t2 = inbox.get(derived_id(APP_NAME, "step", run_id, task))
        t3 = scheduled.get((run_id, pos + 1))
        if t2 is None or t3 is None:
            continue
        parts["to_worker"].append(t2 - t1)
        parts["to_engine"].append(t3 - t2)
    return {k: latency(v)["p50_ms"] for k, v in parts.items()}


def warm_up(s: System, saga: str = "chain") -> None:
    ids = s.start(saga, [3, 3])
    s.wait_finished(ids, timeout=120)


ENGINE_THREADS = 4
"""``sagaloop engine --concurrency`` of the in-process case: the command's default."""


# --- the cases -------------------------------------------------------------------------------


def measure_main(
    kind: str, *, sequential_steps: int, concurrency: Sequence[int], waves: dict[int, int]
) -> dict[str, Any]:
    """Sequential latency and throughput on ``kind`` (see :func:`system`)."""
    out: dict[str, Any] = {}
    with system(kind) as s:
        procs = [s.engine(), s.worker()] if kind == "rabbitmq" else [s.dev()]
        pids = [p.pid for p in procs]
        warm_up(s)
        out["sequential"] = run_waves(s, "chain", 1, sequential_steps, 1, pids)
        out["sequential"]["segments"] = s.last_segments
        for c in concurrency:
            out[f"concurrent_{c}"] = run_waves(s, "chain", c, 10, waves[c], pids)
    return out


def measure_inprocess(
    *,
    sequential_steps: int,
    concurrency: Sequence[int],
    waves: dict[int, int],
    engine_threads: int = ENGINE_THREADS,
) -> dict[str, Any]:
    """In-process steps (``chain_local``, whose steps are ``local=True``) with one ``sagaloop
    engine`` process and no worker, on RabbitMQ + PostgreSQL: the measurements of
    :func:`measure_main`, with the engine's CPU time per step (``--concurrency
    engine_threads``)."""
    threads = engine_threads
    out: dict[str, Any] = {"engine_concurrency": threads}
    with system("rabbitmq") as s:
        engine = s.engine(threads)
        pids = [engine.pid]
        warm_up(s, "chain_local")
        out["sequential"] = run_waves(s, "chain_local", 1, sequential_steps, 1, pids)
        for c in concurrency:
            out[f"concurrent_{c}"] = run_waves(s, "chain_local", c, 10, waves[c], pids)
    return out


def measure_loops(sizes: Sequence[int], min_iterations: int) -> dict[str, Any]:
    """Agent loops of each size, one run at a time: wall time and engine CPU time per
    iteration. The shorter loops are repeated until ``min_iterations`` iterations, half of them
    before the longest loop and half after it, so that a change of the machine's load during
    the section weighs on every size alike."""
    longest, shorter = sizes[-1], list(sizes[:-1])
    plan = [(n, max(1, -(-min_iterations // n) // 2)) for n in shorter]
    order = [*plan, (longest, 1), *reversed(plan)]
    acc: dict[int, dict[str, Any]] = {
        n: {"wall": 0.0, "cpu": 0.0, "gaps": [], "iterations": 0} for n in sizes
    }
    with system("rabbitmq") as s:
        engine = s.engine()
        s.worker()
        warm_up(s)
        for n, repeats in order:
            a = acc[n]
            for _ in range(repeats):
                cpu0 = cpu_seconds(engine.pid)
                (run_id,) = s.start("agent", [n])
                s.wait_finished([run_id], timeout=60 + n * 0.5)
                a["cpu"] += cpu_seconds(engine.pid) - cpu0
                events = s.events([run_id])
                gaps = step_gaps(events)
                a["wall"] += window(events)
                a["gaps"] += gaps
                a["iterations"] += n
                if n == longest and n >= 30:  # the last third of the run against the first
                    third = n // 3
                    first = latency(gaps[:third])["p50_ms"]
                    a["last_vs_first_third"] = latency(gaps[-third:])["p50_ms"] / first
    out: dict[str, Any] = {}
    for n in sizes:
        a = acc[n]
        out[str(n)] = {
            "iterations": a["iterations"],
            "wall_ms_per_iteration": a["wall"] / a["iterations"] * 1000,
            "engine_cpu_ms_per_iteration": a["cpu"] / a["iterations"] * 1000,
            **latency(a["gaps"]),
        }
        if "last_vs_first_third" in a:
            out[str(n)]["last_vs_first_third"] = a["last_vs_first_third"]
    return out


def measure_waiting(small: int, large: int) -> dict[str, Any]:
    """The engine process's RSS with ``small`` runs waiting for an event, then ``large``."""
    out: dict[str, Any] = {}
    with system("rabbitmq") as s:
        engine = s.engine()
        waiting = t.history.c

        def waiting_runs() -> int:
            return s.count(sa.select(sa.func.count()).where(waiting.kind == "event_waiting"))

        s.start("waiter", [None] * small)
        wait_until(lambda: waiting_runs() >= small, 120, f"{small} waiting runs")
        time.sleep(1.0)
        out["small"] = {"runs": small, "rss_mb": rss_mb(engine.pid)}
        started = time.monotonic()
        s.start("waiter", [None] * (large - small))
        wait_until(lambda: waiting_runs() >= large, 60 + large * 0.05, f"{large} waiting runs")
        out["activations_per_s"] = (large - small) / (time.monotonic() - started)
        time.sleep(1.0)
        out["large"] = {"runs": large, "rss_mb": rss_mb(engine.pid)}
        out["delta_mb"] = out["large"]["rss_mb"] - out["small"]["rss_mb"]
    return out


def measure_recovery(runs: int) -> dict[str, Any]:
    """``runs`` runs in flight when the engine is killed (SIGKILL): each has had its first step
    dispatched, and the worker has since answered, so every reply waits in the engine's queue.
    Time from spawning a new engine process to the first resumed step (the first
    ``step_completed`` it records), and to every run having resumed."""
    with system("rabbitmq") as s:
        engine = s.engine()
        h = t.history.c
        began = time.monotonic()
        s.start("chain", [1] * runs)

        def scheduled() -> int:
            return s.count(sa.select(sa.func.count()).where(h.kind == "step_scheduled"))

        unsent = sa.select(sa.func.count()).select_from(t.outbox)
        wait_until(
            lambda: scheduled() >= runs and s.count(unsent) == 0,
            60 + runs * 0.05,
            f"{runs} runs to dispatch",
        )
        dispatched = time.monotonic()
        s.stop(engine, signal.SIGKILL)
        s.worker()
        i = t.inbox.c
        replies = sa.select(sa.func.count()).where(i.consumer == "worker")
        wait_until(
            lambda: s.count(replies) >= runs and s.count(unsent) == 0,
            60 + runs * 0.05,
            "the worker to answer every step",
        )
        answered = time.monotonic()
        spawned = time.time()
        s.engine()
        resumed = sa.select(sa.func.min(h.at), sa.func.count()).where(h.kind == "step_completed")

        def first() -> tuple[Any, int] | None:
            with s.read() as conn:
                at, n = conn.execute(resumed).one()
            return (at, n) if at is not None else None

        at, _ = wait_until(first, 60, "the first resumed step", interval=0.01)
        first_s = at.timestamp() - spawned
        wait_until(lambda: (first() or (0, 0))[1] >= runs, 60 + runs * 0.05, "every run resumed")
        with s.read() as conn:
            last = conn.execute(sa.select(sa.func.max(h.at)).where(h.kind == "step_completed"))
            all_s = last.scalar().timestamp() - spawned
        ready_s = _ready_after(s.logs[-1], spawned)
    return {
        "runs": runs,
        "first_s": first_s,
        "all_s": all_s,
        "ready_s": ready_s,
        "setup_s": [dispatched - began, answered - dispatched],
    }


def _ready_after(log: Path, spawned: float) -> float | None:
    """When the engine said it was up (its "engine: app ..." log line), after ``spawned``."""
    from datetime import datetime

    for line in log.read_text(errors="replace").splitlines():
        if " engine: app " in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp() - spawned
    return None
