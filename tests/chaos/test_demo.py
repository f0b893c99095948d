"""`sagaloop demo` (what `make demo` runs) end to end: real processes, a SIGKILL at the worst
moment, and its own invariant checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.chaos


def test_demo_runs_and_its_invariants_hold(tmp_path: Path) -> None:
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "sagaloop", "demo"],
        cwd=tmp_path,  # the demo finds the repository from the package, not the cwd
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "ok      dispute 1: exactly one refund at the provider" in text
    assert "ok      dispute 1: issue_refund was reconciled, not issued again" in text
    assert "ok      dispute 2: one refund and exactly one reversal of it" in text
    assert "FAILED" not in text
    assert text.count("refund    re_") == 2, "one refund per dispute in the provider's books"
    assert text.count("reversal  rv_") == 1
    assert "status    compensated" in text
    assert took < 60, f"the demo took {took:.1f} s"
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("sagaloop-demo-")]
    assert leftovers == [], "the demo must remove its temporary folder"
    assert not (tmp_path / "sagaloop.db").exists() and not (tmp_path / "provider.db").exists()
