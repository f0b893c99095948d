"""Where the time goes: py-spy samples the engine and the worker process while they run a
sequential saga on RabbitMQ + PostgreSQL, and the samples are summed by function and by area.

Two views per process: *CPU* (samples of threads that were running, py-spy's default) says what
the process computes; *wall* (``--idle``: every thread's stack, running or waiting) on the
thread that carries the step says what the step waits for.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.sagaloop_bench import system, warm_up

AREAS = (
    ("psycopg", "psycopg (driver, network waits)"),
    ("sqlalchemy", "SQLAlchemy (compile, execute, pool)"),
    ("pydantic", "pydantic (envelopes)"),
    ("pika", "pika (AMQP I/O thread)"),
    ("sagaloop/engine/replay", "sagaloop replay (saga code)"),
    ("sagaloop/engine/loop", "sagaloop replay (saga code)"),
    ("sagaloop/brokers", "sagaloop broker adapter"),
    ("sagaloop/store", "sagaloop store"),
    ("sagaloop/outbox", "sagaloop relay"),
    ("sagaloop/engine", "sagaloop engine/worker"),
    ("json", "json"),
    ("threading", "thread waits"),
    ("concurrent/futures", "step thread pool"),
)


HOTSPOTS = (
    ("relay thread: publish, sweep (Service._relay)", ("Service._relay", "Runtime._relay")),
    ("relay: publish on the committing thread (Relay._send_later)", ("Relay._send_later",)),
    ("  of which the sweep's claim transaction (SqlStore.claim)", ("SqlStore.claim",)),
    ("deleting published rows, in the sweep (queue.delete_claimed)", ("delete_claimed",)),
    ("engine activation (EngineConsumer.process_batch)", ("EngineConsumer.process_batch",)),
    ("  of which replaying saga code (Replayer.feed)", ("Replayer.feed",)),
    ("worker message (WorkerConsumer.process)", ("WorkerConsumer.process",)),
    ("  of which the step itself (StepRunner.run)", ("StepRunner.run",)),
    ("  lease renewals (_KeepAlive)", ("_KeepAlive",)),
    (
        "building SQL statements (sqlalchemy/sql: operators, coercions, cache keys)",
        (
            "sqlalchemy/sql/operators.py",
            "sqlalchemy/sql/coercions.py",
            "sqlalchemy/sql/cache_key.py",
            "sqlalchemy/sql/_selectable_constructors.py",
            "sqlalchemy/sql/_dml_constructors.py",
            "sqlalchemy/sql/dml.py",
        ),
    ),
    ("pool checkout (_ConnectionFairy._checkout)", ("_ConnectionFairy._checkout",)),
    ("JSON envelopes (pydantic)", ("pydantic/",)),
    ("AMQP I/O thread (pika IOLoop)", ("IOLoop.start",)),
    ("timer polling (TimerScheduler.fire_due)", ("TimerScheduler.fire_due",)),
)


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


def _area(frame: str) -> str:
    for needle, name in AREAS:
        if needle in frame:
            return name
    return "other"


def summarize(raw: Path, *, thread: str | None = None, top: int = 40) -> dict[str, Any]:
    """Sum collapsed stacks: self time by function, inclusive time by function, self by area."""
    hot: collections.Counter[str] = collections.Counter()
    selfs: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    areas: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if thread is not None and not any(thread in f for f in frames[:1]):
            continue
        n = int(count)
        total += n
        leaf = frames[-1]
        selfs[_short(leaf)] += n
        areas[_area(_innermost_known(frames))] += n
        for f in set(frames):
            incl[_short(f)] += n
        for label, needles in HOTSPOTS:
            if any(needle in f for f in frames for needle in needles):
                hot[label] += n
    share = (lambda c: [(k, v / total) for k, v in c.most_common(top)]) if total else list
    return {
        "samples": total,
        "self": share(selfs),
        "inclusive": share(incl),
        "areas": share(areas),
        "hotspots": [(label, hot[label] / total if total else 0.0) for label, _ in HOTSPOTS],
    }


def _innermost_known(frames: list[str]) -> str:
    """The innermost frame that is not the standard library's generic plumbing."""
    for f in reversed(frames):
        if "sagaloop" in f or any(n in f for n, _ in AREAS[:4]):
            return f
    return frames[-1]


def _short(frame: str) -> str:
    # "function (path/to/module.py:123)" -> "function (module.py)"
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    tail = "/".join(parts[-2:]) if parts else path
    return f"{name} ({tail})"


def profile_sequential(steps: int, out_dir: Path, rate: int = 400) -> dict[str, Any]:
    """Profile a sequential run of ``steps`` steps; return the summaries per process.

    py-spy's ``--gil`` view samples only the thread holding the GIL: the Python work of the
    process, where a GIL-bound process spends its one core. (Time waiting on the database or
    RabbitMQ releases the GIL and is not counted: see the critical-path segments for that.)"""
    spy = py_spy()
    if spy is None:
        return {"error": "py-spy is not installed (pip install -e '.[bench]')"}
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    with system("rabbitmq") as s:
        engine, worker = s.engine(), s.worker()
        warm_up(s)
        recorders = {}
        for role, proc in (("engine", engine), ("worker", worker)):
            raw = out_dir / f"{role}-gil.txt"
            args = ["record", "--pid", str(proc.pid), "--rate", str(rate), "--format", "raw"]
            recorders[role] = (
                raw,
                subprocess.Popen(
                    [spy, *args, "--output", str(raw), "--gil", "--nonblocking"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
            )
        time.sleep(1.0)  # let py-spy attach
        started = time.monotonic()
        (run_id,) = s.start("chain", [steps])
        s.wait_finished([run_id], timeout=60 + steps)
        result["seconds"] = time.monotonic() - started
        result["steps"] = steps
        for role, (raw, rec) in recorders.items():
            rec.send_signal(signal.SIGINT)  # py-spy writes its output and exits
            try:
                rec.wait(30)
            except subprocess.TimeoutExpired:
                rec.kill()
            if raw.exists():
                summary = summarize(raw)
                summary["ms_per_step"] = summary["samples"] / rate / steps * 1000
                result[role] = summary
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(profile_sequential(300, Path("/tmp/sagaloop-profile")), indent=1))
