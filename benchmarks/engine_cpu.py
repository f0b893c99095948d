"""The in-process engine's CPU beside its SQL (issue 27): what an idle engine reads and spends,
and the CPU of its threads per in-process step.

    python -m benchmarks.engine_cpu [--runs N]

The ``Service`` that ``sagaloop engine`` runs is assembled in this process on RabbitMQ +
PostgreSQL (``benchmarks.agent_loop.assembled``), so that its statements can be counted (by
thread) and its threads' CPU read from ``/proc`` apart from the main thread's (the client's):

- **idle**: statements per second and CPU per second over 10 s with no run in flight (the
  polling of the start gate, the timers, the schedules, the relay's sweep);
- **per step**: the service threads' CPU per step over ``N`` sequential runs of 10 in-process
  steps, then over ``2 N`` runs started at once.

On a shared machine, compare two checkouts by alternating them (A, B, A, B).
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time
from typing import Any

import sqlalchemy
from sqlalchemy import event

from benchmarks import agent_loop
from benchmarks.common import count_driver_reads

TICK = os.sysconf("SC_CLK_TCK")


def service_cpu() -> float:
    """Seconds of CPU of this process's threads but the main one."""
    main = threading.main_thread().native_id
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == main:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def measure(runs: int, idle_s: float = 10.0) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()

    def seen(*_: Any) -> None:
        counts[threading.current_thread().name] += 1

    with agent_loop.assembled("inprocess") as s:
        spec = {"steps": 10, "local": True}
        agent_loop._run(s.client, "stamps", {"steps": 3, "local": True})
        time.sleep(1.5)
        # Counted while idle only: with a listener on SQLAlchemy's statement events, the
        # checkpoint's statement goes through SQLAlchemy (store.core.driver_row), slower.
        event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", seen)
        undo_reads = count_driver_reads(seen)
        try:
            c0, t0 = service_cpu(), time.monotonic()
            time.sleep(idle_s)
            dt = time.monotonic() - t0
            idle = {
                "statements_per_s": round(sum(counts.values()) / dt, 1),
                "cpu_ms_per_s": round((service_cpu() - c0) / dt * 1000, 1),
                "by_thread": {k: round(v / dt, 1) for k, v in sorted(counts.items())},
            }
        finally:
            event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", seen)
            undo_reads()
        c0 = service_cpu()
        for _ in range(runs):
            agent_loop._run(s.client, "stamps", spec)
        sequential = (service_cpu() - c0) / (runs * 10) * 1000
        c0 = service_cpu()
        ids = [s.client.start("stamps", spec) for _ in range(2 * runs)]
        for run_id in ids:
            s.client.result(run_id, timeout=120)
        at_once = (service_cpu() - c0) / (len(ids) * 10) * 1000
    return {
        "idle": idle,
        "cpu_ms_per_step": {"sequential": round(sequential, 3), "at_once": round(at_once, 3)},
    }


if __name__ == "__main__":
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    print(json.dumps(measure(parser.parse_args().runs), indent=1))
