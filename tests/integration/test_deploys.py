"""The worked upgrade of docs/deploys.md, as processes: `sagaloop dev` runs version 1 of an app
(deploy_v1.py) on SQLite, runs wait mid-saga for an event, their histories are exported with
`sagaloop export`, version 1 stops, `sagaloop replay` passes them against version 2
(deploy_v2.py, the new step behind `ctx.patched`) and fails them, naming the divergence,
against a version 2 without it (deploy_v2_bad.py). Then version 2 runs, the events arrive, and
every run completes: the runs that passed the patch point with version 1 without the new step,
a run started with version 2 with it. A ledger written by the steps counts what ran."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from system import HERE, ROOT, eventually

from sagaloop.client import Client
from sagaloop.store.sql import SqlStore

pytestmark = pytest.mark.integration

OLD = ["old-1", "old-2", "old-3"]


class Deployment:
    """`sagaloop dev` processes, one version after the other, on one SQLite database."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ledger = tmp / "ledger.db"
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": f"sqlite:///{tmp / 'sagaloop.db'}",
            "LEDGER_PATH": str(self.ledger),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
        }
        self.env.pop("SAGALOOP_APP", None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / "dev.log"

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sagaloop", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def start(self, app: str) -> None:
        self.log = self.tmp / f"dev-{app}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", "dev", "--app", app, "--poll", "0.05"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
        )
        eventually(lambda: "dev: app" in self.log.read_text(errors="replace"), what=app)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def effects(self, order: str) -> list[str]:
        with sqlite3.connect(self.ledger, timeout=60) as conn:
            rows = conn.execute("select step from effects where order_id = ?", (order,))
            return [step for (step,) in rows]


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(tmp_path)
    try:
        yield d
    finally:
        d.stop()


def test_upgrade_with_runs_waiting_mid_saga(deployment: Deployment, tmp_path: Path) -> None:
    d = deployment
    d.start("deploy_v1")
    store = SqlStore(d.env["SAGALOOP_DATABASE_URL"])
    try:
        client = Client(store, "deploys")
        for run_id in OLD:
            client.start("order", run_id.upper(), run_id=run_id)

        def waiting() -> bool:
            return all(client.get(r).status == "waiting" for r in OLD)

        eventually(waiting, what="the runs of version 1 to wait for 'paid'")

        # production: export the histories of the runs in flight; stop version 1
        histories = tmp_path / "histories"
        exported = d.cli("export", "--all", "-o", str(histories))
        assert exported.returncode == 0, exported.stderr
        assert sorted(p.name for p in histories.iterdir()) == [f"{r}.json" for r in OLD]
        d.stop()

        # CI: the deploy gate, against the code about to be deployed
        gate = d.cli("replay", str(histories), "--app", "deploy_v2")
        assert gate.returncode == 0, gate.stdout + gate.stderr
        assert [line.split(": ", 1)[1] for line in gate.stdout.splitlines()] == [
            f"ok (run {r!r}, 4 events)" for r in OLD
        ]
        bad = d.cli("replay", str(histories), "--app", "deploy_v2_bad")
        assert bad.returncode == 1, bad.stdout + bad.stderr
        *lines, fix = bad.stdout.splitlines()
        assert len(lines) == len(OLD)
        assert fix.startswith("to fix: ") and "ctx.patched('change-id')" in fix, fix
        assert all(
            "diverged" in line
            and "the history has wait_for_event('paid') at position 1, the code now issues "
            "call('fraud_check') at position 1"
            in line
            for line in lines
        ), lines

        # deploy version 2 with the runs in flight; a new run starts with it
        d.start("deploy_v2")
        client.start("order", "NEW-1", run_id="new-1")
        for run_id in [*OLD, "new-1"]:
            client.send_event(run_id, "paid")  # kept until the new run waits for it
        for run_id in OLD:
            assert client.result(run_id, timeout=20) == [
                f"reserve {run_id.upper()}",
                f"ship {run_id.upper()}",
            ]
            assert d.effects(run_id.upper()) == ["reserve", "ship"], "no fraud check"
        assert client.result("new-1", timeout=20) == [
            "reserve NEW-1",
            "fraud_check NEW-1",
            "ship NEW-1",
        ]
        assert d.effects("NEW-1") == ["reserve", "fraud_check", "ship"]
        markers = [e.name for e in client.history("new-1") if e.kind == "marker"]
        assert markers == ["fraud-check"]
    finally:
        store.close()
