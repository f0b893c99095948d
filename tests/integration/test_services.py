"""The services as an operator runs them: health checks, graceful SIGTERM, and a run started
by the plain-pika script of docs/messages.md (no sagaloop code on the publishing side)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from system import ROOT, System, eventually

pytestmark = pytest.mark.integration
NEEDS_SERVICES = "# needs: rabbitmq and a running engine"


def health(system: System, **env: str) -> tuple[int, dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-m", "sagaloop", "health", "--json"],
        env={**system.env, **env},
        capture_output=True,
        timeout=60,
    )
    return out.returncode, json.loads(out.stdout or b"{}")


def test_health_reports_each_dependency(system: System) -> None:
    code, report = health(system)
    assert code == 0 and report["healthy"] is True, report
    assert report["database"] == "ok" and report["broker"] == "ok"
    code, report = health(system, SAGALOOP_BROKER_URL="amqp://guest:secret@127.0.0.1:1/")
    assert code == 1 and str(report["broker"]).startswith("error")
    assert "secret" not in json.dumps(report), "credentials must never be printed"
    bad_db = "postgresql://postgres:secret@127.0.0.1:1/nope"
    code, report = health(system, SAGALOOP_DATABASE_URL=bad_db)
    assert code == 1 and str(report["database"]).startswith("error")
    assert "secret" not in json.dumps(report)


def test_sigterm_finishes_the_step_in_hand(system: System) -> None:
    engine = system.engine()
    worker = system.worker(STEP_DELAY="1.5")
    run = system.client.start("sequence", ["a", "b"])
    eventually(lambda: system.ledger("select 1 from bodies where step = 'a'"), what="step a")
    worker.send_signal(signal.SIGTERM)
    engine.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0 and engine.wait(timeout=30) == 0
    system.engine()
    system.worker()
    assert system.wait_final([run]) == {run: "completed"}
    bodies = system.ledger("select step, count(*) from bodies group by step order by step")
    assert bodies == [("a", 1), ("b", 1)], "the step in hand finished once, nothing was lost"


def test_the_plain_pika_script_of_the_docs_starts_a_run(system: System) -> None:
    page = (ROOT / "docs" / "messages.md").read_text()
    scripts = [
        b
        for b in re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
        if b.startswith(NEEDS_SERVICES)
    ]
    assert len(scripts) == 1, "docs/messages.md must show one plain-pika script"
    assert "sagaloop" not in scripts[0].replace("SAGALOOP_NAMESPACE", "").replace(
        NEEDS_SERVICES, ""
    ).replace('"sagaloop"', ""), "the publisher must not use sagaloop code"
    system.engine()
    system.worker()
    system.wait_ready()
    env = {
        **os.environ,
        "AMQP_URL": system.broker_url,
        "SAGALOOP_NAMESPACE": system.namespace,
        "APP": "itapp",
        "SAGA": "loop",
        "INPUT": "3",
        "RUN_ID": "started-by-pika",
    }
    for _ in range(2):  # a duplicate start never starts a second run
        out = subprocess.run(
            [sys.executable, "-c", scripts[0]], env=env, capture_output=True, timeout=60
        )
        assert out.returncode == 0, out.stderr.decode()
        assert out.stdout.decode().strip() == "started-by-pika"
    assert system.wait_final(["started-by-pika"]) == {"started-by-pika": "completed"}
    assert system.client.get("started-by-pika").output == 3
    assert len(system.client.list()) == 1
    rows = system.ledger("select count(*) from effects")
    assert rows == [(3,)]
