"""Run concurrency keys (issue 25) across processes: two ``sagaloop dev`` processes on one
PostgreSQL database (database broker) take the starts of 24 runs of 3 keys limited to 2 runs
at once per key; from the histories, no key ever had more than 2 runs between the start of
their code and their end, every run completed, and no slot or queue row is left.
And a singleton (limit 1, cancel_new) started 6 times at once runs once, the others cancelled.
Then two engines' transactions at once on PostgreSQL: the key's lock and the slot's primary key
keep a second claim out and let no end miss a run queued meanwhile."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from concurrency_app import LIMIT

from sagaloop import Client
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine import history as h
from sagaloop.engine.activation import ActivationConflict, Engine
from sagaloop.engine.messages import Envelope, engine_queue, start_queue
from sagaloop.engine.plan import Plan
from sagaloop.sagas.concurrency import Concurrency
from sagaloop.store import tables as t
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually
from tests.unit.test_run_concurrency import gated_app

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent
ROOT = HERE.parent.parent
FINAL = {"completed", "failed", "compensated", "cancelled"}


@pytest.fixture
def devs(tmp_path: Path, postgres_url: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    env = {
        **os.environ,
        "SAGALOOP_DATABASE_URL": postgres_url,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
    }
    procs, logs = [], []
    for i in range(2):
        log = tmp_path / f"dev-{i}.log"
        logs.append(log)
        args = ["dev", "--app", "concurrency_app", "--poll", "0.05", "--concurrency", "8"]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "sagaloop", *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log.open("wb"),
            )
        )
    try:
        for log in logs:
            eventually(lambda log=log: "dev: app" in log.read_text(errors="replace"), 60)
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_final(client: Client, run_ids: list[str]) -> dict[str, str]:
    def done() -> dict[str, str] | None:
        out = {r: client.get(r).status for r in run_ids}
        return out if set(out.values()) <= FINAL else None

    result = eventually(done, 120, "the runs to finish")
    assert result is not None
    return result


def _span(client: Client, run_id: str) -> tuple[datetime, datetime]:
    """When the run's code started (its first event after ``run_started``) and ended."""
    events = client.history(run_id)
    code = [e.at for e in events if e.kind != h.RUN_STARTED]
    end = [e.at for e in events if e.kind == h.RUN_FINISHED]
    return code[0], end[-1]


def test_two_dev_processes_keep_each_key_to_its_limit(
    devs: list[subprocess.Popen[bytes]], postgres_url: str
) -> None:
    store = SqlStore(postgres_url)
    try:
        client = Client(store, "concurrency_app")
        users = ["u1", "u2", "u3"]
        runs = {u: [client.start("per_user", {"user": u, "n": n}) for n in range(8)] for u in users}
        every = [r for rs in runs.values() for r in rs]
        assert set(_wait_final(client, every).values()) == {"completed"}
        for user, run_ids in runs.items():
            spans = [_span(client, r) for r in run_ids]
            points = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
            running = list(itertools.accumulate(d for _, d in points))
            assert max(running) <= LIMIT, (user, max(running))
            assert max(running) == LIMIT, "the runs of a key did overlap up to the limit"
        with store.engine.connect() as conn:
            left = conn.execute(t.concurrency_slots.select()).all()
            queued = conn.execute(t.concurrency_waiters.select()).all()
        assert [r for r in left if r.app == "concurrency_app"] == []
        assert [r for r in queued if r.app == "concurrency_app"] == []
    finally:
        store.close()
    assert all(p.poll() is None for p in devs)


def test_a_singleton_started_six_times_at_once_runs_once(
    devs: list[subprocess.Popen[bytes]], postgres_url: str
) -> None:
    store = SqlStore(postgres_url)
    try:
        client = Client(store, "concurrency_app")
        run_ids = [client.start("singleton", {"n": n}) for n in range(6)]
        statuses = _wait_final(client, run_ids)
        assert sorted(statuses.values()) == ["cancelled"] * 5 + ["completed"], statuses
    finally:
        store.close()


# --- the key's lock on PostgreSQL: two engines' transactions at once ---------------------------


def _take(store: SqlStore, app_name: str) -> list[Envelope]:
    deliveries = DatabaseBroker(store).receive(
        [engine_queue(app_name), start_queue(app_name)], 16, 0
    )
    return [Envelope.model_validate_json(d.body) for d in deliveries]


def _waiting_for_a_lock(store: SqlStore) -> bool:
    with store.engine.connect() as conn:
        q = sa.text("select count(*) from pg_locks where locktype = 'advisory' and not granted")
        return bool(conn.execute(q).scalar_one())


def _apply_in_thread(
    engine: Engine, store: SqlStore, plan: Plan
) -> tuple[threading.Thread, list[BaseException]]:
    failed: list[BaseException] = []

    def apply() -> None:
        try:
            with store.transaction() as tx:
                engine.apply(tx, plan)
            engine.committed()
        except BaseException as e:
            engine.rolled_back()
            failed.append(e)

    thread = threading.Thread(target=apply)
    thread.start()
    return thread, failed


def test_two_engines_claiming_the_last_slot_at_once_on_postgres(postgres_url: str) -> None:
    app = gated_app(Concurrency(limit=1, key=lambda i: i["k"]))
    k = uuid.uuid4().hex  # a key of its own: the database is the session's
    store = SqlStore(postgres_url)
    try:
        client = Client(store, app)
        a, b = (client.start("job", {"n": n, "k": k}, run_id=uuid.uuid4().hex) for n in (1, 2))
        by_run = {e.run_id: e for e in _take(store, app.name)}
        one, two = Engine(app, store), Engine(app, store)
        plan_a, plan_b = one.prepare(by_run[a]), two.prepare(by_run[b])
        with store.transaction() as tx:  # a's claim, not committed yet
            one.apply(tx, plan_a)
            thread, failed = _apply_in_thread(two, store, plan_b)
            eventually(lambda: _waiting_for_a_lock(store), 10, "b's claim to wait for the key")
        one.committed()
        thread.join(timeout=30)
        assert [type(e) for e in failed] == [ActivationConflict]
        assert store.key_slots(None, app.name, "job", k).held == {0: a}
    finally:
        store.close()


def test_a_run_queued_while_the_holder_ends_is_woken_on_postgres(postgres_url: str) -> None:
    """The queueing and the end of the slot's holder, in two transactions at once: the key's
    lock orders them, so the end sees the queued run and wakes it (no lost wake-up)."""
    app = gated_app(Concurrency(limit=1, key=lambda i: i["k"]))
    k = uuid.uuid4().hex  # a key of its own: the database is the session's
    store = SqlStore(postgres_url)
    try:
        client = Client(store, app)
        engine = Engine(app, store)
        a = client.start("job", {"n": 1, "k": k}, run_id=uuid.uuid4().hex)
        start_a = next(e for e in _take(store, app.name) if e.run_id == a)
        with store.transaction() as tx:
            engine.apply(tx, engine.prepare(start_a))
        engine.committed()
        b = client.start("job", {"n": 2, "k": k}, run_id=uuid.uuid4().hex)
        client.send_event(a, "go")
        by_kind = {e.type: e for e in _take(store, app.name) if e.run_id in (a, b)}
        other = Engine(app, store)
        plan_b = other.prepare(by_kind["start"])  # queue: a holds the slot
        plan_end = engine.prepare(by_kind["event"])  # a ends
        assert plan_b.slot is not None and plan_b.slot.kind == "queue"
        with store.transaction() as tx:  # b joins the queue, not committed yet
            other.apply(tx, plan_b)
            thread, failed = _apply_in_thread(engine, store, plan_end)
            eventually(lambda: _waiting_for_a_lock(store) or failed, 10, "a's end to wait")
            assert not failed, failed
        other.committed()
        thread.join(timeout=30)
        assert failed == [] and client.get(a).status == "completed"
        wakes = [e for e in _take(store, app.name) if e.type == "start" and e.run_id in (a, b)]
        assert [e.run_id for e in wakes] == [b], "the end woke the run queued meanwhile"
    finally:
        store.close()
