"""Outages of the database and of the broker under real `sagaloop engine` and `sagaloop worker`
processes: they wait for what is missing, say so in their logs, resume on their own, and every
run completes with each effect applied exactly once (counted by a ledger outside the engine) and
nothing dead-lettered.

The servers that go down are private instances (their own port and data directory, see
tests/integration/private_postgres.py and private_rabbit.py): the shared PostgreSQL on 5432 and
RabbitMQ on 5672 are only used, never stopped, and each test has its own RabbitMQ namespace.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
import sqlalchemy as sa

from sagaloop.client import Client
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually
from sagaloop.testing.services import on_server, queue_depth

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
ROOT = INTEGRATION.parents[1]
if str(INTEGRATION) not in sys.path:
    sys.path.insert(0, str(INTEGRATION))

from private_postgres import PrivatePostgres  # noqa: E402
from private_rabbit import PrivateRabbit, private_rabbit  # noqa: E402, F401  (a fixture)

pytestmark = pytest.mark.chaos

FINAL = {"completed", "failed", "compensated", "cancelled", "needs_attention"}
OUTAGE = 30.0  # seconds each server stays down
APP_QUEUES = ["engine", "starts", "steps.work", "steps.other"]
EFFECTS = "select key, step from effects"  # one row per idempotency key: run/position/do


class Services:
    """`sagaloop engine` and `sagaloop worker` processes of tests/integration/itapp.py (whose
    step bodies record every execution, and every effect once per idempotency key, in a SQLite
    ledger outside the engine), on the given database and broker."""

    def __init__(self, tmp: Path, database_url: str, broker_url: str, **env: str) -> None:
        self.tmp = tmp
        self.database_url = database_url
        self.broker_url = broker_url
        self.namespace = f"outage-{uuid.uuid4().hex[:8]}"
        self.ledger_path = tmp / "ledger.db"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")},
            "SAGALOOP_DATABASE_URL": database_url,
            "SAGALOOP_BROKER_URL": broker_url,
            "SAGALOOP_NAMESPACE": self.namespace,
            "SAGALOOP_LEASE": "3",
            "LEDGER_PATH": str(self.ledger_path),
            "PYTHONPATH": os.pathsep.join([str(INTEGRATION), str(ROOT)]),
            **env,
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._store: SqlStore | None = None

    # --- processes ---------------------------------------------------------------------------

    def sagaloop(self, *args: str, **env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "sagaloop", *args],
            env={**self.env, **env},
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, f"sagaloop {' '.join(args)} failed: {done.stderr.decode()}"
        return done.stdout.decode().strip()

    def start(self) -> None:
        """An engine and a worker (four step threads) for every queue of the app."""
        common = ["--app", "itapp", "--poll", "0.05"]
        self._spawn("engine", ["engine", *common])
        self._spawn("worker", ["worker", "--queue", "work,other", "--concurrency", "4", *common])

    def _spawn(self, role: str, args: list[str]) -> None:
        with (self.tmp / f"{role}.log").open("wb") as log:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-m", "sagaloop", *args],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    def log(self, role: str) -> str:
        path = self.tmp / f"{role}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {role}\n{self.log(role)[-6000:]}" for role in self.procs)

    def assert_running(self) -> None:
        for role, proc in self.procs.items():
            assert proc.poll() is None, f"{role} exited ({proc.returncode}):\n{self.logs()}"

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._store is not None:
            self._store.close()

    # --- outcome -----------------------------------------------------------------------------

    @property
    def store(self) -> SqlStore:
        if self._store is None:
            self._store = SqlStore(self.database_url)
        return self._store

    @property
    def client(self) -> Client:
        return Client(self.store, "itapp")

    def wait_final(self, run_ids: list[str], timeout: float) -> dict[str, str]:
        def statuses() -> dict[str, str] | None:
            found = {r: self.store.get_run(r) for r in run_ids}
            now = {r: run.status if run else "absent" for r, run in found.items()}
            return now if set(now.values()) <= FINAL else None

        try:
            result: dict[str, str] = eventually(statuses, timeout, "every run to finish")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None
        return result

    def ledger(self, sql: str) -> list[tuple[Any, ...]]:
        if not self.ledger_path.exists():
            return []
        with sqlite3.connect(self.ledger_path, timeout=60) as conn:
            try:
                return list(conn.execute(sql))
            except sqlite3.OperationalError:
                return []  # no table yet

    def assert_exactly_once(self, runs: dict[str, int]) -> None:
        """Run ``r`` of the `loop` saga with input ``n`` applied effects it0..it{n-1} once each
        (the ledger keeps one row per idempotency key, so a missing or extra key is a lost or
        duplicated effect), and nothing was compensated."""
        applied = sorted((key.split("/")[0], step) for key, step in self.ledger(EFFECTS))
        expected = sorted((r, f"it{i}") for r, n in runs.items() for i in range(n))
        assert applied == expected, "an effect was lost or applied twice"
        assert self.ledger("select count(*) from undos") in ([(0,)], [])
        for run_id, n in runs.items():
            assert self.client.get(run_id).output == n
            events = self.client.history(run_id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1)), run_id
            done = [e.pos for e in events if e.kind == "step_completed"]
            assert len(done) == len(set(done)) == n, f"{run_id}: a step completed twice"

    # --- RabbitMQ ----------------------------------------------------------------------------

    def rabbit_queues(self) -> list[str]:
        return [f"{self.namespace}.itapp.{q}" for q in APP_QUEUES]

    def rabbit_dead_letters(self) -> int:
        return queue_depth(self.broker_url, f"{self.namespace}.dead")

    def delete_namespace(self) -> None:
        with contextlib.suppress(pika.exceptions.AMQPError):
            conn = pika.BlockingConnection(pika.URLParameters(self.broker_url))
            try:
                ch = conn.channel()
                for q in [*self.rabbit_queues(), f"{self.namespace}.dead"]:
                    ch.queue_delete(q)
                ch.exchange_delete(self.namespace)
                ch.exchange_delete(f"{self.namespace}.dlx")
            finally:
                conn.close()


def start_loops(services: Services, count: int, n: int) -> dict[str, int]:
    """``count`` runs of the `loop` saga, each calling the step ``effect`` ``n`` times."""
    runs = {f"loop-{i}-{uuid.uuid4().hex[:6]}": n for i in range(count)}
    for run_id, steps in runs.items():
        services.client.start("loop", steps, run_id=run_id)
    return runs


def bodies(services: Services) -> int:
    rows = services.ledger("select count(*) from bodies")
    return int(rows[0][0]) if rows else 0


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def create_database(admin_url: str, name: str) -> str:
    with on_server(admin_url) as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    return sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()  # initialised, not started
    try:
        yield pg
    finally:
        pg.close()  # stops it if running and deletes its files


@pytest.fixture
def services_factory(tmp_path: Path) -> Iterator[Callable[..., Services]]:
    made: list[Services] = []

    def make(database_url: str, broker_url: str, **env: str) -> Services:
        s = Services(tmp_path, database_url, broker_url, **env)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.stop()
            s.delete_namespace()


# --- PostgreSQL --------------------------------------------------------------------------------


def test_services_wait_for_a_database_that_is_not_there_yet(
    private_postgres: PrivatePostgres,
    rabbitmq_url: str,
    services_factory: Callable[..., Services],
) -> None:
    """Started while their database server is down, the engine and the worker keep running
    and retry with a growing delay; once the server is up they serve runs.

    The database is made and migrated before, then its server stopped: a service that reaches
    a server without its database stops at once (exit 78, a configuration error), and one
    that finds an outdated schema refuses it (`db upgrade` runs before a deploy's services),
    so neither may be seen here while the server comes up."""
    pg = private_postgres
    url = sa.make_url(pg.url).set(database="app").render_as_string(hide_password=False)
    s = services_factory(url, rabbitmq_url)
    pg.start()
    create_database(pg.url, "app")
    s.sagaloop("db", "upgrade")
    pg.stop()
    s.start()
    for role in ("engine", "worker"):  # the delay doubles: 0.5 s, 1.0 s, 2.0 s, ...
        eventually(lambda role=role: "retrying in 2.0 s" in s.log(role), 30, f"{role} to retry")
    s.assert_running()
    for role in ("engine", "worker"):
        log = s.log(role)
        assert count(r"database postgresql://postgres@127\.0\.0\.1:\d+/app unavailable", log) >= 3
        delays = [float(x) for x in re.findall(r"retrying in ([0-9.]+) s", log)]
        assert delays[:3] == [0.5, 1.0, 2.0] and delays == sorted(delays), log

    pg.start()
    runs = start_loops(s, 2, 3)
    assert s.wait_final(list(runs), timeout=60) == dict.fromkeys(runs, "completed")
    s.assert_running()
    s.assert_exactly_once(runs)
    assert s.store.dead_letters() == [] and s.rabbit_dead_letters() == 0


@pytest.mark.long  # make chaos: the suite's time budget
def test_a_database_outage_while_runs_are_in_flight(
    private_postgres: PrivatePostgres,
    rabbitmq_url: str,
    services_factory: Callable[..., Services],
) -> None:
    """PostgreSQL stops for 30 s while steps run: the services log the outage, ride it out and
    resume; every run completes, each effect once, nothing dead-lettered."""
    pg = private_postgres
    pg.start()
    s = services_factory(pg.url, rabbitmq_url, STEP_DELAY="0.2")
    s.sagaloop("db", "upgrade")
    s.start()
    runs = start_loops(s, 8, 8)  # 64 steps of 0.2 s on 4 threads: about 4 s of work
    eventually(lambda: bodies(s) >= 8, 60, "the first steps to run")
    pg.stop("fast")  # sessions are ended: the services see an admin shutdown
    down_at = time.monotonic()
    assert bodies(s) < 64, "the runs finished before the outage: make them longer"
    eventually(
        lambda: all("unreachable" in s.log(r) for r in ("engine", "worker")),
        OUTAGE,
        "both services to log that the database is unreachable",
    )
    time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))
    s.assert_running()
    logged_during_outage = {role: s.log(role) for role in ("engine", "worker")}
    pg.start()

    assert s.wait_final(list(runs), timeout=90) == dict.fromkeys(runs, "completed")
    s.assert_running()
    s.assert_exactly_once(runs)
    assert s.store.dead_letters() == [] and s.rabbit_dead_letters() == 0
    for role, log in logged_during_outage.items():  # warnings that say what is wrong
        assert "retry it: the database is unreachable" in log, log
        assert "Traceback" not in log, f"{role} logged a traceback for a known outage:\n{log}"


# --- RabbitMQ ----------------------------------------------------------------------------------


@pytest.mark.long  # make chaos: the suite's time budget
def test_a_broker_outage_while_runs_are_in_flight(
    private_postgres: PrivatePostgres,
    private_rabbit: PrivateRabbit,  # noqa: F811
    services_factory: Callable[..., Services],
) -> None:
    """The RabbitMQ node stops for 30 s while steps run: the services log the lost connection,
    reconnect by themselves, and the outbox holds what could not be published; every run
    completes, each effect once, the dead-letter queue stays empty."""
    pg = private_postgres
    pg.start()
    s = services_factory(pg.url, private_rabbit.url, STEP_DELAY="0.2")
    s.sagaloop("db", "upgrade")
    s.start()
    runs = start_loops(s, 8, 8)
    eventually(lambda: bodies(s) >= 8, 60, "the first steps to run")
    private_rabbit.stop()
    down_at = time.monotonic()
    assert bodies(s) < 64, "the runs finished before the outage: make them longer"
    eventually(
        lambda: all("lost the connection to RabbitMQ" in s.log(r) for r in ("engine", "worker")),
        OUTAGE,
        "both services to log the lost connection",
    )
    more = start_loops(s, 2, 2)  # started during the outage: kept in the outbox meanwhile
    time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))
    s.assert_running()
    assert s.store.oldest_outbox_message() is not None, "nothing waited in the outbox"
    private_rabbit.start()

    runs.update(more)
    assert s.wait_final(list(runs), timeout=90) == dict.fromkeys(runs, "completed")
    s.assert_running()
    for role in ("engine", "worker"):
        assert "reconnected to RabbitMQ" in s.log(role), s.logs()
    assert "relay: broker unavailable" in s.log("engine")
    for role in ("engine", "worker"):
        assert "Traceback" not in s.log(role), s.log(role)
    s.assert_exactly_once(runs)
    assert s.store.dead_letters() == [] and s.rabbit_dead_letters() == 0
