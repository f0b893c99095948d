"""Run concurrency keys (issue 25) across processes: two ``sagaloop dev`` processes on one
PostgreSQL database (database broker) take the starts of 24 runs of 3 keys limited to 2 runs
at once per key; from the histories, no key ever had more than 2 runs between the start of
their code and their end, every run completed, and no slot or queue row is left.
And a singleton (limit 1, cancel_new) started 6 times at once runs once, the others cancelled."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from concurrency_app import LIMIT

from sagaloop import Client
from sagaloop.engine import history as h
from sagaloop.store import tables as t
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

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
