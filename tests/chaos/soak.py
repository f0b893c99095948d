"""The chaos soak: two engines and two workers on a private RabbitMQ node and a private
PostgreSQL server run a saga mix while a driver breaks things, then the outcome is checked
from outside the engine.

    python tests/chaos/soak.py --runs 300 --max-seconds 300 --seed 7

What it does, bounded by the number of runs and by time:

1. Starts a private PostgreSQL server and a private RabbitMQ node (their own ports and data
   directories: the shared 5432 and 5672 are never touched), applies the schema, and starts
   ``sagaloop engine`` twice and ``sagaloop worker`` twice as OS processes running
   ``soak_app``, with a short lease (3 s) and a short AMQP heartbeat (2 s): a stopped process
   cannot expire its own leases, so it is RabbitMQ, on missed heartbeats, that drops its
   connection and hands its messages to another worker while it is stopped.
2. For a chaos window, starts the runs of a mix (sequential effects, a gather of concurrent
   effects, a wait for an event that the driver sends after a random delay, a failure after
   effects that compensates them), while a driver SIGKILLs a random sagaloop process every
   1-5 s and restarts it; restarts the RabbitMQ node once and PostgreSQL once (an immediate
   shutdown: a crash); and SIGSTOPs a worker while step bodies run in it, past its lease (and
   four heartbeats), then SIGCONTs it: its late results must not be applied twice.
3. Stops the chaos, waits (bounded) for every run to be terminal, and prints a table: runs by
   final status, effects expected vs applied, duplicates, lost messages, bodies that ran more
   than once, the history check (one completion per position), dead letters, the kills and
   restarts and the recovery time after each (until the next run finished).

The effects land in ``soak_app``'s ledger, a provider outside the engine that honours
idempotency keys and records every request, so a body run twice is told apart from an effect
applied twice. What each run must have done follows from its input.

Exit status 0 when nothing was duplicated or lost and every run ended as its saga says; 1
otherwise; 130 when interrupted. Every private server and process is stopped on the way out,
also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import heapq
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (ROOT, HERE.parent / "integration", HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import sqlalchemy as sa  # noqa: E402
from private_postgres import PrivatePostgres  # noqa: E402
from private_rabbit import SERVER as RABBIT_SERVER  # noqa: E402
from private_rabbit import PrivateRabbit  # noqa: E402
from soak_app import EVENT, create_ledger  # noqa: E402

from sagaloop.client import Client  # noqa: E402
from sagaloop.errors import RunFinishedError, SagaloopError  # noqa: E402
from sagaloop.store import tables  # noqa: E402
from sagaloop.store.sql import SqlStore  # noqa: E402
from sagaloop.testing import services  # noqa: E402

APP = "soak_app"
APP_NAME = "soakapp"
FINAL = ("completed", "compensated", "failed", "cancelled")
EXPECTED_STATUS = {
    "seq": "completed",
    "fan": "completed",
    "wait": "completed",
    "fail": "compensated",
}
MIX = {"seq": 0.3, "fan": 0.25, "wait": 0.2, "fail": 0.25}
T = TypeVar("T")


# --- the saga mix --------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """One run of the mix: its saga, the effects its input asks for, when it starts (seconds
    into the chaos window) and, for ``wait``, how long after its start the event is sent."""

    run_id: str
    saga: str
    seq: tuple[str, ...]
    par: tuple[str, ...]
    at: float
    event_after: float

    @property
    def input(self) -> dict[str, list[str]]:
        return {"seq": list(self.seq), "par": list(self.par)}

    @property
    def expected_status(self) -> str:
        return EXPECTED_STATUS[self.saga]

    @property
    def expected_output(self) -> Any:
        done = [f"{n}:done" for n in (*self.seq, *self.par)]
        return {"seq": done, "fan": done, "wait": [*done, "ok"], "fail": None}[self.saga]

    def expected_effects(self) -> set[tuple[str, str, str]]:
        names = [*self.seq, *self.par]
        out = {(self.run_id, n, "do") for n in names}
        if self.saga == "fail":  # the refusal comes after every effect: each one is undone
            out |= {(self.run_id, n, "undo") for n in names}
        return out


def make_plans(runs: int, seed: int, window: float) -> list[RunPlan]:
    rng = random.Random(seed)
    plans = []
    for i in range(runs):
        saga = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        n_seq, n_par = {
            "seq": (rng.randint(2, 4), 0),
            "fan": (0, rng.randint(2, 4)),
            "wait": (1, 2),
            "fail": (rng.randint(1, 2), rng.randint(0, 2)),
        }[saga]
        plans.append(
            RunPlan(
                run_id=f"soak{seed}-{i:04d}-{saga}",
                saga=saga,
                seq=tuple(f"s{j}" for j in range(n_seq)),
                par=tuple(f"p{j}" for j in range(n_par)),
                at=window * 0.85 * i / max(runs - 1, 1),
                event_after=rng.uniform(0.5, 5.0),
            )
        )
    return plans


# --- the system under test -----------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]


@dataclass
class Action:
    """One disruption: ``began`` when it hit, ``back`` when the thing was running again
    (epoch seconds)."""

    kind: str
    target: str
    began: float
    back: float
    pid: int | None = None

    @property
    def outage(self) -> float:
        return self.back - self.began


class Cluster:
    """The private servers and the sagaloop processes. Every method that changes them holds
    ``lock``; after ``close`` nothing is started again."""

    def __init__(
        self,
        work: Path,
        *,
        lease: float,
        heartbeat: int,
        step_delay: str,
        workers: int,
        engines: int,
    ) -> None:
        self.work = work
        self.lease = lease
        self.heartbeat = heartbeat
        self.step_delay = step_delay
        self.names = [f"engine-{i + 1}" for i in range(engines)]
        self.names += [f"worker-{i + 1}" for i in range(workers)]
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.ledger_path = work / "ledger.db"
        self.namespace = f"soak-{uuid.uuid4().hex[:8]}"
        self.lock = threading.RLock()
        self.closed = False
        self.pg: PrivatePostgres | None = None
        self.rabbit: PrivateRabbit | None = None
        self.procs: dict[str, Proc] = {}
        self.stopped: set[str] = set()
        self.crashed: list[tuple[str, int]] = []  # exits that nobody asked for
        self.env: dict[str, str] = {}

    # --- servers ---

    def start_servers(self) -> None:
        failure: list[BaseException] = []

        def start_rabbit() -> None:
            try:
                self.rabbit = PrivateRabbit(self.work / "rabbit")
                self.rabbit.start(timeout=90)
            except BaseException as e:
                failure.append(e)

        thread = threading.Thread(target=start_rabbit, name="rabbit-start", daemon=True)
        thread.start()
        try:
            self.pg = PrivatePostgres()
            self.pg.start()
        finally:
            thread.join()
        if failure:
            raise failure[0]
        assert self.rabbit is not None
        create_ledger(str(self.ledger_path))
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")},
            "SAGALOOP_DATABASE_URL": self.pg.url,
            "SAGALOOP_BROKER_URL": self.broker_url,
            "SAGALOOP_NAMESPACE": self.namespace,
            "SAGALOOP_LEASE": str(self.lease),
            "LEDGER_PATH": str(self.ledger_path),
            "SOAK_STEP_DELAY": self.step_delay,
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
            "PYTHONUNBUFFERED": "1",
        }
        done = subprocess.run(
            [sys.executable, "-m", "sagaloop", "db", "upgrade"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sagaloop db upgrade failed: {done.stderr}")

    @property
    def broker_url(self) -> str:
        """The private node's URL, with a short AMQP heartbeat: RabbitMQ then drops the
        connection of a stopped process (and redelivers its messages) within seconds."""
        assert self.rabbit is not None
        return self.rabbit.url + (f"?heartbeat={self.heartbeat}" if self.heartbeat else "")

    def restart_rabbit(self) -> Action:
        with self.lock:
            assert self.rabbit is not None and not self.closed
            began = time.time()
            self.rabbit.restart()
            return Action("restart rabbitmq", "rabbitmq", began, time.time())

    def restart_postgres(self, mode: str) -> Action:
        with self.lock:
            assert self.pg is not None and not self.closed
            began = time.time()
            self.pg.restart(mode)
            return Action(f"restart postgres ({mode})", "postgres", began, time.time())

    # --- sagaloop processes ---

    def spawn(self, name: str) -> Proc:
        with self.lock:
            if self.closed:
                raise RuntimeError("the cluster is closed")
            role = name.split("-")[0]
            args = ["engine"] if role == "engine" else ["worker", "--queue", "work,other"]
            args += ["--concurrency", "4"] if role == "worker" else []
            log = (self.logs / f"{name}.log").open("ab")
            log.write(f"=== {name} started at {time.time():.3f}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                [sys.executable, "-m", "sagaloop", *args, "--app", APP, "--poll", "0.05"],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # a Ctrl-C reaches the soak, which stops them in order
            )
            log.close()
            self.procs[name] = Proc(name, popen)
            return self.procs[name]

    def kill_and_restart(self, name: str) -> Action | None:
        """SIGKILL process ``name`` and start it again; None if it is stopped (the stopped
        worker is left alone until its SIGCONT)."""
        with self.lock:
            if name in self.stopped:
                return None
            proc = self.procs[name]
            began = time.time()
            proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait()
            self.spawn(name)
            return Action(f"kill {name.split('-')[0]}", name, began, time.time(), proc.popen.pid)

    def pause(self, name: str) -> int:
        with self.lock:
            proc = self.procs[name]
            self.stopped.add(name)
            proc.popen.send_signal(signal.SIGSTOP)
            return proc.popen.pid

    def resume(self, name: str) -> None:
        with self.lock:
            self.procs[name].popen.send_signal(signal.SIGCONT)
            self.stopped.discard(name)

    def killable(self) -> list[str]:
        with self.lock:
            return [n for n in self.names if n not in self.stopped]

    def reap(self) -> None:
        """Restart the processes that exited on their own (and count them)."""
        with self.lock:
            if self.closed:
                return
            for name, proc in list(self.procs.items()):
                code = proc.popen.poll()
                if code is not None:
                    self.crashed.append((name, code))
                    self.spawn(name)

    def pid(self, name: str) -> int:
        with self.lock:
            return self.procs[name].popen.pid

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for name in list(self.stopped):
                with contextlib.suppress(ProcessLookupError):
                    self.procs[name].popen.send_signal(signal.SIGCONT)
            self.stopped.clear()
            for proc in self.procs.values():
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            for proc in self.procs.values():
                try:
                    proc.popen.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait()
            try:
                if self.rabbit is not None:
                    self.rabbit.stop()
            finally:
                if self.pg is not None:
                    self.pg.close()
                shutil.rmtree(self.work / "rabbit", ignore_errors=True)

    # --- looking from outside ---

    def dead_letters(self) -> int:
        assert self.rabbit is not None
        return self._queue_depth(f"{self.namespace}.dead")

    def queue_depths(self) -> dict[str, int]:
        names = ["engine", "steps.work", "steps.other"]
        return {n: self._queue_depth(f"{self.namespace}.{APP_NAME}.{n}") for n in names}

    def _queue_depth(self, queue: str) -> int:
        assert self.rabbit is not None
        return services.queue_depth(self.rabbit.url, queue)

    def ledger(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(self.ledger_path, timeout=60)
        try:
            return list(conn.execute(sql, args))
        finally:
            conn.close()


# --- the driver ----------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace, cluster: Cluster, store: SqlStore) -> None:
        self.args = args
        self.cluster = cluster
        self.store = store
        self.client = Client(store, APP_NAME)
        self.rng = random.Random(args.seed + 1)
        self.abort = threading.Event()  # everything stops: interrupted or out of time
        self.chaos_over = threading.Event()
        self.actions: list[Action] = []
        self.started: dict[str, float] = {}
        self.events: list[tuple[float, str]] = []  # a heap of (due, run_id)
        self.events_sent = 0
        self.starting_done = threading.Event()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self.t0 = time.time()
        self.retries = collections.Counter[str]()

    def _thread(self, name: str, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            except Exception:
                self.errors.append(f"{name}: {traceback.format_exc()}")

        thread = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _retry(self, what: str, fn: Callable[[], T]) -> T | None:
        """Call ``fn`` until it succeeds (the database may be restarting) or the soak ends."""
        while not self.abort.is_set():
            try:
                return fn()
            except SagaloopError:
                self.retries[what] += 1
                self.abort.wait(0.2)
        return None

    def start_chaos(self, plans: list[RunPlan], window: float) -> float:
        began = time.time()
        self._thread("starter", self._start_runs, plans, began)
        self._thread("events", self._send_events)
        self._thread("killer", self._kill_randomly)
        self._thread("director", self._direct, began, window)
        return began

    def _start_runs(self, plans: list[RunPlan], began: float) -> None:
        for plan in plans:
            delay = began + plan.at - time.time()
            if delay > 0 and self.abort.wait(delay):
                break
            input_ = plan.input
            run_id = self._retry(
                "start",
                lambda p=plan, i=input_: self.client.start(p.saga, i, run_id=p.run_id),
            )
            if run_id is None:
                break
            now = time.time()
            with self.lock:
                self.started[plan.run_id] = now
                if plan.saga == "wait":
                    heapq.heappush(self.events, (now + plan.event_after, plan.run_id))
        self.starting_done.set()

    def _send_events(self) -> None:
        while not self.abort.is_set():
            with self.lock:
                due = self.events[0] if self.events else None
                if due is not None and due[0] <= time.time():
                    heapq.heappop(self.events)
            if due is None:
                if self.starting_done.is_set():
                    return
                self.abort.wait(0.1)
                continue
            if due[0] > time.time():
                self.abort.wait(min(0.1, due[0] - time.time()))
                continue
            run_id = due[1]
            if self._retry("send_event", lambda r=run_id: self._send_event(r)):
                self.events_sent += 1

    def _send_event(self, run_id: str) -> bool:
        # RunFinishedError: a retry of a send that went through; the run got it and finished.
        with contextlib.suppress(RunFinishedError):
            self.client.send_event(run_id, EVENT, "ok", event_id=EVENT)
        return True

    def _kill_randomly(self) -> None:
        while not self.chaos_over.wait(self.rng.uniform(1.0, 5.0)):
            self.cluster.reap()
            action = self.cluster.kill_and_restart(self.rng.choice(self.cluster.killable()))
            if action is not None:
                self._log(action)

    def _direct(self, began: float, window: float) -> None:
        """The once-only disruptions, at fixed fractions of the chaos window."""
        plan: list[tuple[float, Callable[[], None]]] = []
        if not self.args.no_pause:
            plan.append((0.15, lambda: self._pause_a_worker(max(5.0, 0.15 * window))))
        if not self.args.no_rabbit_restart:
            plan.append((0.35, lambda: self._log(self.cluster.restart_rabbit())))
        if not self.args.no_postgres_restart:
            plan.append(
                (0.65, lambda: self._log(self.cluster.restart_postgres(self.args.postgres_mode)))
            )
        for fraction, act in plan:
            delay = began + window * fraction - time.time()
            if delay > 0 and self.abort.wait(delay):
                return
            if self.abort.is_set():
                return
            act()

    def _in_flight(self, name: str) -> int:
        """Step bodies running in process ``name`` now (started, not finished)."""
        rows = self.cluster.ledger(
            "select count(*) from requests where pid = ? and finished is null",
            self.cluster.pid(name),
        )
        return int(rows[0][0])

    def _pause_a_worker(self, patience: float) -> None:
        """SIGSTOP a worker while step bodies run in it, so that its lease runs out with
        results in hand (two if that comes within ``patience / 2`` seconds, else one, else
        none after ``patience``), keep it stopped for ``pause`` seconds, then SIGCONT it."""
        workers = [n for n in self.cluster.names if n.startswith("worker")]
        began = time.time()
        while not self.abort.is_set():
            waited = time.time() - began
            want = 0 if waited > patience else 2 if waited < patience / 2 else 1
            name = max(workers, key=self._in_flight)
            if self._in_flight(name) >= want:
                stopped = time.time()
                pid = self.cluster.pause(name)
                held = self._in_flight(name)  # frozen: this is what it holds
                if held >= want:
                    break
                self.cluster.resume(name)  # its bodies finished meanwhile: try again
            time.sleep(0.01)
        else:
            return
        if self.args.verbose:
            print(f"  SIGSTOP {name} with {held} step bodies in flight", flush=True)
        try:
            self.abort.wait(self.args.pause)
        finally:
            self.cluster.resume(name)
        self._log(Action("SIGSTOP worker", name, stopped, time.time(), pid))

    def _log(self, action: Action) -> None:
        self.actions.append(action)
        if self.args.verbose:
            print(
                f"  {action.began - self.t0:7.1f} s  {action.kind:<28} {action.target:<10} "
                f"back after {action.outage:.2f} s",
                flush=True,
            )

    def stop_chaos(self) -> None:
        self.chaos_over.set()
        for thread in self.threads:
            if thread.name in ("killer", "director"):
                thread.join()
        self.cluster.reap()

    def statuses(self) -> dict[str, tuple[str, float]]:
        """Every run's status and when it last changed (epoch seconds)."""
        runs = tables.runs
        with self.store.engine.connect() as conn:
            rows = conn.execute(sa.select(runs.c.run_id, runs.c.status, runs.c.updated_at))
            return {r.run_id: (r.status, r.updated_at.timestamp()) for r in rows}

    def outputs(self) -> dict[str, Any]:
        runs = tables.runs
        with self.store.engine.connect() as conn:
            rows = conn.execute(sa.select(runs.c.run_id, runs.c.output))
            return {r.run_id: r.output for r in rows}

    def wait_terminal(self, deadline: float) -> None:
        """Until every started run is terminal (and every run started), or the deadline."""
        while time.time() < deadline:
            if self.starting_done.is_set() and not self.events:
                got = self._retry_read(self.statuses) or {}
                if all(got.get(r, ("absent", 0.0))[0] in FINAL for r in self.started):
                    return
            time.sleep(0.25)

    def _retry_read(self, fn: Callable[[], T]) -> T | None:
        for _ in range(50):
            try:
                return fn()
            except (SagaloopError, sa.exc.DBAPIError):
                time.sleep(0.2)
        return None


# --- the report ----------------------------------------------------------------------------


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    summary: dict[str, int] = field(default_factory=dict)

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def fail_if(self, count: int, what: str) -> None:
        if count:
            self.failures.append(f"{count} {what}")


def _stats(values: list[float]) -> str:
    if not values:
        return f"{'-':>7} {'-':>7} {'-':>7}"
    return f"{min(values):7.2f} {statistics.median(values):7.2f} {max(values):7.2f}"


def report(soak: Soak, plans: list[RunPlan], timings: dict[str, float]) -> Report:
    cluster, out = soak.cluster, Report()
    statuses = soak._retry_read(soak.statuses) or {}
    started = [p for p in plans if p.run_id in soak.started]
    by_id = {p.run_id: p for p in plans}
    args = soak.args

    out.add("")
    out.add("=" * 78)
    out.add(
        f"sagaloop chaos soak  seed {args.seed}  runs {len(started)}/{len(plans)} started  "
        f"{len(cluster.names) - args.workers} engines + {args.workers} workers  "
        f"lease {args.lease:g} s"
    )
    out.add(
        "timings  "
        + "  ".join(f"{k} {v:.1f} s" for k, v in timings.items())
        + f"  (window {timings.get('chaos', 0):.0f} s)"
    )
    out.add("=" * 78)

    # Runs by final status.
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    not_terminal, wrong_status, wrong_output = [], [], []
    outputs = soak._retry_read(soak.outputs) or {}
    for plan in plans:
        status = statuses.get(plan.run_id, ("not started", 0.0))[0]
        if plan.run_id not in soak.started:
            status = "not started"
        table[plan.saga][status] += 1
        if status not in FINAL:
            not_terminal.append(f"{plan.run_id} ({status})")
        elif status != plan.expected_status:
            wrong_status.append(f"{plan.run_id} ({status}, expected {plan.expected_status})")
        elif outputs.get(plan.run_id) != plan.expected_output:
            wrong_output.append(f"{plan.run_id}: {outputs.get(plan.run_id)!r}")
    columns = [*FINAL, "needs_attention", "running", "waiting", "compensating", "not started"]
    seen = {s for c in table.values() for s in c}
    columns = [c for c in columns if c in seen or c in ("completed", "compensated")]
    columns += sorted(seen - set(columns))
    out.add("")
    out.add("runs by final status")
    out.add(f"  {'saga':<8}{'runs':>6}" + "".join(f"{c:>14}" for c in columns) + "   expected")
    total: collections.Counter[str] = collections.Counter()
    for saga in MIX:
        counts = table.get(saga, collections.Counter())
        total.update(counts)
        out.add(
            f"  {saga:<8}{sum(counts.values()):>6}"
            + "".join(f"{counts[c]:>14}" for c in columns)
            + f"   {EXPECTED_STATUS[saga]}"
        )
    out.add(f"  {'all':<8}{sum(total.values()):>6}" + "".join(f"{total[c]:>14}" for c in columns))
    out.add(
        f"  final status as the mix expects: {len(plans) - len(not_terminal) - len(wrong_status)}"
        f"/{len(plans)}; outputs equal to what the input implies: "
        f"{len(plans) - len(not_terminal) - len(wrong_status) - len(wrong_output)}"
    )

    # Effects: expected from the mix, applied according to the provider.
    expected: set[tuple[str, str, str]] = set()
    for plan in started:
        expected |= plan.expected_effects()
    applied_rows = cluster.ledger("select key, run_id, name, direction, at from applied")
    applied = collections.Counter((r[1], r[2], r[3]) for r in applied_rows)
    by_key = collections.Counter(r[0] for r in applied_rows)
    dup_effects = {e: n for e, n in applied.items() if n > 1}
    dup_keys = {k: n for k, n in by_key.items() if n > 1}
    missing = expected - set(applied)
    unexpected = set(applied) - expected
    out.add("")
    out.add("effects (the provider's ledger)")
    out.add(
        f"  {'direction':<10}{'expected':>10}{'applied':>10}{'missing':>10}{'unexpected':>12}"
        f"{'duplicates':>12}"
    )
    for direction in ("do", "undo"):
        exp = {e for e in expected if e[2] == direction}
        got = {e for e in applied if e[2] == direction}
        out.add(
            f"  {direction:<10}{len(exp):>10}"
            f"{sum(n for e, n in applied.items() if e[2] == direction):>10}"
            f"{len(exp - got):>10}{len(got - exp):>12}"
            f"{sum(1 for e in dup_effects if e[2] == direction):>12}"
        )
    duplicates = len(dup_effects)  # a key applied twice is its effect applied twice
    out.add(
        f"  duplicates: {len(dup_effects)} effects applied more than once, "
        f"{len(dup_keys)} idempotency keys applied more than once"
    )

    # Lost: runs that never ended, and effects that should have happened and did not.
    lost = len(not_terminal) + len(missing)
    out.add("")
    out.add(
        f"lost messages: {len(not_terminal)} runs not terminal, "
        f"{len(missing)} expected effects missing"
    )
    for line in not_terminal[:10]:
        run_id = line.split()[0]
        run = soak._retry_read(lambda r=run_id: soak.store.get_run(r))
        reason = f": {run.reason}" if run is not None and run.reason else ""
        out.add(f"    not terminal: {line}{reason}")
    for effect in sorted(missing)[:10]:
        out.add(f"    missing: {effect}")
    for effect, n in sorted(dup_effects.items())[:10]:
        out.add(f"    duplicate: {effect} applied {n} times")
    for line in wrong_status[:10]:
        out.add(f"    wrong status: {line}")
    for line in wrong_output[:10]:
        out.add(f"    wrong output: {line}")
    for effect in sorted(unexpected)[:10]:
        out.add(f"    unexpected: {effect}")

    # Step bodies: at least once; more than once when in doubt, never an effect twice.
    requests = cluster.ledger("select key, pid, started, finished, outcome, in_doubt from requests")
    per_key = collections.Counter(r[0] for r in requests)
    rerun = sum(1 for n in per_key.values() if n > 1)
    absorbed = sum(1 for r in requests if r[4] == "already applied")
    cut = sum(1 for r in requests if r[3] is None)
    in_doubt = sum(1 for r in requests if r[5])
    reconciled, history_problems, recorded_by = _history(soak, started)
    out.add("")
    out.add("step bodies (raw executions, per idempotency key)")
    out.add(
        f"  {len(requests)} executions for {len(per_key)} keys; {rerun} keys ran more than "
        f"once (max {max(per_key.values(), default=0)}); {in_doubt} ran in doubt"
    )
    out.add(
        f"  {cut} cut short by a kill; {absorbed} re-applications absorbed by the provider's "
        f"idempotency; {reconciled} in-doubt attempts reconciled without running the body"
    )
    pause = next((a for a in soak.actions if a.kind == "SIGSTOP worker"), None)
    if pause is not None:
        stale = [
            r
            for r in requests
            # running at the SIGSTOP: frozen until the SIGCONT, so finished after it
            if r[1] == pause.pid and r[2] < pause.began and (r[3] is None or r[3] > pause.began)
        ]
        stale_keys = {r[0] for r in stale}
        twice = sum(1 for k in stale_keys if by_key.get(k, 0) > 1)
        mine = sum(1 for k in stale_keys if recorded_by.get(k, "").endswith(f":{pause.pid}"))
        out.add(
            f"  stopped worker (pid {pause.pid}, stopped {pause.outage:.1f} s, lease "
            f"{args.lease:g} s): {len(stale)} bodies in hand at SIGSTOP; "
            f"{sum(1 for k in stale_keys if per_key[k] > 1)} of their keys ran again in "
            f"another worker meanwhile;"
        )
        out.add(
            f"    after SIGCONT {sum(1 for r in stale if r[4] == 'already applied')} found their "
            f"key applied already; results recorded: {mine} the stopped worker's, "
            f"{len(stale_keys) - mine} another's; applied twice: {twice}"
        )
    out.add(
        f"  history: {len(history_problems)} problems (one step_completed per position, "
        "one compensation per position, gap-free sequence)"
    )
    for problem in history_problems[:10]:
        out.add(f"    {problem}")

    # Dead letters.
    dead = soak._retry_read(cluster.dead_letters) or 0
    db_dead = len(soak._retry_read(soak.store.dead_letters) or [])
    depths = soak._retry_read(cluster.queue_depths) or {}
    out.add("")
    out.add(
        f"dead letters: {dead} in RabbitMQ, {db_dead} in the database; queues at the end: "
        + ", ".join(f"{k} {v}" for k, v in depths.items())
    )

    # Chaos and recovery.
    finished = sorted(
        at for run_id, (status, at) in statuses.items() if status in FINAL and run_id in by_id
    )
    kinds: dict[str, list[Action]] = collections.defaultdict(list)
    for action in soak.actions:
        kinds[action.kind].append(action)
    out.add("")
    out.add("chaos (recovery: from the thing being back to the next run that finished)")
    out.add(
        f"  {'action':<28}{'n':>4}   {'outage min':>10} {'median':>7} {'max':>7}   "
        f"{'recovery min':>12} {'median':>7} {'max':>7}"
    )
    for kind, actions in sorted(kinds.items()):
        recoveries = []
        for action in actions:
            after = next((t for t in finished if t >= action.back), None)
            if after is not None:
                recoveries.append(after - action.back)
        out.add(
            f"  {kind:<28}{len(actions):>4}   {'':>3}{_stats([a.outage for a in actions])}   "
            f"{'':>5}{_stats(recoveries)}"
        )
    crashed = cluster.crashed
    out.add(
        f"  processes that exited on their own: {len(crashed)}"
        + (f" {crashed[:5]}" if crashed else "")
    )
    if soak.retries:
        out.add(
            "  driver retries while the database was away: "
            + ", ".join(f"{k} {v}" for k, v in sorted(soak.retries.items()))
        )
    out.add(f"  events sent: {soak.events_sent}")

    out.fail_if(duplicates, "duplicates")
    out.fail_if(lost, "losses (runs not terminal or effects missing)")
    out.fail_if(len(plans) - len(started), "runs not started")
    out.fail_if(len(wrong_status), "runs with an unexpected final status")
    out.fail_if(len(wrong_output), "completed runs with a wrong output")
    out.fail_if(len(unexpected), "unexpected effects")
    out.fail_if(len(history_problems), "history problems")
    out.fail_if(dead + db_dead, "dead letters")
    out.fail_if(len(soak.errors), "driver errors")
    for error in soak.errors:
        out.add(f"driver error: {error}")
    out.summary = {
        "runs": len(plans),
        "terminal": len(plans) - len(not_terminal),
        "duplicates": duplicates,
        "lost": lost,
        "not_terminal": len(not_terminal),
        "missing_effects": len(missing),
        "dead_letters": dead + db_dead,
        "kills": sum(len(v) for k, v in kinds.items() if k.startswith("kill")),
        "rabbit_restarts": sum(len(v) for k, v in kinds.items() if "rabbitmq" in k),
        "postgres_restarts": sum(len(v) for k, v in kinds.items() if "postgres" in k),
        "pauses": len(kinds.get("SIGSTOP worker", [])),
    }
    out.add("")
    out.add("SUMMARY " + " ".join(f"{k}={v}" for k, v in out.summary.items()))
    out.add("RESULT " + ("PASS" if not out.failures else "FAIL: " + "; ".join(out.failures)))
    return out


def _history(soak: Soak, plans: list[RunPlan]) -> tuple[int, list[str], dict[str, str]]:
    """Check every run's history. Return the number of steps completed by reconciliation, the
    problems, and the worker whose reply was recorded, by idempotency key."""
    problems: list[str] = []
    reconciled = 0
    recorded_by: dict[str, str] = {}
    for plan in plans:
        events = soak._retry_read(lambda r=plan.run_id: soak.store.load_history(None, r))
        if events is None:
            problems.append(f"{plan.run_id}: history unreadable")
            continue
        if [e.seq for e in events] != list(range(1, len(events) + 1)):
            problems.append(f"{plan.run_id}: history sequence has gaps")
        for kind in ("step_scheduled", "step_completed", "compensation_completed"):
            counts = collections.Counter(e.pos for e in events if e.kind == kind)
            for pos, n in counts.items():
                if n > 1:
                    problems.append(f"{plan.run_id}: {kind} at position {pos} recorded {n} times")
        for e in events:
            if e.kind in ("step_completed", "compensation_completed"):
                direction = "do" if e.kind == "step_completed" else "undo"
                recorded_by[f"{plan.run_id}/{e.pos}/{direction}"] = str(e.data.get("worker"))
                reconciled += bool(e.data.get("reconciled"))
    return reconciled, problems, recorded_by


# --- main ----------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300, help="runs of the mix (default 300)")
    parser.add_argument(
        "--max-seconds", type=float, default=300, help="the time bound (default 300)"
    )
    parser.add_argument("--seed", type=int, default=None, help="the random seed")
    parser.add_argument(
        "--chaos-seconds",
        type=float,
        default=None,
        help="length of the chaos window (default: 55%% of what set-up leaves of the bound)",
    )
    parser.add_argument("--lease", type=float, default=3.0, help="SAGALOOP_LEASE (seconds)")
    parser.add_argument(
        "--heartbeat",
        type=int,
        default=2,
        help="AMQP heartbeat of the processes (0: the server's)",
    )
    parser.add_argument(
        "--pause",
        type=float,
        default=None,
        help="SIGSTOP length (default: 2 leases, and at least 4 heartbeats)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--step-delay", default="0.05,0.25", help="a step body's LOW,HIGH s")
    parser.add_argument("--postgres-mode", default="immediate", choices=["fast", "immediate"])
    parser.add_argument("--no-rabbit-restart", action="store_true")
    parser.add_argument("--no-postgres-restart", action="store_true")
    parser.add_argument("--no-pause", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each disruption")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    if args.pause is None:
        args.pause = max(2 * args.lease, 4 * args.heartbeat)
    return args


class Interrupts:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, except while servers
    start (an interrupted ``initdb`` or node start would leave something behind that nobody
    knows of) or everything is being stopped: there they wait for the end of the section."""

    def __init__(self) -> None:
        self.deferring = 0
        self.pending = False
        for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: it may come in ignored
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.deferring:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self, *, then_raise: bool = True) -> Iterator[None]:
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
            if not self.deferring and self.pending and then_raise:
                self.pending = False
                raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not RABBIT_SERVER.exists():
        print(f"{RABBIT_SERVER} is missing: install RabbitMQ (apt-get install rabbitmq-server)")
        return 2
    interrupts = Interrupts()
    t0 = time.time()
    deadline = t0 + args.max_seconds
    work = Path(tempfile.mkdtemp(prefix="sagaloop-soak-"))
    cluster = Cluster(
        work,
        lease=args.lease,
        heartbeat=args.heartbeat,
        step_delay=args.step_delay,
        workers=args.workers,
        engines=args.engines,
    )
    soak: Soak | None = None
    store: SqlStore | None = None
    keep = args.keep
    print(
        f"chaos soak: seed {args.seed}, {args.runs} runs, at most {args.max_seconds:g} s; "
        f"work folder {work}",
        flush=True,
    )
    try:
        with interrupts.deferred():
            cluster.start_servers()
            for name in cluster.names:
                cluster.spawn(name)
        assert cluster.pg is not None
        store = SqlStore(cluster.pg.url)
        soak = Soak(args, cluster, store)
        soak.t0 = t0
        setup = time.time() - t0
        window = args.chaos_seconds or max(15.0, (args.max_seconds - setup) * 0.55)
        plans = make_plans(args.runs, args.seed, window)
        print(
            f"set-up {setup:.1f} s (postgres :{cluster.pg.port}, rabbitmq "
            f":{cluster.rabbit.port if cluster.rabbit else '?'}); chaos for {window:.0f} s",
            flush=True,
        )
        chaos_began = soak.start_chaos(plans, window)
        while time.time() < chaos_began + window and not soak.errors:
            time.sleep(0.2)
        soak.stop_chaos()
        chaos_end = time.time()
        print(f"chaos over after {chaos_end - chaos_began:.1f} s; draining", flush=True)
        soak.wait_terminal(max(deadline, chaos_end + 15.0))
        drained = time.time()
        soak.abort.set()
        timings = {
            "set-up": setup,
            "chaos": chaos_end - chaos_began,
            "drain": drained - chaos_end,
            "total": drained - t0,
        }
        result = report(soak, plans, timings)
        print("\n".join(result.lines), flush=True)
        keep = keep or bool(result.failures)
        return 1 if result.failures else 0
    except KeyboardInterrupt:
        print("interrupted: stopping every process and private server", flush=True)
        return 130
    except Exception:
        traceback.print_exc()
        keep = True
        return 2
    finally:
        with interrupts.deferred(then_raise=False):  # a second Ctrl-C must not cut this short
            if soak is not None:
                soak.abort.set()
                soak.chaos_over.set()
            if store is not None:
                store.close()
            cluster.close()
            if keep:
                print(f"logs and ledger kept in {work}", flush=True)
            else:
                shutil.rmtree(work, ignore_errors=True)
            print(f"cleaned up after {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
