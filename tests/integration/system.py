"""Real sagaloop processes on PostgreSQL and RabbitMQ for the integration tests: a fresh
database and RabbitMQ namespace per system, engine and worker processes that a test can kill
and restart, and a client and ledger to check the outcome from outside."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pika

from sagaloop.client import Client
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually, services

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FINAL = {"completed", "failed", "compensated", "cancelled"}


class System:
    def __init__(
        self, tmp: Path, broker_url: str, *, lease: float = 3.0, app: str = "itapp"
    ) -> None:
        self.app = app
        self.tmp = tmp
        self.database_url, self._drop = services.fresh_database(services.postgres_url())
        self.broker_url = broker_url
        self.namespace = f"it-{uuid.uuid4().hex[:8]}"
        self.ledger_path = tmp / "ledger.db"
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": self.database_url,
            "SAGALOOP_BROKER_URL": broker_url,
            "SAGALOOP_NAMESPACE": self.namespace,
            "SAGALOOP_LEASE": str(lease),
            "LEDGER_PATH": str(self.ledger_path),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Path] = []
        self.sagaloop("db", "upgrade")
        self.store = SqlStore(self.database_url)
        self.client = Client(self.store, app)

    # --- processes ---------------------------------------------------------------------------

    def sagaloop(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "sagaloop", *args],
            env=self.env,
            capture_output=True,
            timeout=120,
        )
        if out.returncode != 0:
            raise AssertionError(f"sagaloop {' '.join(args)} failed: {out.stderr.decode()}")
        return out.stdout.decode().strip()

    def _spawn(self, role: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{role}-{len(self._logs)}.log"
        self._logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", *args, "--app", self.app],
            env={**self.env, **env},
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        self.procs.append(proc)
        return proc

    def engine(self, **env: str) -> subprocess.Popen[bytes]:
        return self._spawn("engine", ["engine", "--poll", "0.05"], env)

    def worker(self, queues: str = "work,other", **env: str) -> subprocess.Popen[bytes]:
        return self._spawn(
            "worker", ["worker", "--queue", queues, "--concurrency", "4", "--poll", "0.05"], env
        )

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    @staticmethod
    def wait_killed_by_crash_point(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
        assert proc.wait(timeout=timeout) == -signal.SIGKILL, "the crash point was not reached"

    def wait_ready(self, role: str = "engine", count: int = 1) -> None:
        """Until ``count`` ``role`` processes logged that they run: their queues are declared
        *and bound* then (a queue can exist before its binding, and a message published in
        between is dropped)."""

        def ready() -> bool:
            line = f"{role}: app"
            return sum(line in p.read_text(errors="replace") for p in self._logs) >= count

        eventually(ready, what=f"{count} {role} process(es) to start")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self._logs
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.store.close()
        self._delete_namespace()
        self._drop()

    def _delete_namespace(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        except Exception:
            return
        try:
            ch = conn.channel()
            for q in self.queue_names():
                ch.queue_delete(q)
            ch.queue_delete(f"{self.namespace}.dead")
            ch.exchange_delete(self.namespace)
            ch.exchange_delete(f"{self.namespace}.dlx")
            ch.exchange_delete(f"{self.namespace}.internal")
        finally:
            conn.close()

    def queue_names(self) -> list[str]:
        from sagaloop.cli.settings import load_app

        app = load_app(self.app)
        names = ["engine", "starts", *[f"steps.{q}" for q in app.queues]]
        return [f"{self.namespace}.{app.name}.{q}" for q in names]

    # --- outcome -----------------------------------------------------------------------------

    def wait_final(self, run_ids: list[str], timeout: float = 90.0) -> dict[str, str]:
        def done() -> dict[str, str] | None:
            runs = {r: self.store.get_run(r) for r in run_ids}  # None: not started yet
            statuses = {r: run.status if run else "absent" for r, run in runs.items()}
            return statuses if set(statuses.values()) <= FINAL else None

        try:
            result: dict[str, str] = eventually(done, timeout, f"{len(run_ids)} runs to finish")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self._unfinished(run_ids)}\n{self.logs()}") from None
        return result

    def _unfinished(self, run_ids: list[str]) -> str:
        """What a run that did not finish holds: its row, its last events, the outbox."""
        lines = []
        for run_id in run_ids:
            run = self.store.get_run(run_id)
            if run is None or run.status in FINAL:
                continue
            lines.append(f"--- run {run_id}: {run.status} seq {run.processed_seq}/{run.last_seq}")
            for ev in self.store.load_history(None, run_id)[-12:]:
                lines.append(f"  {ev.seq} {ev.kind} pos={ev.pos} {ev.name or ''} {ev.data}"[:300])
        lines.append(f"--- outbox depths {self.store.queue_depths()}")
        if self.broker_url != "database":
            depths = {q: services.queue_depth(self.broker_url, q) for q in self.queue_names()}
            lines.append(f"--- RabbitMQ ready messages {depths}, dead {self.dead_letter_count()}")
        return "\n".join(lines)

    def ledger(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        if not self.ledger_path.exists():
            return []
        with sqlite3.connect(self.ledger_path, timeout=60) as conn:
            try:
                return list(conn.execute(sql, args))
            except sqlite3.OperationalError:
                return []

    def dead_letter_count(self) -> int:
        return services.queue_depth(self.broker_url, f"{self.namespace}.dead")

    def assert_histories_sound(self, run_ids: list[str]) -> None:
        for run_id in run_ids:
            events = self.client.history(run_id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1)), run_id
            commands = [e.pos for e in events if e.kind == "step_scheduled"]
            assert len(commands) == len(set(commands)), f"{run_id}: a position recorded twice"
