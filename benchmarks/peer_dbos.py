"""The peer: DBOS Transact running the same workload on the same PostgreSQL (a fresh database
of its own), installed through the optional ``bench`` extra.

DBOS runs a workflow and its steps in the calling process and checkpoints each step's output
in PostgreSQL; there is no broker hop. The workflow below is the same shape as the sagaloop
``chain`` saga: ``steps`` trivial steps, one after the other. The workflow records the time
before each step and at its end (benchmark instrumentation only), so a step's latency is the
same span as elsewhere: from one decision to the next.

Run in a child process of its own (DBOS is a process-wide singleton); it prints JSON.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import ROOT, fresh_database, latency


def measure(
    *, sequential_steps: int, concurrency: Sequence[int], waves: dict[int, int]
) -> dict[str, Any]:
    """Run the peer in a child process; ``{"error": ...}`` if DBOS cannot be used here."""
    try:
        import dbos  # noqa: F401
    except ImportError as e:
        return {"error": f"DBOS is not installed ({e}): pip install -e '.[bench]'"}
    spec = {"steps": sequential_steps, "concurrency": list(concurrency), "waves": waves}
    with fresh_database() as url:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.peer_dbos", url, json.dumps(spec)],
            cwd=ROOT,
            capture_output=True,
            timeout=600,
            text=True,
        )
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-5:]
        return {"error": "DBOS failed to run: " + " | ".join(tail)}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _child(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    import dbos
    from dbos import DBOS, DBOSConfig

    config: DBOSConfig = {
        "name": "sagaloop-bench-peer",
        "system_database_url": url.replace("postgresql://", "postgresql+psycopg://", 1),
        "log_level": "WARNING",
    }
    DBOS(config=config)

    @DBOS.step()
    def noop(i: int) -> int:
        return i

    @DBOS.workflow()
    def chain(steps: int) -> list[float]:
        stamps = []
        total = 0
        for i in range(steps):
            stamps.append(time.time())
            total += noop(i)
        stamps.append(time.time())
        return stamps

    DBOS.launch()
    try:

        def waves(sagas: int, steps: int, n: int) -> dict[str, Any]:
            gaps: list[float] = []
            window, done = 0.0, 0
            cpu0 = time.process_time()
            for _ in range(n):
                handles = [DBOS.start_workflow(chain, steps) for _ in range(sagas)]
                results = [h.get_result() for h in handles]
                window += max(r[-1] for r in results) - min(r[0] for r in results)
                gaps += [b - a for r in results for a, b in itertools.pairwise(r)]
                done += sagas * steps
            cpu = (time.process_time() - cpu0) / done * 1000
            return {
                **latency(gaps),
                "steps": done,
                "steps_per_s": done / window,
                "cpu_ms_per_step": cpu,
            }

        waves(2, 3, 1)  # warm-up
        out: dict[str, Any] = {"version": getattr(dbos, "__version__", _version())}
        out["sequential"] = waves(1, spec["steps"], 1)
        for c in spec["concurrency"]:
            out[f"concurrent_{c}"] = waves(c, 10, spec["waves"][str(c)])
        return out
    finally:
        DBOS.destroy()


def _version() -> str:
    from importlib.metadata import version

    return version("dbos")


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], json.loads(sys.argv[2]))))
