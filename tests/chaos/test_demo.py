"""`sagaloop demo` (what `make demo` runs) end to end: real processes, a SIGKILL at the worst
moment, a refund approved through the approvals commands, the agents' budgets, and the demo's
own invariant checks."""

from __future__ import annotations

import os
import re
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
    assert text.count("refund    re_") == 3, "one refund per dispute in the provider's books"
    assert text.count("reversal  rv_") == 1
    assert "status    compensated" in text
    # dispute 3: one approval, asked and answered as a person would, then one refund
    assert "ok      dispute 3: one approval asked, and approved once, by maria" in text
    assert "ok      dispute 3: no refund before the approval, exactly one after it" in text
    assert "$ sagaloop approvals" in text
    [listed] = re.findall(r"dispute-D-1003 +(\d+) +issue_large_refund .* pending", text)
    assert text.count(f"$ sagaloop approve dispute-D-1003 {listed} --by ") == 1
    assert re.search(r"refund    re_\w+ +489\.00  reference dispute-D-1003/", text)
    # the budget: each run's model requests against Budget(requests=20), checked by the demo
    used = re.findall(r"dispute-D-100([123])  model requests (\d+) of 20", text)
    assert [d for d, _ in used] == ["1", "2", "3"] and all(0 < int(n) <= 20 for _, n in used)
    assert text.count("model requests, as the history records them, within the budget of 20") == 3
    assert took < 60, f"the demo took {took:.1f} s"
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("sagaloop-demo-")]
    assert leftovers == [], "the demo must remove its temporary folder"
    assert not (tmp_path / "sagaloop.db").exists() and not (tmp_path / "provider.db").exists()
