"""Scale-out (row 10 of ``make bench``): the same wave of runs against 1, 2 and 4
``sagaloop worker`` processes with one ``sagaloop engine``, then against 2 engines with 2
workers, on RabbitMQ + PostgreSQL (and the first configuration again at the end, to show how
much the machine's load moved meanwhile). Per configuration: steps/s over the waves (from the
history, as ``sagaloop_bench.run_waves`` measures them), the CPU time per step of the engine
processes and of the worker processes (``/proc/PID/stat``), how busy the machine was
(``/proc/stat``), and the database round trips per step of each kind of process.

The round trips are counted inside each process, as ``benchmarks/roundtrips.py`` counts them
in one: this module is also the app module the processes load (``--app
benchmarks.scale:app``, the benchmark app), and when ``$SAGALOOP_BENCH_TRIPS`` names a folder,
SQLAlchemy's events count the process's statements, transactions (a ``BEGIN`` and a
``COMMIT`` or ``ROLLBACK`` each; an autocommit read sends neither) and pings by thread role,
and a thread writes them to ``{folder}/{pid}.json`` every 0.1 s. Counting costs each process
a few microseconds per statement, the same in every configuration.

    python -m benchmarks.scale [--quick]
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.benchapp import app

__all__ = ["app", "figures", "measure"]

TRIPS_ENV = "SAGALOOP_BENCH_TRIPS"
CONFIGS = ((1, 1), (1, 2), (1, 4), (2, 2))
"""(engine processes, worker processes)."""
THREADS = 2
"""``--concurrency`` of each worker process, as in the main benchmark."""
ROLES = ("engine", "worker", "relay", "timers", "step")
FLAT = 1.1
"""Round trips per step "do not grow": within 10 % of the one-worker configuration's."""


# --- inside the measured processes -----------------------------------------------------------


def _role() -> str:
    name = threading.current_thread().name
    return next((role for role in ROLES if name.startswith(role)), "other")


def _count_round_trips(folder: Path) -> None:
    """Count this process's round trips by thread role; write them to ``folder`` often."""
    import collections

    from sqlalchemy import event
    from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
    from sqlalchemy.engine import Engine

    from benchmarks.common import count_driver_reads

    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def hit(kind: str) -> None:
        key = f"{_role()}.{kind}"
        with lock:
            counts[key] += 1

    def statement(*_: Any, **__: Any) -> None:
        hit("statements")

    def transaction(kind: str) -> Any:
        def listener(conn: Any, *_: Any) -> None:
            # An autocommit read sends no BEGIN and no ROLLBACK: its statement is its trip.
            if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
                hit(kind)

        return listener

    event.listen(Engine, "before_cursor_execute", statement)
    count_driver_reads(lambda: hit("statements"))  # for the process's life
    for kind in ("begin", "commit", "rollback"):
        event.listen(Engine, kind, transaction(kind))
    ping = PGDialect_psycopg.do_ping

    def counted_ping(self: Any, dbapi_conn: Any) -> bool:
        hit("ping")
        return bool(ping(self, dbapi_conn))

    PGDialect_psycopg.do_ping = counted_ping  # type: ignore[method-assign]
    path, tmp = folder / f"{os.getpid()}.json", folder / f".{os.getpid()}.json"

    def write() -> None:
        while True:
            time.sleep(0.1)
            with lock:
                snapshot = dict(counts)
            tmp.write_text(json.dumps(snapshot))
            os.replace(tmp, path)

    threading.Thread(target=write, name="bench-trips", daemon=True).start()


if os.environ.get(TRIPS_ENV):
    _count_round_trips(Path(os.environ[TRIPS_ENV]))


# --- the benchmark -----------------------------------------------------------------------------


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the machine so far (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _trips(folder: Path, pids: list[int]) -> dict[int, dict[str, int]]:
    out = {}
    for pid in pids:
        path = folder / f"{pid}.json"
        out[pid] = json.loads(path.read_text()) if path.exists() else {}
    return out


def _per_role(
    before: dict[int, dict[str, int]], after: dict[int, dict[str, int]], roles: dict[int, str]
) -> dict[str, dict[str, float]]:
    """Round trips between two snapshots, summed per kind of process, then per thread role and
    kind of trip (``{"worker": {"relay.statements": 12, ...}}``)."""
    out: dict[str, dict[str, float]] = {"engine": {}, "worker": {}}
    for pid, role in roles.items():
        for key, n in after.get(pid, {}).items():
            delta = n - before.get(pid, {}).get(key, 0)
            out[role][key] = out[role].get(key, 0) + delta
    return out


def _total(counts: dict[str, float]) -> float:
    return sum(counts.values())


def _measure_config(
    s: Any, engines: int, workers: int, sagas: int, steps: int, waves: int, folder: Path
) -> dict[str, Any]:
    from benchmarks.common import cpu_seconds, wait_until
    from benchmarks.sagaloop_bench import run_waves, warm_up

    procs = [("engine", s.spawn("engine")) for _ in range(engines)]
    procs += [
        ("worker", s.spawn("worker", "--queue", "bench", "--concurrency", str(THREADS)))
        for _ in range(workers)
    ]
    logs = s.logs[-len(procs) :]
    roles = {p.pid: role for role, p in procs}
    pids = list(roles)
    try:
        wait_until(
            lambda: all(
                f"{role}: app" in log.read_text(errors="replace")
                for (role, _), log in zip(procs, logs, strict=True)
            ),
            60,
            f"{engines} engine(s) and {workers} worker(s) to start",
        )
        warm_up(s)
        run_waves(s, "chain", sagas // 2, 3, 1)  # every process has seen work
        time.sleep(0.5)
        idle0 = _trips(folder, pids)
        time.sleep(1.0)
        idle1 = _trips(folder, pids)
        cpu0 = {pid: cpu_seconds(pid) for pid in pids}
        busy0, total0 = _busy_jiffies()
        wall0 = time.monotonic()
        x = run_waves(s, "chain", sagas, steps, waves)
        wall = time.monotonic() - wall0
        busy1, total1 = _busy_jiffies()
        cpu = {pid: cpu_seconds(pid) - cpu0[pid] for pid in pids}
        time.sleep(0.3)  # the counters' writers catch up
        after = _trips(folder, pids)
    finally:
        for _, p in procs:
            s.stop(p)
    n = x["steps"]
    trips = _per_role(idle1, after, roles)
    idle = _per_role(idle0, idle1, roles)
    cores = os.cpu_count() or 1
    return {
        "engines": engines,
        "workers": workers,
        "threads_per_worker": THREADS,
        "steps": n,
        "steps_per_s": x["steps_per_s"],
        "p50_ms": x["p50_ms"],
        "p99_ms": x["p99_ms"],
        "cpu_ms_per_step": {
            role: sum(c for pid, c in cpu.items() if roles[pid] == role) / n * 1000
            for role in ("engine", "worker")
        },
        "machine_busy_cores": (busy1 - busy0) / (total1 - total0) * cores,
        "wall_s": wall,
        "trips_per_step": {
            role: {k: v / n for k, v in sorted(counts.items())} for role, counts in trips.items()
        },
        "idle_trips_per_s_per_process": {
            role: _total(counts) / list(roles.values()).count(role) for role, counts in idle.items()
        },
        "idle_trips_per_s": idle,  # over 1 s, summed over the processes of each kind
    }


def measure(sagas: int = 64, steps: int = 10, waves: int = 3) -> dict[str, Any]:
    """Each configuration of :data:`CONFIGS` on one fresh database and RabbitMQ namespace, its
    processes started for it and stopped after it."""
    import tempfile

    from benchmarks import sagaloop_bench

    out: dict[str, Any] = {"sagas": sagas, "steps": steps, "waves": waves}
    with sagaloop_bench.system("rabbitmq") as s:
        folder = Path(tempfile.mkdtemp(prefix="trips-", dir=s.tmp))
        s.env[TRIPS_ENV] = str(folder)
        _use_this_app(s)
        for engines, workers in CONFIGS:
            out[f"e{engines}w{workers}"] = _measure_config(
                s, engines, workers, sagas, steps, waves, folder
            )
        # the first configuration again: how much the machine's load moved meanwhile
        out["e1w1_end"] = _measure_config(s, 1, 1, sagas, steps, waves, folder)
    return out


def _use_this_app(s: Any) -> None:
    """Spawn the system's processes with this module as their app (benchapp's app, counted)."""
    import subprocess
    import sys

    def spawn(role: str, *args: str) -> subprocess.Popen[bytes]:
        log = s.tmp / f"{role}-{len(s.logs)}.log"
        s.logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", role, "--app", "benchmarks.scale:app", *args],
            env=s.env,
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        s.procs.append(proc)
        return proc

    s.spawn = spawn


# --- the table ---------------------------------------------------------------------------------


def split_trips(trips: dict[str, dict[str, float]]) -> tuple[float, float, float]:
    """Round trips per step: (the engine consumers', the worker consumers', the polling
    threads': relay sweeps, timers, process registry)."""
    engine = sum(v for k, v in trips.get("engine", {}).items() if k.startswith("engine."))
    worker = sum(v for k, v in trips.get("worker", {}).items() if k.startswith("worker."))
    everything = sum(_total(c) for c in trips.values())
    return engine, worker, everything - engine - worker


def figures(results: dict[str, Any] | None) -> list[Any]:
    """The rows of ``make bench``'s table: one per configuration."""
    from benchmarks.common import Figure, fmt_ms, fmt_ratio

    section = "10 scale"
    if not results:
        return [Figure(section, "engines and workers as processes", "not run")]
    if "error" in results:
        return [Figure(section, "engines and workers as processes", f"FAILED: {results['error']}")]
    base = results.get("e1w1")
    figs = []
    for engines, workers in CONFIGS:
        x = results.get(f"e{engines}w{workers}")
        if x is None:
            continue
        engine, worker, polling = split_trips(x["trips_per_step"])
        base_trips = sum(split_trips(base["trips_per_step"])[:2]) if base else engine + worker
        target, met = "", None
        if (engines, workers) != (1, 1):
            target = f"DB round trips per message <= {FLAT}x 1 worker's"
            met = engine + worker <= FLAT * base_trips
        cpu = x["cpu_ms_per_step"]
        again = results.get("e1w1_end") if (engines, workers) == (1, 1) else None
        drift = (
            f"; the same at the end of the section: {again['steps_per_s']:.0f} steps/s, CPU "
            f"{again['cpu_ms_per_step']['engine']:.1f} + {again['cpu_ms_per_step']['worker']:.1f}"
            " ms"
            if again
            else ""
        )
        figs.append(
            Figure(
                section,
                f"{engines} engine(s), {workers} worker(s) x {x['threads_per_worker']} threads, "
                f"{results['sagas']} sagas x {results['steps']} steps",
                f"{x['steps_per_s']:.0f} steps/s; p50 {fmt_ms(x['p50_ms'])}, "
                f"p99 {fmt_ms(x['p99_ms'])}",
                f"{fmt_ratio(x['steps_per_s'] / base['steps_per_s'])} 1 worker" if base else "",
                target,
                met,
                f"CPU per step: engine {cpu['engine']:.1f} ms + worker {cpu['worker']:.1f} ms; "
                f"DB round trips per step: {engine + worker:.1f} for its messages (engine "
                f"{engine:.1f}, worker {worker:.1f}; {fmt_ratio((engine + worker) / base_trips)}) "
                f"+ {polling:.1f} of polling (relay sweeps, timers); machine "
                f"{x['machine_busy_cores']:.1f} of {os.cpu_count()} cores busy; {x['steps']} "
                f"steps{drift}",
            )
        )
    return figs


def bounds(results: dict[str, Any] | None) -> str:
    """What the idle processes cost: the only round trips that grow with their number."""
    if not results or "error" in results:
        return ""
    x = results.get("e1w4") or next(v for k, v in results.items() if k.startswith("e"))
    idle = x["idle_trips_per_s_per_process"]
    return (
        "Scale-out: an idle process polls the database (relay sweep, timers, registry) with "
        f"{idle.get('engine', 0):.0f} (engine) and {idle.get('worker', 0):.0f} (worker) round "
        "trips/s: the round trips that grow with the number of processes, per second, not per "
        "step."
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one wave per configuration")
    args = parser.parse_args()
    result = measure(waves=1 if args.quick else 3)
    from benchmarks.run import markdown

    print(markdown(figures(result)))
    print(bounds(result))
    print(json.dumps(result, indent=1))
