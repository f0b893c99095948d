"""A model provider's outage and a revoked key against a real `sagaloop dev` process and the
real `openai` client (issue 23): the OpenAI-compatible server of tests/unit/openai_server.py
answers 503 to the agent's second request for a few seconds, then 401. The outage is ridden
out with the booking kept; the 401 parks the run with nothing undone, and `sagaloop retry`
asks the same request again once the key is fixed. Counted outside the engine: the ledger the
tool and its compensation write, and the requests the server received."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sagaloop.client import Client
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually
from tests.chaos.provider_checks import ROOT, Provider

pytestmark = pytest.mark.chaos


class Dev:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.provider = Provider(tmp)
        self.ledger = tmp / "ledger.db"
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": f"sqlite:///{tmp / 'sagaloop.db'}",
            "MODEL_URL": self.provider.url,
            "LEDGER_PATH": str(self.ledger),
            "PYTHONPATH": str(ROOT),
        }
        self.log = tmp / "dev.log"
        self.dev = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", "dev", "--app", "tests.chaos.provider_app"],
            cwd=tmp,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
        )
        eventually(lambda: "ready" in self.log.read_text(errors="replace"), 60, "dev to start")
        self.store = SqlStore(self.env["SAGALOOP_DATABASE_URL"])
        self.client = Client(self.store)

    def lines(self) -> list[str]:
        if not self.ledger.exists():
            return []
        with sqlite3.connect(self.ledger, timeout=60) as conn:
            try:
                return [r[0] for r in conn.execute("select line from ledger")]
            except sqlite3.OperationalError:
                return []

    def sagaloop(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "sagaloop", *args],
            cwd=self.tmp,
            env=self.env,
            capture_output=True,
            timeout=120,
        )

    def status(self, run_id: str) -> str:
        run = self.store.get_run(run_id)
        return run.status if run is not None else "absent"

    def close(self) -> None:
        if self.dev.poll() is None:
            self.dev.kill()
            self.dev.wait()
        self.provider.close()
        self.store.close()

    def explain(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[Dev]:
    d = Dev(tmp_path)
    try:
        yield d
    finally:
        d.close()


def test_an_outage_is_ridden_out_and_a_revoked_key_parks_until_retry(dev: Dev) -> None:
    # an outage of the second request: 503s, then answers again
    dev.provider.fail(1, 503)
    outage = dev.sagaloop(
        "start", "trip", "--input", '"lisbon"', "--app", "tests.chaos.provider_app"
    )
    assert outage.returncode == 0, outage.stderr
    first = outage.stdout.decode().strip()
    eventually(lambda: dev.provider.failed(1) >= 3, 90, "three failed requests")
    # the status says why while the step waits for its next attempt (not while one runs)
    eventually(
        lambda: (
            "failing: ModelProviderUnavailable: provider 503"
            in dev.sagaloop("status", first).stdout.decode()
        ),
        90,
        "the status to say why the step fails",
    )
    dev.provider.fail(1, None)
    eventually(
        lambda: dev.status(first) == "completed", 120, f"the run to complete\n{dev.explain()}"
    )
    assert dev.lines() == ["booked lisbon"], "the booking was kept"

    # a revoked key: the run parks, nothing undone; fixed, then retried
    dev.provider.fail(1, 401)
    started = dev.sagaloop(
        "start", "trip", "--input", '"porto"', "--app", "tests.chaos.provider_app"
    )
    second = started.stdout.decode().strip()
    eventually(
        lambda: dev.status(second) == "needs_attention", 90, f"the run to park\n{dev.explain()}"
    )
    both = ["booked lisbon", "booked lisbon"]  # the script books lisbon on every run
    assert dev.provider.failed(1) >= 4 and dev.lines() == both
    status = dev.sagaloop("status", second).stdout.decode()
    assert "needs a person" in status and "provider 401" in status, status
    dev.provider.fail(1, None)  # the key is fixed
    retried = dev.sagaloop("retry", second)
    assert retried.returncode == 0, retried.stderr
    eventually(lambda: dev.status(second) == "completed", 120, f"the retried run\n{dev.explain()}")
    assert dev.lines() == both, "nothing undone, nothing twice"
