"""The crash matrix's cells for the primitives of issue 11: child start (``family``), runs that
start runs and send them events (``boss``), continue-as-new (``cycle``), a running step
cancelled through its heartbeats (``long``) and a cancel delivered into saga code that tidies up
in its ``finally`` (``tidy``, issue 25), all in matrix_app.py, each killed at the engine's
and the worker's commit points on both backends. Driving and checking reuse matrix.py; the
checks are the matrix's, extended to every run the saga started: terminal statuses, each effect
once under its key, compensations once and newest first, sound histories, no dead letters."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from matrix import (
    EMBEDDED,
    LEASE,
    RABBIT,
    EmbeddedSystem,
    _connect,
    _env,
    check_history,
    quiet,
    start_role,
    stop,
    unprocessed_left,
    wait_for_crash,
)
from system import FINAL, System

from sagaloop.engine import history as h
from sagaloop.testing import eventually

APP = "matrix_app"
NAMES = ("a", "b", "c")
LONG = "marathon"  # the name of the long saga's job
INPUTS = {"family": list(NAMES), "boss": list(NAMES), "cycle": list(NAMES), "long": LONG}
STATUS = {"family": "completed", "boss": "completed", "cycle": "completed", "long": "cancelled"}
CANCELLED = ("long", "tidy")  # the sagas the test cancels while their long step runs
INPUTS["tidy"], STATUS["tidy"] = LONG, "cancelled"


@dataclasses.dataclass(frozen=True)
class PrimitiveCell:
    """``point:nth`` armed in ``role`` (``dev`` on the embedded default) while ``saga`` runs."""

    backend: str
    point: str
    nth: int
    saga: str
    role: str
    done: int | None = None  # effects in the ledger when the process died (where not racy)

    @property
    def spec(self) -> str:
        return f"{self.point}:{self.nth}"

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.spec}-{self.saga}-kills-{self.role}"

    @property
    def done_at_crash(self) -> set[int]:
        """After a commit, the other threads or processes may have gone one step further."""
        assert self.done is not None
        ahead = 1 if self.point.endswith("after_commit") else 0
        return set(range(self.done, self.done + ahead + 1))

    @property
    def long_job_may_rerun(self) -> bool:
        """The process running the long step was killed before its outcome was committed (the
        worker at its commit, or the one ``sagaloop dev`` process at the engine's points): the
        message comes back in doubt and, with no reconcile, the body runs again (and stops at
        its first heartbeat). Its effect is still recorded once under its key."""
        if self.saga not in CANCELLED:
            return False
        return self.point == "worker.before_commit" or (
            self.backend == EMBEDDED and self.point.startswith("engine.")
        )


# (point, nth, saga, process killed on RabbitMQ, effects when it died). The nth pass falls in
# the middle of the saga. family: engine passes are the parent's start, then per child its
# start, its step's result and the parent taking its output, so pass 4 is the parent starting
# child b; its worker passes are the children's steps. boss: engine pass 1 starts the three
# helpers and sends them their events; pass 2 is the first helper messages. cycle: pass 2 is
# a's result, continuing as new; pass 4 is b's, from the second history. long: passes 1 and 2
# are the start and the reservation's result; the test cancels the run while the long step
# runs, so pass 3 is the cancellation; worker pass 2 is the long step's StepCancelled failure.
# The helpers of boss run at once, so how many effects there were when a process died is not
# fixed there (None).
_CRASHES: list[tuple[str, int, str, str, int | None]] = [
    ("engine.before_commit", 4, "family", "engine", 1),
    ("engine.after_commit", 4, "family", "engine", 1),
    ("worker.before_commit", 2, "family", "worker", 2),
    ("worker.after_commit", 2, "family", "worker", 2),
    ("engine.before_commit", 1, "boss", "engine", 0),
    ("engine.after_commit", 2, "boss", "engine", None),
    ("worker.before_commit", 2, "boss", "worker", None),
    ("worker.after_commit", 2, "boss", "worker", None),
    ("engine.before_commit", 4, "cycle", "engine", 2),
    ("engine.after_commit", 2, "cycle", "engine", 1),
    ("worker.before_commit", 2, "cycle", "worker", 2),
    ("worker.after_commit", 2, "cycle", "worker", 2),
    ("engine.before_commit", 3, "long", "engine", 2),
    ("engine.after_commit", 3, "long", "engine", 2),
    ("worker.before_commit", 2, "long", "worker", 2),
    ("worker.after_commit", 2, "long", "worker", 2),
    # tidy: pass 3 is the cancel delivered into the code, which schedules its tidying step
    ("engine.before_commit", 3, "tidy", "engine", 2),
    ("engine.after_commit", 3, "tidy", "engine", 2),
]

PRIMITIVE_CELLS = [
    PrimitiveCell(backend, point, nth, saga, role if backend == RABBIT else "dev", done)
    for backend in (EMBEDDED, RABBIT)
    for point, nth, saga, role, done in _CRASHES
]


def make_primitive_system(cell: PrimitiveCell, tmp: Path, broker_url: str | None) -> System:
    if cell.backend == EMBEDDED:
        return EmbeddedSystem(tmp, lease=LEASE, app=APP)
    assert broker_url is not None
    system = System(tmp, broker_url, lease=LEASE, app=APP)
    system.env["PYTHONPATH"] = _env()["PYTHONPATH"]  # matrix_app lives here
    return system


def marks(system: System) -> list[str]:
    return [str(w) for (w,) in system.ledger("select what from marks order by rowid")]


def drive_primitive(cell: PrimitiveCell, system: System) -> str:
    """As matrix.drive: run the saga with the point armed in one process (for ``long``, cancel
    the run once its long step runs), restart that process without it, wait for every run to
    end and the system to go quiet, stop the processes cleanly. Return the run id."""
    crash = {"SAGALOOP_CRASH_AT": cell.spec}
    if isinstance(system, EmbeddedSystem):
        doomed = system.dev(**crash)
    else:
        engine = system.engine(**(crash if cell.role == "engine" else {}))
        worker = start_role(system, "worker", **(crash if cell.role == "worker" else {}))
        doomed = engine if cell.role == "engine" else worker
    run_id = system.client.start(cell.saga, INPUTS[cell.saga])
    if cell.saga in CANCELLED:
        eventually(lambda: f"{LONG} started" in marks(system), 60, "the long step to run")
        assert doomed.poll() is None, f"{cell.spec} fired before the cancellation"
        system.client.cancel(run_id, "the user gave up")
    wait_for_crash(system, doomed, run_id, cell.spec)
    if cell.done is not None:
        done = len(system.ledger("select key from effects"))
        assert done in cell.done_at_crash, f"{cell.spec} died after {done} effects"
    start_role(system, cell.role)
    assert system.wait_final([run_id]) == {run_id: STATUS[cell.saga]}
    eventually(lambda: _all_final(system), 60, "every run to end")
    amqp = None if isinstance(system, EmbeddedSystem) else _connect(system)
    try:
        eventually(lambda: quiet(system, amqp), 60, "the system to go quiet")
        stop(system)
        if amqp is not None:
            assert unprocessed_left(system, amqp) == [], "a message was never processed"
    finally:
        if amqp is not None:
            amqp.close()
    return run_id


def _all_final(system: System) -> bool:
    return all(r.status in FINAL for r in system.store.list_runs(limit=100))


def _started(system: System, run_id: str, kind: str) -> list[str]:
    return [e.data["run_id"] for e in system.client.history(run_id) if e.kind == kind]


def check_primitive(cell: PrimitiveCell, system: System, run_id: str) -> None:
    """The cell's runs ended as they must, with each effect once; see the module's doc."""
    runs = {r.run_id: r for r in system.store.list_runs(limit=100)}
    effects = sorted((str(s), str(k)) for k, s in system.ledger("select key, step from effects"))
    bodies = Counter((str(s), str(k)) for s, k in system.ledger("select step, key from bodies"))
    undos = [(str(s), str(k)) for k, s in system.ledger("select key, step from undos order by seq")]
    others: list[str] = []
    if cell.saga in ("family", "boss"):
        kind = h.CHILD_STARTED if cell.saga == "family" else h.RUN_SPAWNED
        others = _started(system, run_id, kind)
        assert len(others) == 3 and len(set(others)) == 3, f"one run per name: {others}"
        inputs = [runs[o].input for o in others]
        assert sorted(inputs) == list(NAMES), inputs
        assert system.client.get(run_id).output == [f"{n}:done" for n in NAMES]
        by_name = dict(zip(inputs, others, strict=True))
        assert [s for s, _ in effects] == list(NAMES), effects
        for step, key in effects:
            assert key.startswith(f"{by_name[step]}/") and key.endswith("/do"), (step, key)
        for o in others:
            assert runs[o].status == "completed", (o, runs[o].status)
            assert system.client.get(o).output == f"{runs[o].input}:done"
    if cell.saga == "family":
        kinds = [e.kind for e in system.client.history(run_id)]
        assert kinds.count(h.CHILD_COMPLETED) == 3, kinds
    if cell.saga == "boss":
        history = system.client.history(run_id)
        sent = sorted(e.data["run_id"] for e in history if e.kind == h.EVENT_SENT)
        assert sent == sorted(others), "one event to each helper"
        assert [e.name for e in history if e.kind == h.EVENT_ARRIVED] == ["done"] * 3
        for o in others:
            events = system.client.history(o)
            assert [e.name for e in events if e.kind == h.EVENT_ARRIVED] == ["boss"], o
            assert [e.data["run_id"] for e in events if e.kind == h.EVENT_SENT] == [run_id]
    if cell.saga == "cycle":
        assert system.client.get(run_id).output == "c:done"
        assert [s for s, _ in effects] == list(NAMES), effects
        keys = [k for _, k in effects]
        assert len(set(keys)) == 3 and all(k.startswith(f"{run_id}/") for k in keys), keys
        first = system.client.history(run_id)[0]
        assert first.kind == h.RUN_STARTED and first.data["input"] == ["c"], first.data
        assert first.data["epoch"] == 2, first.data
    if cell.saga == "long":
        assert [s for s, _ in effects] == [LONG, f"{LONG}-before"], effects
        assert [s for s, _ in undos] == [LONG, f"{LONG}-before"], "undone once, newest first"
        for step, key in undos:
            assert (step, key.removesuffix("/undo") + "/do") in effects, (step, key)
        failed = [e for e in system.client.history(run_id) if e.kind == h.STEP_FAILED]
        assert [e.data["error"]["type"] for e in failed] == ["StepCancelled"], failed
        seen = marks(system)
        # every copy of the long step still running when the run was cancelled was told to
        # stop and cleaned up; a copy may have died with its process (no cleanup), and a task
        # the relay published again after the engine's death may run beside the first (steps
        # are at least once)
        started, stopped = seen.count(f"{LONG} started"), seen.count(f"{LONG} cancelled")
        assert seen[-1] == f"{LONG} cleanup" and 1 <= stopped <= started, seen
        assert seen.count(f"{LONG} cleanup") == stopped, seen
        assert f"{LONG} never cancelled" not in seen
    elif cell.saga == "tidy":
        tidied = f"{LONG}-tidied"
        assert [s for s, _ in effects] == [LONG, f"{LONG}-before", tidied], effects
        assert sorted(s for s, _ in undos[:2]) == [LONG, tidied], "undone once, newest first"
        assert [s for s, _ in undos[2:]] == [f"{LONG}-before"], undos
        history = system.client.history(run_id)
        kinds = [e.kind for e in history]
        assert kinds.count(h.CANCEL_DELIVERED) == 1, kinds
        assert [e.name for e in history if e.kind == h.STEP_SCHEDULED].count("reserve") == 2
        failed = [e for e in history if e.kind == h.STEP_FAILED]
        assert [e.data["error"]["type"] for e in failed] == ["StepCancelled"], failed
        seen = marks(system)
        assert seen[-2:] == [f"{LONG} cancelled", f"{LONG} cleanup"], seen
    else:
        assert undos == [], undos

    assert set(runs) == {run_id, *others}, f"runs nobody started: {set(runs)}"
    assert runs[run_id].status == STATUS[cell.saga]
    # A body runs again only if it was cut off: the process running it died before committing
    # its result. The boss's helpers run their steps at the same time, so a kill at one's
    # commit may cut off another's body in the same worker process (its effect stays once).
    cut_off = cell.saga == "boss" and cell.role in ("dev", "worker")
    for (step, key), n in bodies.items():
        rerun = cut_off or (step == LONG and not key.endswith("/undo") and cell.long_job_may_rerun)
        assert n == 1 or (rerun and n == 2), f"the body of {step} ({key}) ran {n} times"
    for r in runs:
        check_history(system, r)
    assert system.dead_letter_count() == 0
    assert system.store.dead_letters() == []
