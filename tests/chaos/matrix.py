"""The crash matrix's machinery: which saga drives each crash point, on which backend, in which
process and at which pass; how to drive one cell; and the checks made from outside the engine.

The RabbitMQ + PostgreSQL backend is tests/integration/system.py's ``System`` (separate
``sagaloop engine`` and ``sagaloop worker`` processes). The embedded default reuses its helpers
through ``EmbeddedSystem``: one ``sagaloop dev`` process on a SQLite file, database broker.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pika
import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))

from system import FINAL, ROOT, System, eventually  # noqa: E402

from sagaloop.cli.settings import load_app  # noqa: E402
from sagaloop.client import Client  # noqa: E402
from sagaloop.engine import history as h  # noqa: E402
from sagaloop.runtime.crashpoints import POINTS  # noqa: E402
from sagaloop.runtime.relay import HANDOFF_LEASE  # noqa: E402
from sagaloop.store.sql import SqlStore  # noqa: E402
from sagaloop.store.tables import outbox, processes  # noqa: E402

EMBEDDED, RABBIT = "embedded", "rabbit"
LEASE = 2.0  # seconds: a killed process's messages come back quickly
RELAY_POINTS = frozenset(p for p in POINTS if p.startswith("relay."))


@dataclasses.dataclass(frozen=True)
class Saga:
    """A saga of tests/integration/itapp.py or tests/chaos/matrix_app.py and its outcome."""

    name: str
    app: str
    names: tuple[str, ...]
    status: str
    fails: bool = False  # itapp's then-fail: the names' effects, then `refuse` fails for good
    step: str = "effect"  # the step each name calls (ledger label: the name)
    refuser: str = "refuse"  # the step that fails for good (ledger label: "refuse")
    debounced: bool = False  # started by a burst of starts that the debounce makes one run

    @property
    def calls(self) -> tuple[str, ...]:
        """The ledger labels of the steps it calls, in position order."""
        return (*self.names, "refuse") if self.fails else self.names

    def step_of(self, call: str) -> str:
        """The name of the step a ledger label of ``calls`` is a body of."""
        return self.refuser if call == "refuse" else self.step

    @property
    def undone(self) -> tuple[str, ...]:
        """The labels of the compensated steps, in the order they must be undone."""
        return tuple(reversed(self.names)) if self.fails else ()

    @property
    def progression(self) -> tuple[str, ...]:
        """Every body run in the ledger, in order: steps, then compensations (``~name``)."""
        return (*self.calls, *(f"~{n}" for n in self.undone))


SAGAS = {
    s.name: s
    for s in (
        Saga("sequence", "itapp", ("a", "b", "c"), "completed"),
        Saga("then-fail", "itapp", ("x", "y", "z"), "compensated", fails=True),
        Saga("naps", "matrix_app", ("a", "b", "c"), "completed"),
        Saga("debounced", "matrix_app", ("a", "b", "c"), "completed", debounced=True),
        # In-process steps (local=True), run by the engine's process (``sagaloop dev``'s on the
        # embedded default): the same sagas as itapp's sequence and then-fail.
        Saga("local-sequence", "matrix_app", ("a", "b", "c"), "completed", step="local_effect"),
        Saga(
            "local-then-fail",
            "matrix_app",
            ("x", "y", "z"),
            "compensated",
            fails=True,
            step="local_effect",
            refuser="local_refuse",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One crash: ``point`` armed as ``point:nth`` in ``role`` (``dev`` on the embedded default)
    while ``saga`` runs. ``progress``: how many bodies of the saga's progression had run when
    the process died, where thread timing does not decide it; after a commit the other threads
    or processes may have gone one step further before the kill landed. The step in
    ``reconciled`` was in doubt after the crash and must be reconciled, not run again; the
    compensation in ``rerun`` may run twice (it has no reconcile; its key makes it idempotent).
    ``racing``: the body the killed commit handed to another thread of the same process, which
    may have run it before the kill landed: then it is in doubt (a step is reconciled, a
    compensation may run twice), else it runs once after the restart.
    ``reached=False``: the point does not exist on that backend; the process must survive."""

    backend: str
    point: str
    nth: int
    saga: str
    role: str
    progress: int | None = None
    reconciled: str | None = None
    rerun: str | None = None
    racing: str | None = None
    reached: bool = True

    @property
    def spec(self) -> str:
        return f"{self.point}:{self.nth}"

    @property
    def id(self) -> str:
        if not self.reached:
            why = "never-reached-no-relay-the-outbox-is-the-queue"
            return f"{self.backend}-{self.point}-{self.saga}-{why}"
        return f"{self.backend}-{self.spec}-{self.saga}-kills-{self.role}"

    @property
    def progress_at_crash(self) -> set[int]:
        assert self.progress is not None
        ahead = 1 if self.point.endswith("after_commit") else 0
        return set(range(self.progress, self.progress + ahead + 1))


# (point, nth, saga, process killed on RabbitMQ, progress, reconciled, rerun): the nth pass falls
# in the middle of the saga. Passes per point: sequence has 4 engine messages (start and 3
# results) and 3 steps; then-fail (x, y, z, refuse, then ~z, ~y, ~x) has 8 engine messages
# (start, 4 step results, 3 compensation results), 4 steps and 3 compensations; naps fires 2
# timers. The relays race for outbox rows, so where their nth pass falls is not fixed. The
# local.* points fire in the process running in-process steps (the engine; dev embedded), once
# per in-process body whose reply is committed with the run's next activation:
# local-sequence passes local.before_commit 3 times (a, b, c); local-then-fail 4 times (x, y, z,
# refuse), local.undo_before_commit 3 times (~z, ~y, ~x) and local.after_commit 7 times.
_CRASHES: list[tuple[str, int, str, str, int | None, str | None, str | None]] = [
    ("engine.before_commit", 3, "sequence", "engine", 2, None, None),  # b's result
    ("engine.before_commit", 5, "then-fail", "engine", 4, None, None),  # refuse's: compensate
    ("engine.after_commit", 3, "sequence", "engine", 2, None, None),
    ("engine.after_commit", 6, "then-fail", "engine", 5, None, None),  # ~z's result
    ("worker.before_commit", 2, "sequence", "worker", 2, "b", None),
    ("worker.before_commit", 3, "then-fail", "worker", 3, "z", None),
    ("worker.after_commit", 2, "sequence", "worker", 2, None, None),
    ("worker.after_commit", 6, "then-fail", "worker", 6, None, None),  # ~y
    ("worker.undo_before_commit", 2, "then-fail", "worker", 6, None, "y"),
    ("relay.before_publish", 2, "sequence", "engine", None, None, None),
    ("relay.before_publish", 4, "then-fail", "worker", None, None, None),
    ("relay.after_publish", 2, "sequence", "engine", None, None, None),
    ("relay.after_publish", 4, "then-fail", "worker", None, None, None),
    ("timers.before_commit", 2, "naps", "engine", 2, None, None),  # before c
    ("debounce.before_commit", 1, "debounced", "engine", 0, None, None),  # the run's start
    ("local.before_commit", 2, "local-sequence", "engine", 2, "b", None),
    ("local.before_commit", 3, "local-then-fail", "engine", 3, "z", None),
    ("local.after_commit", 2, "local-sequence", "engine", 2, None, None),
    ("local.after_commit", 6, "local-then-fail", "engine", 6, None, None),  # ~y
    ("local.undo_before_commit", 2, "local-then-fail", "engine", 6, None, "y"),
]
# After an in-process commit the process's other local-N threads take the next step or
# compensation at once (handed over in memory): it may run before the kill lands.
_RACING = {
    ("local.after_commit", "local-sequence"): "c",
    ("local.after_commit", "local-then-fail"): "x",
}
# On the embedded default the engine and the workers are one process (``sagaloop dev``), and the
# outbox is the queue: the step or compensation an engine commit dispatched may be claimed and
# run by a worker thread before the kill at the engine's after_commit lands (seen on a busy
# machine: ~y's body ran, then again after the restart, under its one key).
_RACING_DEV = {
    ("engine.after_commit", "sequence"): "c",
    ("engine.after_commit", "then-fail"): "y",
}


def _cells() -> list[Cell]:
    cells = []
    for backend in (EMBEDDED, RABBIT):
        for point, nth, saga, role, *expect in _CRASHES:
            if backend == EMBEDDED and point in RELAY_POINTS:
                cells.append(Cell(backend, point, nth, saga, "dev", reached=False))
            else:
                racing = _RACING.get((point, saga))
                if backend == EMBEDDED:
                    racing = racing or _RACING_DEV.get((point, saga))
                killed = role if backend == RABBIT else "dev"
                cells.append(Cell(backend, point, nth, saga, killed, *expect, racing=racing))
    return cells


CELLS = _cells()


# --- the embedded default ----------------------------------------------------------------------


class EmbeddedSystem(System):
    """``System``'s helpers (spawning and logs, ``wait_final``, the ledger, histories) for one
    ``sagaloop dev`` process on a SQLite file with the database broker."""

    def __init__(self, tmp: Path, *, lease: float, app: str) -> None:  # no PostgreSQL, no AMQP
        self.app = app
        self.tmp = tmp
        self.database_url = f"sqlite:///{tmp / 'sagaloop.db'}"
        self.broker_url = "database"
        self.namespace = "sagaloop"
        self.ledger_path = tmp / "ledger.db"
        self.env = {
            **_env(),
            "SAGALOOP_DATABASE_URL": self.database_url,
            "SAGALOOP_BROKER_URL": self.broker_url,
            "SAGALOOP_LEASE": str(lease),
            "LEDGER_PATH": str(self.ledger_path),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Path] = []
        self.store = SqlStore(self.database_url)
        self.store.upgrade()  # in this process: quicker than `sagaloop db upgrade`
        self.client = Client(self.store, app)

    def dev(self, **env: str) -> subprocess.Popen[bytes]:
        return self._spawn("dev", ["dev", "--poll", "0.05"], env)

    def close(self) -> None:
        stop(self, strict=False)
        self.store.close()

    def dead_letter_count(self) -> int:
        return len(self.store.dead_letters())


def _env() -> dict[str, str]:
    paths = [str(HERE), str(HERE.parent / "integration"), str(ROOT)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def make_system(cell: Cell, tmp: Path, broker_url: str | None) -> System:
    app = SAGAS[cell.saga].app
    if cell.backend == EMBEDDED:
        return EmbeddedSystem(tmp, lease=LEASE, app=app)
    assert broker_url is not None
    system = System(tmp, broker_url, lease=LEASE, app=app)
    system.env["PYTHONPATH"] = _env()["PYTHONPATH"]  # matrix_app lives here
    return system


def start_role(system: System, role: str, **env: str) -> subprocess.Popen[bytes]:
    if isinstance(system, EmbeddedSystem):
        return system.dev(**env)
    if role == "engine":
        return system.engine(**env)
    return system.worker(",".join(load_app(system.app).queues), **env)


def stop(system: System, *, strict: bool = True) -> None:
    """SIGTERM every live process; with ``strict``, each must stop cleanly (exit code 0)."""
    live = [p for p in system.procs if p.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    for proc in live:
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if strict:
            assert code == 0, f"a process exited with {code} on SIGTERM\n{system.logs()}"


# --- driving a cell ------------------------------------------------------------------------------


def wait_for_crash(system: System, proc: subprocess.Popen[bytes], run_id: str, spec: str) -> None:
    """Wait until ``proc`` dies; fail at once if the run finishes first (the point was never
    reached in the middle of the saga) and unless it died of SIGKILL."""

    def settled() -> bool:
        run = system.store.get_run(run_id)
        return proc.poll() is not None or (run is not None and run.status in FINAL)

    eventually(settled, 60, f"crash point {spec}")
    if proc.poll() is None:
        run = system.store.get_run(run_id)
        raise AssertionError(
            f"crash point {spec} was never reached: the run is {run and run.status}\n"
            + system.logs()
        )
    assert proc.returncode == -signal.SIGKILL, (
        f"the process exited with {proc.returncode}, not killed at {spec}\n{system.logs()}"
    )


def quiet(system: System, amqp: pika.BlockingConnection | None) -> bool:
    """Nothing left to deliver: the outbox is empty, no timer is pending, no queue holds a
    message (duplicates published by a relay killed before its delete are consumed by now)."""
    if system.store.queue_depths() or system.store.next_timer_at() is not None:
        return False
    return amqp is None or all(n == 0 for n in rabbit_depths(system, amqp).values())


def rabbit_depths(system: System, conn: pika.BlockingConnection) -> dict[str, int]:
    ch = conn.channel()
    try:
        return {
            q: int(ch.queue_declare(q, passive=True).method.message_count)
            for q in system.queue_names()
        }
    finally:
        ch.close()


def unprocessed_left(system: System, conn: pika.BlockingConnection) -> list[str]:
    """Drain the queues and return the ids of messages no consumer's inbox has. A duplicate
    that a relay killed before its delete published again may still sit unacked in a consumer's
    buffer (RabbitMQ's ready count does not show it) and come back when that consumer stops:
    harmless, since the inbox has it. Anything else would be a lost message."""
    from sagaloop.engine.messages import Envelope, inbox_key

    app = load_app(system.app).name
    missing = []
    ch = conn.channel()
    try:
        for queue in system.queue_names():
            consumer = "engine" if queue.endswith((".engine", ".starts")) else "worker"
            while True:
                method, _props, body = ch.basic_get(queue, auto_ack=True)
                if method is None:
                    break
                env = Envelope.from_bytes(body)
                with system.store.transaction() as tx:  # under the key the consumers record
                    seen, _ = system.store.inbox_get(tx, consumer, inbox_key(app, env))
                if not seen:
                    missing.append(f"{env.type} {env.message_id} of {env.run_id} on {queue}")
    finally:
        ch.close()
    return missing


def drive(cell: Cell, system: System) -> str:
    """Run the cell's saga with its crash point armed in one process, restart that process
    without it, wait for the run's end and for the system to go quiet, and stop every process
    cleanly. Return the run id."""
    saga = SAGAS[cell.saga]
    crash = {"SAGALOOP_CRASH_AT": cell.spec}
    if isinstance(system, EmbeddedSystem):
        doomed = system.dev(**crash)
    else:
        engine = system.engine(**(crash if cell.role == "engine" else {}))
        worker = start_role(system, "worker", **(crash if cell.role == "worker" else {}))
        doomed = engine if cell.role == "engine" else worker
    started = time.monotonic()  # the dead relay's rows were committed (and claimed) after it
    run_id = _start(system, saga)
    if cell.reached:
        wait_for_crash(system, doomed, run_id, cell.spec)
        if saga.debounced:  # killed before the commit that starts the run: the window stays
            assert system.store.get_run(run_id) is None, f"{cell.spec}: the run was started"
            assert [w.run_id for w in system.store.pending_debounced()] == [run_id]
        else:
            run = system.client.get(run_id)
            assert run.status not in FINAL, f"{cell.spec} fired after the run ended ({run.status})"
        done = progression(system)
        assert done == list(saga.progression[: len(done)]), f"out of order: {done}"
        if cell.progress is not None:
            assert len(done) in cell.progress_at_crash, f"{cell.spec} did not hit {done}"
        if cell.point in RELAY_POINTS:  # the dead relay's claim holds its rows until the lease
            claimed = claimed_rows(system)
            # their claim holds for the hand-over lease from their commit, which came after
            # `started`: past it, another process's sweep may have published them already (the
            # death is seen late on a loaded machine: a lease from then would be too long);
            # within it, only a takeover (a live process's beat, every few seconds, that found
            # the dead pid) releases them early, and it says so in the registry
            if time.monotonic() - started < HANDOFF_LEASE.total_seconds():
                taken = taken_over(system)
                assert claimed > 0 or taken, f"{cell.spec}: the relay left no claimed rows"
        start_role(system, cell.role)
    assert system.wait_final([run_id]) == {run_id: saga.status}
    amqp = None if isinstance(system, EmbeddedSystem) else _connect(system)
    try:
        eventually(lambda: quiet(system, amqp), 60, "the system to go quiet")
        if not cell.reached:
            assert doomed.poll() is None, f"{cell.point} killed the process\n{system.logs()}"
        stop(system)
        if amqp is not None:  # what the stopped consumers held went back: at most duplicates
            assert unprocessed_left(system, amqp) == [], "a message was never processed"
    finally:
        if amqp is not None:
            amqp.close()
    return run_id


def _start(system: System, saga: Saga) -> str:
    """Start the saga's run; a debounced one by a burst of starts whose last has the names
    (the client needs the saga's declaration: the app itself, not its name)."""
    if not saga.debounced:
        return system.client.start(saga.name, list(saga.names))
    client = Client(system.store, load_app(saga.app))
    run_id = client.start(saga.name, list(saga.names[:1]))
    assert client.start(saga.name, list(saga.names[:2])) == run_id
    assert client.start(saga.name, list(saga.names)) == run_id  # the last input wins
    return run_id


def _connect(system: System) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(system.broker_url))


# --- checks from outside the engine --------------------------------------------------------------


def progression(system: System) -> list[str]:
    """The ledger's bodies in the order they first ran (``~name`` for compensations)."""
    done: list[str] = []
    for step, key in system.ledger("select step, key from bodies order by rowid"):
        label = f"~{step}" if str(key).endswith("/undo") else str(step)
        if label not in done:
            done.append(label)
    return done


def claimed_rows(system: System) -> int:
    with system.store.engine.connect() as conn:
        q = sa.select(sa.func.count()).where(outbox.c.claim_token.is_not(None))
        return int(conn.execute(q).scalar_one())


def taken_over(system: System) -> list[str]:
    """The processes whose claims a takeover released (it forgets their tokens)."""
    with system.store.engine.connect() as conn:
        q = sa.select(processes.c.name).where(processes.c.token.is_(None))
        return list(conn.execute(q).scalars())


def check(cell: Cell, system: System, run_id: str) -> None:
    """Everything the guarantees promise about the cell's run, checked in the ledger, the
    timeline, the history and the dead letters."""
    saga = SAGAS[cell.saga]
    timeline = system.client.status(run_id)
    lines = timeline.steps
    assert [line.step for line in lines] == [saga.step_of(c) for c in saga.calls]
    key = {c: line.idempotency_key for c, line in zip(saga.calls, lines, strict=True)}
    for c, line in zip(saga.calls, lines, strict=True):
        assert line.idempotency_key == f"{run_id}/{line.position}/do"
        expected = "failed" if c == "refuse" else "completed"
        allowed = {expected}
        if c == cell.reconciled:
            allowed = {"reconciled"}  # in doubt after the crash: reconciled, not run again
        elif c == cell.racing and c != "refuse":
            allowed.add("reconciled")  # if it ran before the kill landed
        assert (line.state, line.attempts) in {(a, 1) for a in allowed}, (c, line)
        undo = "compensated" if saga.fails and c != "refuse" else None
        assert line.compensation == undo, (c, line)

    # Every effect exactly once, under the step's own key.
    effects = sorted(system.ledger("select key, step from effects"))
    assert effects == sorted((key[c], c) for c in saga.calls)
    # Every compensation exactly once, newest first, under the compensation's key.
    undo_key = {c: key[c].removesuffix("/do") + "/undo" for c in saga.undone}
    undos = system.ledger("select key, step from undos order by seq")
    assert undos == [(undo_key[c], c) for c in saga.undone]
    # Each body ran once (a step in doubt was reconciled, a committed one answered from the
    # inbox), except a compensation redelivered after it ran: it has no reconcile, so it may
    # run again under the same key (the ledger above kept one effect).
    bodies = Counter((str(s), str(k)) for s, k in system.ledger("select step, key from bodies"))
    assert set(bodies) == {(c, key[c]) for c in saga.calls} | set(undo_key.items())
    for (step, k), n in bodies.items():
        rerun = step in (cell.rerun, cell.racing) and k == undo_key.get(step)
        assert n == 1 or (rerun and n == 2), f"the body of {step} ({k}) ran {n} times"
    assert progression(system) == list(saga.progression), "bodies ran out of order"

    check_history(system, run_id)
    assert system.dead_letter_count() == 0
    assert system.store.dead_letters() == []


def check_history(system: System, run_id: str) -> None:
    """Gap-free; one command per position; each outcome recorded once; one end, at the end."""
    system.assert_histories_sound([run_id])
    events = system.client.history(run_id)
    commands = [e.pos for e in events if e.kind in h.COMMAND_KINDS]
    assert len(commands) == len(set(commands)), f"a command position recorded twice: {commands}"
    for kind in (h.STEP_COMPLETED, h.STEP_FAILED, h.TIMER_FIRED, h.COMPENSATION_COMPLETED):
        positions = [e.pos for e in events if e.kind == kind]
        assert len(positions) == len(set(positions)), f"{kind} twice at a position: {positions}"
    finished = [e.seq for e in events if e.kind == h.RUN_FINISHED]
    assert finished == [events[-1].seq], "the run must finish once, with its last event"
