"""The saga primitives of issue 11 on real processes: on RabbitMQ + PostgreSQL (separate
`sagaloop engine` and `sagaloop worker` processes) and on the embedded default (one `sagaloop
dev` process on a SQLite file, database broker). The sagas are in primitives_app.py; every
outcome is checked from outside the engine: the ledger of effects, run statuses, published
values, histories, the dead letters.

One system per backend serves the whole module (each test uses its own effect names), so the
processes start twice, not once per test."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from system import System
from test_hostile_saga_processes import Dev

from sagaloop import RunFinishedError
from sagaloop.client import Client
from sagaloop.engine import history as h
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration
APP = "primitives_app"
FINAL = {"completed", "failed", "compensated", "cancelled"}


@dataclass
class Backend:
    """What a test needs of either backend: a client on its database, the ledger, the CLI
    with the processes' settings, the dead letters and the processes' logs."""

    name: str
    client: Client
    ledger: Callable[..., list[tuple[Any, ...]]]
    cli: Callable[..., str]
    dead_letters: Callable[[], int]
    logs: Callable[[], str]
    alive: Callable[[], bool]

    def wait_final(self, run_ids: list[str], timeout: float = 90) -> dict[str, str]:
        def done() -> dict[str, str] | None:
            statuses = {r: self.client.store.get_run(r) for r in run_ids}
            out = {r: run.status if run else "absent" for r, run in statuses.items()}
            return out if set(out.values()) <= FINAL else None

        try:
            result = eventually(done, timeout, f"{run_ids} to finish")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None
        assert result is not None
        return result

    def effects(self, *steps: str) -> dict[str, int]:
        """How many distinct effects (idempotency keys) each of ``steps`` has in the ledger."""
        rows = self.ledger("select step, count(*) from effects group by step")
        counts = {str(s): int(n) for s, n in rows}
        return {s: counts.get(s, 0) for s in steps}

    def bodies(self, step: str) -> list[int]:
        """The attempts of ``step``'s body that ran (compensations excluded)."""
        rows = self.ledger(
            "select attempt from bodies where step = ? and key not like '%/undo' order by rowid",
            step,
        )
        return [int(a) for (a,) in rows]

    def undos(self, *steps: str) -> list[str]:
        rows = self.ledger("select step from undos order by seq")
        return [str(s) for (s,) in rows if s in steps]

    def marks(self, prefix: str) -> list[str]:
        rows = self.ledger("select what from marks order by rowid")
        return [str(w) for (w,) in rows if str(w).startswith(prefix)]

    def assert_sound(self, run_ids: list[str]) -> None:
        """Gap-free histories, one command per position, one end; nothing dead-lettered."""
        for run_id in run_ids:
            events = self.client.history(run_id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1)), run_id
            commands = [e.pos for e in events if e.kind in h.COMMAND_KINDS]
            assert len(commands) == len(set(commands)), f"{run_id}: a position twice: {commands}"
            finished = [e.seq for e in events if e.kind == h.RUN_FINISHED]
            assert finished == [events[-1].seq], f"{run_id} must finish once, at the end"
        assert self.dead_letters() == 0, self.logs()
        assert self.client.store.dead_letters() == []
        assert self.alive(), self.logs()


def _rabbit(tmp: Path, url: str) -> Iterator[Backend]:
    system = System(tmp, url, app=APP)
    try:
        system.engine()
        system.worker(queues="work")
        system.wait_ready("engine")
        system.wait_ready("worker")
        yield Backend(
            "rabbit",
            system.client,
            system.ledger,
            system.sagaloop,
            system.dead_letter_count,
            system.logs,
            lambda: all(p.poll() is None for p in system.procs),
        )
    finally:
        system.close()


def _read_ledger(path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    if not path.exists():
        return []
    with sqlite3.connect(path, timeout=60) as conn:
        try:
            return list(conn.execute(sql, args))
        except sqlite3.OperationalError:  # a table no step created yet
            return []


def _embedded(tmp: Path) -> Iterator[Backend]:
    dev = Dev(tmp, APP, SAGALOOP_LEASE="3")  # heartbeats and renewals once a second
    store = SqlStore(dev.env["SAGALOOP_DATABASE_URL"])
    try:
        eventually(lambda: "dev: app" in dev.log.read_text(), what="dev to start")
        yield Backend(
            "embedded",
            Client(store, APP),
            lambda sql, *args: _read_ledger(dev.ledger, sql, *args),
            dev.cli,
            lambda: len(store.dead_letters()),
            lambda: dev.log.read_text(errors="replace")[-6000:],
            lambda: dev.proc.poll() is None,
        )
    finally:
        dev.close()
        store.close()


@pytest.fixture(scope="module", params=["rabbit", "embedded"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "rabbit":
        yield from _rabbit(tmp, request.getfixturevalue("rabbitmq_url"))
    else:
        yield from _embedded(tmp)


def _children(backend: Backend, run_id: str, kind: str) -> list[str]:
    return [e.data["run_id"] for e in backend.client.history(run_id) if e.kind == kind]


# --- child runs ----------------------------------------------------------------------------------


def test_child_runs_return_their_output_and_a_failed_child_is_step_failed(
    backend: Backend,
) -> None:
    run = backend.client.start("parent", ["kid1", "kid2"])
    assert backend.wait_final([run]) == {run: "completed"}
    out = backend.client.get(run).output
    assert out["done"] == ["kid1:done", "kid2:done"], out
    assert "Refused: kid1-bad refused" in out["failed"], out
    children = _children(backend, run, h.CHILD_STARTED)
    assert len(children) == 3 and len(set(children)) == 3, children
    statuses = {c: backend.client.get(c).status for c in children}
    assert list(statuses.values()) == ["completed", "completed", "failed"], statuses
    assert [backend.client.get(c).saga for c in children] == ["child", "child", "failing-child"]
    kinds = [e.kind for e in backend.client.history(run)]
    assert (kinds.count(h.CHILD_COMPLETED), kinds.count(h.CHILD_FAILED)) == (2, 1), kinds
    assert backend.effects("kid1", "kid2", "kid1-bad") == {"kid1": 1, "kid2": 1, "kid1-bad": 1}
    assert backend.bodies("kid1") == [1] and backend.bodies("kid2") == [1]
    backend.assert_sound([run, *children])


def test_cancelling_a_parent_cancels_its_waiting_child(backend: Backend) -> None:
    run = backend.client.start("waiting-parent", "orphan")
    eventually(lambda: _children(backend, run, h.CHILD_STARTED), what="the child run")
    [kid] = _children(backend, run, h.CHILD_STARTED)
    eventually(
        lambda: (
            backend.client.store.get_run(kid) is not None
            and backend.client.get(kid).status == "waiting"
        ),
        what="the child to wait",
    )
    backend.client.cancel(run, "no longer needed")
    assert backend.wait_final([run, kid]) == {run: "cancelled", kid: "cancelled"}
    assert backend.effects("orphan") == {"orphan": 1}
    assert backend.undos("orphan") == ["orphan"], "the child's completed step undone once"
    backend.assert_sound([run, kid])


# --- runs that start and message other runs ------------------------------------------------------


def test_started_runs_and_events_between_runs(backend: Backend) -> None:
    jobs = ["job1", "job2", "job3"]
    run = backend.client.start("boss", jobs)
    assert backend.wait_final([run]) == {run: "completed"}
    assert backend.client.get(run).output == [f"{j}:done" for j in jobs]
    helpers = _children(backend, run, h.RUN_SPAWNED)
    assert len(set(helpers)) == 3, helpers
    assert backend.wait_final(helpers) == dict.fromkeys(helpers, "completed")
    assert sorted(backend.client.get(x).output for x in helpers) == [f"{j}:done" for j in jobs]
    sent = [e for e in backend.client.history(run) if e.kind == h.EVENT_SENT]
    assert sorted(e.data["run_id"] for e in sent) == sorted(helpers), "one event per helper"
    for x in helpers:
        back = [e for e in backend.client.history(x) if e.kind == h.EVENT_SENT]
        assert [e.data["run_id"] for e in back] == [run], "one event back to the boss"
    arrived = [e.name for e in backend.client.history(run) if e.kind == h.EVENT_ARRIVED]
    assert arrived == ["done"] * 3, arrived
    assert backend.client.get_published(run, "started") == 3
    assert backend.effects(*jobs) == dict.fromkeys(jobs, 1)
    assert all(backend.bodies(j) == [1] for j in jobs)
    backend.assert_sound([run, *helpers])


# --- continue as new -----------------------------------------------------------------------------


def test_continue_as_new_keeps_one_run_id_and_never_repeats_a_key(backend: Backend) -> None:
    run = backend.client.start("looping", {"n": 0, "until": 4})
    assert backend.wait_final([run]) == {run: "completed"}
    assert backend.client.get(run).output == {"n": 4}
    names = [f"loop{i}" for i in range(4)]
    assert backend.effects(*names) == dict.fromkeys(names, 1)
    keys = [
        str(k)
        for (k,) in backend.ledger("select key from bodies where step like 'loop%' order by rowid")
    ]
    assert len(keys) == 4 and len(set(keys)) == 4, keys
    assert all(k.startswith(f"{run}/") for k in keys), keys
    history = backend.client.history(run)
    first = history[0]
    assert first.kind == h.RUN_STARTED and first.data["input"] == {"n": 4, "until": 4}
    assert first.data["epoch"] == 4, first.data
    assert len(history) < 10, "the history restarted with each continue_as_new"
    assert backend.client.get_published(run, "n") == 4
    backend.assert_sound([run])


# --- events in arrival order, published values, signal-with-start --------------------------------


def test_wait_for_any_takes_the_first_arrival_and_published_values_show(
    backend: Backend,
) -> None:
    run = backend.client.start("review", "draft-v1", event=("edit", "draft-v2"))
    eventually(
        lambda: backend.client.get_published(run, "draft") == "draft-v2",
        what="the edit delivered with the start",
    )
    eventually(lambda: backend.client.get(run).status == "waiting", what="the second question")
    assert backend.client.status(run).prompts == {"approve|reject|edit": {"draft": "draft-v2"}}
    shown = json.loads(backend.cli("status", run, "--json"))
    assert shown["published"]["draft"] == "draft-v2", shown
    backend.client.send_event(run, "approve", "alice")
    with contextlib.suppress(RunFinishedError):  # the run may be over already
        backend.client.send_event(run, "reject", "bob")
    assert backend.wait_final([run]) == {run: "completed"}
    history = backend.client.history(run)
    arrived = [e.name for e in history if e.kind == h.EVENT_ARRIVED]
    assert arrived[0] == "edit", arrived
    first = next(n for n in arrived[1:] if n in ("approve", "reject"))
    by = {"approve": "alice", "reject": "bob"}[first]
    out = backend.client.get(run).output
    assert out == {"outcome": first, "by": by, "draft": "draft-v2", "edits": 1}, (out, arrived)
    assert backend.client.get_published(run, "outcome") == first
    label = f"{first}-draft-v2"
    assert backend.effects(label) == {label: 1} and backend.bodies(label) == [1]
    backend.assert_sound([run])


# --- compensate and still finish -----------------------------------------------------------------


def test_compensate_then_finish_undoes_newest_first_and_completes(backend: Backend) -> None:
    run = backend.client.start("trip", ["car", "hotel"])
    assert backend.wait_final([run]) == {run: "completed"}
    assert backend.client.get(run).output == {"status": "failure"}
    assert backend.client.get_published(run, "status") == "failure"
    assert backend.effects("car", "hotel", "flight") == {"car": 1, "hotel": 1, "flight": 1}
    assert backend.undos("car", "hotel") == ["hotel", "car"], "each undone once, newest first"
    lines = backend.client.status(run).steps
    assert [(x.step, x.compensation) for x in lines] == [
        ("effect", "compensated"),
        ("effect", "compensated"),
        ("refuse", None),
    ]
    kinds = [e.kind for e in backend.client.history(run)]
    assert kinds.count(h.COMPENSATE_REQUESTED) == 1 and h.COMPENSATE_DONE in kinds
    backend.assert_sound([run])


# --- long steps: heartbeats, cancellation, heartbeat timeout -------------------------------------


def test_cancel_reaches_a_running_step_through_its_heartbeats(backend: Backend) -> None:
    run = backend.client.start("long", "marathon")
    eventually(lambda: backend.marks("marathon ") == ["marathon started"], what="the long step")
    assert backend.client.get_published(run, "phase") == "long job"
    backend.client.cancel(run, "the user gave up")
    assert backend.wait_final([run], timeout=60) == {run: "cancelled"}
    assert backend.marks("marathon ") == [
        "marathon started",
        "marathon cancelled",
        "marathon cleanup",
    ], "the step stopped at a heartbeat and its finally ran"
    failed = [e for e in backend.client.history(run) if e.kind == h.STEP_FAILED]
    assert [e.data["error"]["type"] for e in failed] == ["StepCancelled"], failed
    assert backend.bodies("marathon") == [1], "a cancelled step is not retried"
    assert backend.effects("marathon", "marathon-before") == {
        "marathon": 1,
        "marathon-before": 1,
    }
    assert backend.undos("marathon", "marathon-before") == ["marathon", "marathon-before"]
    backend.assert_sound([run])


def test_a_silent_attempt_fails_in_doubt_at_its_heartbeat_timeout(backend: Backend) -> None:
    run = backend.client.start("silent", "hush")
    assert backend.wait_final([run]) == {run: "completed"}
    assert backend.client.get(run).output == 2
    [retrying] = [e for e in backend.client.history(run) if e.kind == h.STEP_RETRYING]
    assert "heartbeat" in retrying.data["error"]["message"], retrying.data
    assert retrying.data["in_doubt"] is True, retrying.data
    assert backend.bodies("hush")[:2] == [1, 2]
    backend.assert_sound([run])
