"""A short chaos soak (tests/chaos/soak.py): two engines and two workers on a private RabbitMQ
node and a private PostgreSQL server run 30 runs of the saga mix while random processes are
SIGKILLed and restarted, the node and the server are restarted once each, and a worker is
stopped past its lease. Nothing may be duplicated or lost. It is a soak, so `make test` leaves it
out (marker ``soak``): `make chaos` runs it, then the full one (300 runs)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).with_name("soak.py")
pytestmark = [pytest.mark.chaos, pytest.mark.soak]


def test_short_soak_loses_and_duplicates_nothing() -> None:
    command = [sys.executable, str(SOAK), "--runs", "30", "--max-seconds", "75", "--seed", "11"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the soak stops its processes and servers on SIGINT
        out, _ = proc.communicate(timeout=90)
        pytest.fail(f"the soak overran its time bound:\n{out}")
    print(out)
    summary = re.search(r"^SUMMARY (.*)$", out, re.MULTILINE)
    assert summary is not None, out
    numbers = {k: int(v) for k, v in (kv.split("=") for kv in summary.group(1).split())}
    assert proc.returncode == 0, out
    assert numbers["duplicates"] == 0, out
    assert numbers["lost"] == 0 and numbers["missing_effects"] == 0, out
    assert numbers["not_terminal"] == 0 and numbers["terminal"] == 30, out
    assert numbers["dead_letters"] == 0, out
    assert numbers["kills"] >= 3, out
    assert numbers["rabbit_restarts"] == 1 and numbers["postgres_restarts"] == 1, out
    assert numbers["pauses"] == 1, out
    assert "RESULT PASS" in out, out
