"""The hot path's writes on PostgreSQL, separate and fused, side by side in one process.

``python -m benchmarks.checkpoint_writes [--n 2000]``: on a fresh database, an engine's
transaction for a step's result (inbox row, the run's conditional update, two events, the
next step's message) written as separate statements (``inbox_put``, ``save_run``,
``append_events``, ``enqueue``, as before issue 27) and as one ``write_checkpoint``,
alternately, so that the machine's load weighs on both alike. Per transaction: the wall
time (p50) and the thread's CPU time (mean), which a busy machine moves much less.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from datetime import UTC, datetime

from benchmarks.common import fresh_database, load_average, percentile
from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Checkpoint, Outgoing, RunRecord, Written
from sagaloop.store.sql import SqlStore


def measure(n: int) -> dict[str, dict[str, float]]:
    with fresh_database() as url:
        store = SqlStore(url)
        store.upgrade()
        now = datetime.now(UTC)
        runs = {}
        with store.transaction() as tx:
            for way in ("separate", "fused"):
                runs[way] = RunRecord(f"bench-{way}", "app", "saga", "running", {"n": 1}, now, now)
                store.create_run(tx, runs[way])
        wall: dict[str, list[float]] = {"separate": [], "fused": []}
        cpu: dict[str, float] = {"separate": 0.0, "fused": 0.0}
        for i in range(n):
            for way in ("separate", "fused") if i % 2 else ("fused", "separate"):
                run = runs[way]
                saved = dataclasses.replace(run, last_seq=run.last_seq + 2, updated_at=now)
                events = [
                    NewEvent("step_completed", i, "noop", {"result": i}),
                    NewEvent("step_scheduled", i + 1, "noop", {"args": [i]}),
                ]
                env = Envelope(type="step", run_id=run.run_id, payload={"args": [i]})
                out = [Outgoing("bench.steps", env)]
                key = f"{way}-{i}"
                t0, c0 = time.perf_counter(), time.thread_time()
                with store.transaction() as tx:
                    if way == "fused":
                        cp = Checkpoint(now, ("engine", key, None), saved, run.last_seq, events)
                        cp.events_at, cp.messages = now, out
                        assert store.write_checkpoint(tx, cp) is Written.WRITTEN
                    else:
                        assert store.inbox_put(tx, "engine", key, None, now)
                        assert store.save_run(tx, saved, if_last_seq=run.last_seq)
                        store.append_events(tx, run.run_id, run.last_seq, events, now)
                        store.enqueue(tx, out, now)
                wall[way].append(time.perf_counter() - t0)
                cpu[way] += time.thread_time() - c0
                runs[way] = saved
        store.close()
    return {
        way: {
            "wall_p50_ms": percentile(wall[way], 50) * 1000,
            "cpu_mean_ms": cpu[way] / n * 1000,
        }
        for way in wall
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="transactions of each way")
    args = parser.parse_args()
    before = load_average()
    figures = measure(args.n)
    print(json.dumps({"load": [before, load_average()], **figures}, indent=1))
