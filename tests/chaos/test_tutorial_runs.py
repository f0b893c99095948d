"""The tutorial's last section runs the saga it built: the Python blocks of its sections 1 to 4
saved as `refunds.py` in a fresh folder, and the commands of its section 6 run there as written,
against a real `sagaloop dev` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sagaloop.testing import eventually
from tests.tutorial import app_code, commands

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.chaos


def test_the_tutorial_app_runs_from_a_fresh_folder(tmp_path: Path) -> None:
    (tmp_path / "refunds.py").write_text(app_code())
    dev_command, start, *rest = commands()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env["PYTHONPATH"] = str(ROOT)

    def sagaloop(args: list[str]) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "sagaloop", *args[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            timeout=60,
        )
        assert out.returncode == 0, (args, out.stderr.decode())
        return out.stdout.decode()

    log = tmp_path / "dev.log"
    dev = subprocess.Popen(
        [sys.executable, "-m", "sagaloop", *dev_command[1:]],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    try:
        eventually(lambda: "dev: app" in log.read_text(), what="sagaloop dev to start")
        run_id = sagaloop(start).strip()
        assert run_id == "dispute-D-1001"

        def status() -> dict[str, object]:
            data: dict[str, object] = json.loads(sagaloop(["sagaloop", "status", run_id, "--json"]))
            return data

        eventually(lambda: status()["status"] == "waiting", what="the wait for the customer")
        assert "customer-reply" in sagaloop(["sagaloop", "status", run_id])
        for command in rest:
            if command[1] != "status":
                sagaloop(command)
        eventually(lambda: status()["status"] == "completed", what="the refund", timeout=60)
        output = status()["output"]
        assert isinstance(output, dict) and output["outcome"] == "refunded", output
        assert output["refund_id"] == "re_1"
    finally:
        dev.terminate()
        dev.wait(timeout=30)
