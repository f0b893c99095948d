"""`sagaloop health --live` against a real `sagaloop dev` process (the embedded SQLite default):
it passes while the database refuses health's own connection, where the readiness form fails,
and fails once the process is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sagaloop.testing import eventually

HERE = Path(__file__).parent
pytestmark = pytest.mark.integration


class Dev:
    def __init__(self, tmp: Path) -> None:
        self.run_dir = tmp / "run"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")} | {
            "SAGALOOP_DATABASE_URL": f"sqlite:///{tmp / 'sagaloop.db'}",
            "SAGALOOP_RUN_DIR": str(self.run_dir),
            "LEDGER_PATH": str(tmp / "ledger.db"),
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        }
        self.log = tmp / "dev.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sagaloop", "dev", "--app", "itapp"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def health(self, *args: str, **env: str) -> tuple[int, dict[str, Any]]:
        out = subprocess.run(
            [sys.executable, "-m", "sagaloop", "health", *args, "--json"],
            env=self.env | env,
            capture_output=True,
            timeout=60,
        )
        return out.returncode, json.loads(out.stdout or b"{}")

    def why(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[Dev]:
    d = Dev(tmp_path)
    yield d
    if d.proc.poll() is None:
        d.proc.kill()
    d.proc.wait()


def test_liveness_survives_a_refusing_database_and_not_a_killed_process(
    dev: Dev, tmp_path: Path
) -> None:
    pid = dev.proc.pid

    def live() -> dict[str, Any] | None:
        code, report = dev.health("--live")
        return report if code == 0 else None

    report = eventually(live, 30, "health --live to pass for the dev process")
    [p] = report["processes"]
    assert (p["pid"], p["role"], p["app"], p["problems"]) == (pid, "dev", "itapp", []), report
    assert eventually(lambda: dev.health()[0] == 0, 30, "readiness"), dev.why()

    refused = {"SAGALOOP_DATABASE_URL": f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}"}
    code, report = dev.health(**refused)
    assert code == 1 and str(report["database"]).startswith("error"), report
    code, report = dev.health("--live", **refused)
    assert code == 0 and [p["pid"] for p in report["processes"]] == [pid], report

    dev.proc.send_signal(signal.SIGKILL)
    dev.proc.wait()
    code, report = dev.health("--live")
    assert code == 1 and report["processes"] == [], report
    assert "no live service process" in report["reason"]
    assert not list(dev.run_dir.glob("*.json")), "the dead process's file is deleted"
