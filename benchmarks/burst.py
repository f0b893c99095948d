"""Row 13 of ``make bench``: a burst of starts (overload), and the storage each run costs.

One ``sagaloop engine`` and one ``sagaloop worker`` (RabbitMQ + PostgreSQL) run ``chain`` with
3 trivial steps, every run started with ``Client.start``. In order: the steady state (runs 4 at
a time, then a wave at once: the measured ceiling); storage (``pg_total_relation_size`` of the
sagaloop tables before and after the steady phase, per run, then after retention pruned them);
the burst (starts from two threads, no admission limit: ``SAGALOOP_START_BACKLOG=0``, measured
for ``budget`` seconds); admission (processes stopped: ``LIMIT + OVER`` starts of an app with
no engine, ``SAGALOOP_START_BACKLOG=LIMIT``: how many ``OverloadedError`` refuses, if this
sagaloop has it). Step-to-step latency: the time between two consecutive engine decisions of
one run, from the history (as in ``sagaloop_bench``).

    python -m benchmarks.burst [--quick]
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import sagaloop.errors
from benchmarks.benchapp import app
from benchmarks.common import (
    Figure,
    cpu_seconds,
    delete_rabbit,
    fmt_ms,
    fmt_ratio,
    latency,
    percentile,
)
from benchmarks.sagaloop_bench import DECISIONS, FINAL, System, step_gaps, system, warm_up
from sagaloop.client import Client
from sagaloop.engine import messages
from sagaloop.store import tables as t
from sagaloop.store.sql import SqlStore

SECTION = "13 burst"
STEPS = 3
IN_FLIGHT = 4  # runs in flight at a time in the steady phase
STEP_RATIO = 3.0  # target: step-to-step p50 under the burst <= 3x the steady state's
FIRST_S = 10.0  # target: the first run completes within 10 s of the burst's start
BACKLOG_ENV = "SAGALOOP_START_BACKLOG"
LIMIT, OVER = 1000, 500  # admission: LIMIT + OVER starts with SAGALOOP_START_BACKLOG=LIMIT
ADMISSION_APP = "bench-admission"  # no engine serves it: its backlog is every run started
STARTERS = 2


def _overloaded() -> tuple[type[BaseException], ...]:
    """``OverloadedError`` if this sagaloop has it (an admission limit), else nothing."""
    cls = getattr(sagaloop.errors, "OverloadedError", None)
    return (cls,) if cls is not None else ()


def _client(store: SqlStore, app_or_name: Any, backlog: str) -> Client:
    """A Client created with ``SAGALOOP_START_BACKLOG=backlog`` (read when it is created)."""
    before = os.environ.get(BACKLOG_ENV)
    os.environ[BACKLOG_ENV] = backlog
    try:
        return Client(store, app_or_name)
    finally:
        if before is None:
            del os.environ[BACKLOG_ENV]
        else:
            os.environ[BACKLOG_ENV] = before


def _history(s: System, where: Any) -> dict[str, list[tuple[str, float]]]:
    """(kind, at) of the run-level events and decisions of the runs ``where`` selects."""
    h = t.history.c
    kinds = ("run_started", "step_scheduled", "run_finished")
    q = sa.select(h.run_id, h.kind, h.at).where(where, h.kind.in_(kinds))
    out: dict[str, list[tuple[str, float]]] = {}
    with s.read() as conn:
        for run_id, kind, at in conn.execute(q.order_by(h.run_id, h.seq)):
            out.setdefault(run_id, []).append((kind, at.timestamp()))
    return out


def _durations(events: dict[str, list[tuple[str, float]]]) -> list[float]:
    """Start to end of each finished run."""
    out = []
    for evs in events.values():
        at = dict(evs)
        if "run_started" in at and "run_finished" in at:
            out.append(at["run_finished"] - at["run_started"])
    return out


def _finishes(events: dict[str, list[tuple[str, float]]]) -> list[float]:
    return sorted(at for evs in events.values() for kind, at in evs if kind == "run_finished")


def _table_bytes(s: System) -> dict[str, int]:
    q = sa.text(
        "SELECT relname, pg_total_relation_size(oid) FROM pg_class "
        "WHERE relkind = 'r' AND relname LIKE 'sagaloop%' AND relnamespace = "
        "(SELECT oid FROM pg_namespace WHERE nspname = current_schema())"
    )
    with s.read() as conn:
        return {str(name): int(size) for name, size in conn.execute(q)}


def _steady(s: System, client: Client, runs: int, saturated: int) -> dict[str, Any]:
    ids: list[str] = []
    for _ in range(max(1, runs // IN_FLIGHT)):
        wave = [client.start("chain", STEPS) for _ in range(IN_FLIGHT)]
        s.wait_finished(wave, 60)
        ids += wave
    events = _history(s, t.history.c.run_id.in_(ids))
    wave = [client.start("chain", STEPS) for _ in range(saturated)]
    s.wait_finished(wave, 60 + saturated * 0.2)
    done = _finishes(_history(s, t.history.c.run_id.in_(wave)))
    q1, q3 = percentile(done, 25), percentile(done, 75)  # the middle half: saturated
    return {
        "runs": len(ids),
        "in_flight": IN_FLIGHT,
        "run": latency(_durations(events)),
        "step": latency(step_gaps(events)),
        "saturated_runs": saturated,
        "ceiling_runs_per_s": len(done) / 2 / (q3 - q1),
    }


def _storage(s: System, before: dict[str, int], runs: int) -> dict[str, Any]:
    """Bytes per run kept, then what is left once retention has pruned the finished runs."""
    after = _table_bytes(s)
    kept = {k: (after[k] - before.get(k, 0)) / runs for k in after}
    cutoff = datetime.now(UTC) + timedelta(seconds=1)
    while s.store.prune(before=cutoff) > 0:
        pass
    with s.store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for name in after:
            conn.execute(sa.text(f"VACUUM FULL {name}"))
    pruned = sum(_table_bytes(s).values())
    return {
        "runs": runs,
        "bytes_per_run": sum(kept.values()),
        "by_table": {k: v for k, v in sorted(kept.items(), key=lambda x: -x[1]) if v > 0},
        "pruned_total_bytes": pruned,
        "before_total_bytes": sum(before.values()),
    }


def _start_burst(
    client: Client, n: int, stop: threading.Event, out: dict[str, Any]
) -> list[threading.Thread]:
    """Start ``n`` runs from :data:`STARTERS` threads; count what is refused into ``out``."""
    overloaded = _overloaded()
    lock = threading.Lock()

    def starter(count: int) -> None:
        started = refused = 0
        cpu0 = _thread_cpu()
        for _ in range(count):
            if stop.is_set():
                break
            try:
                client.start("chain", STEPS)
                started += 1
            except overloaded:
                refused += 1
        with lock:
            out["started"] += started
            out["refused"] += refused
            out["start_s"] = max(out["start_s"], time.time() - out["t0"])
            out["starters_cpu_s"] += _thread_cpu() - cpu0

    threads = [
        threading.Thread(target=starter, args=(n // STARTERS + (i < n % STARTERS),), daemon=True)
        for i in range(STARTERS)
    ]
    for th in threads:
        th.start()
    return threads


def _thread_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def _machine_cpu() -> float:
    """CPU seconds all processes of the machine used so far: /proc/stat's first line, all
    but idle and iowait."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _burst(
    s: System, client: Client, n: int, budget: float, pids: dict[str, int]
) -> dict[str, Any]:
    """The burst; what bounds its step latency: how many runs are running (sampled every
    0.5 s) and who used the machine's CPU while the starts came in (the starting threads,
    the engine, the worker, all the rest: PostgreSQL, RabbitMQ, other work)."""
    r = t.runs.c
    finished = sa.select(sa.func.count()).where(r.status.in_(FINAL))
    running = sa.select(sa.func.count()).where(
        r.app == app.name, r.status == "running", r.processed_seq > 0
    )
    base = s.count(finished)
    stop = threading.Event()
    out: dict[str, Any] = {"burst": n, "budget_s": budget, "started": 0, "refused": 0}
    out.update(start_s=0.0, starters_cpu_s=0.0, t0=time.time())
    cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()} | {"machine": _machine_cpu()}
    threads = _start_burst(client, n, stop, out)
    t0 = out["t0"]
    samples: list[int] = []
    cpu_at_starts_end: dict[str, float] = {}
    while time.time() - t0 < budget and s.count(finished) - base < n:
        time.sleep(0.5)
        samples.append(s.count(running))
        if not cpu_at_starts_end and not any(th.is_alive() for th in threads):
            cpu_at_starts_end = {k: cpu_seconds(p) for k, p in pids.items()}
            cpu_at_starts_end |= {"machine": _machine_cpu(), "at": time.time() - t0}
    stop.set()
    for th in threads:
        th.join()
    if not out["start_s"]:
        out["start_s"] = time.time() - t0
    if not cpu_at_starts_end:
        cpu_at_starts_end = {k: cpu_seconds(p) for k, p in pids.items()}
        cpu_at_starts_end |= {"machine": _machine_cpu(), "at": time.time() - t0}
    used = {k: cpu_at_starts_end[k] - cpu0[k] for k in cpu0}
    used["starters"] = out["starters_cpu_s"]
    used["rest"] = used["machine"] - used["engine"] - used["worker"] - used["starters"]
    out["cpu_while_starting"] = {"seconds": cpu_at_starts_end["at"], **used}
    cpu1 = {k: cpu_seconds(p) for k, p in pids.items()} | {"machine": _machine_cpu()}
    out["cpu_after_starting"] = {
        "seconds": time.time() - t0 - cpu_at_starts_end["at"],
        **{k: cpu1[k] - cpu_at_starts_end[k] for k in cpu1},
    }
    out["running"] = {
        "p50": percentile(samples, 50),
        "max": max(samples, default=0),
        "samples": len(samples),
    }
    h = t.history.c
    begin, end = (datetime.fromtimestamp(x, UTC) for x in (t0, t0 + budget))
    events = _history(s, sa.and_(h.at >= begin, h.at <= end))
    done = _finishes(events)
    window = min(budget, done[-1] - t0) if len(done) == n else budget
    out.update(
        completed=len(done),
        first_s=done[0] - t0 if done else None,
        first30_per_s=sum(1 for x in done if x - t0 <= 30) / min(30.0, budget),
        overall_per_s=len(done) / window,
        run=latency(_durations(events)),
        step=latency(step_gaps(events)),
    )
    cut = t0 + out["start_s"]  # the step gaps that ended while the starts came in, and after
    gaps = _timed_gaps(events)
    out["step_while_starting"] = latency([g for at, g in gaps if at <= cut])
    out["step_after_starting"] = latency([g for at, g in gaps if at > cut])
    steps = [at for evs in events.values() for kind, at in evs if kind == "step_scheduled"]
    out["cpu_while_starting"]["steps"] = sum(1 for at in steps if at <= cut)
    out["cpu_after_starting"]["steps"] = sum(1 for at in steps if at > cut)
    return out


def _timed_gaps(events: dict[str, list[tuple[str, float]]]) -> list[tuple[float, float]]:
    """(end, length) of each step-to-step gap (as ``step_gaps``)."""
    out = []
    for evs in events.values():
        times = [at for kind, at in evs if kind in DECISIONS]
        out += [(b, b - a) for a, b in itertools.pairwise(times)]
    return out


def _admission(s: System, store: SqlStore) -> dict[str, Any]:
    """``LIMIT + OVER`` starts of an app no engine serves, with the limit at ``LIMIT``."""
    for proc in s.procs:  # no relay publishes the admission app's start messages
        s.stop(proc)
    overloaded = _overloaded()
    client = _client(store, ADMISSION_APP, str(LIMIT))
    accepted: list[float] = []
    refused: list[float] = []
    for _ in range(LIMIT + OVER):
        t1 = time.perf_counter()
        try:
            client.start("chain", STEPS)
            accepted.append(time.perf_counter() - t1)
        except overloaded:
            refused.append(time.perf_counter() - t1)
    return {
        "limit": LIMIT,
        "tried": LIMIT + OVER,
        "has_limit": bool(overloaded),
        "refused": len(refused),
        "accepted_ms": latency(accepted)["p50_ms"],
        "refused_ms": latency(refused)["p50_ms"],
    }


@contextlib.contextmanager
def _bench_system() -> Iterator[System]:
    """The RabbitMQ + PostgreSQL system, and the start queue of its own too deleted after
    (where this sagaloop has one)."""
    with system("rabbitmq") as s:
        yield s
    start_queue = getattr(messages, "start_queue", None)
    if start_queue is not None:
        names = [start_queue(a) for a in (app.name, ADMISSION_APP)]
        delete_rabbit(s.broker_url, [f"{s.namespace}.{q}" for q in names], [])


def measure(
    burst: int = 20_000, budget: float = 120.0, steady: int = 200, saturated: int = 500
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _bench_system() as s:
        store = SqlStore(s.database_url, pool_size=STARTERS + 1)
        try:
            pids = {"engine": s.engine().pid, "worker": s.worker().pid}
            warm_up(s)
            client = _client(store, app, "0")
            before = _table_bytes(s)
            out["steady"] = _steady(s, client, steady, saturated)
            out["storage"] = _storage(s, before, out["steady"]["runs"] + saturated)
            out["burst"] = _burst(s, client, burst, budget, pids)
            out["admission"] = _admission(s, store)
        finally:
            store.close()
    return out


# --- the table ---------------------------------------------------------------------------------


def figures(result: dict[str, Any] | None) -> list[Figure]:
    if not result or "error" in result:
        error = (result or {}).get("error", "not run")
        return [Figure(SECTION, "a burst of starts", f"FAILED: {error}" if result else error)]
    st, b, sto, ad = result["steady"], result["burst"], result["storage"], result["admission"]
    ceiling = st["ceiling_runs_per_s"]
    figs = [
        Figure(
            SECTION,
            f"steady: {st['runs']} runs of {STEPS} steps, {st['in_flight']} in flight, "
            "run p50 / step-to-step p50",
            f"{fmt_ms(st['run']['p50_ms'])} / {fmt_ms(st['step']['p50_ms'])}",
            note=f"ceiling: {ceiling:.0f} runs/s sustained with {st['saturated_runs']} runs "
            "started at once (1 engine, 1 worker x 2 threads)",
        )
    ]
    first = b["first_s"]
    figs.append(
        Figure(
            SECTION,
            f"burst of {b['burst']:,} starts: time to the first completion",
            "none" if first is None else f"{first:.1f} s",
            target=f"<= {FIRST_S:.0f} s",
            met=first is not None and first <= FIRST_S,
            note=f"{b['started']:,} started by {STARTERS} threads of Client.start in "
            f"{b['start_s']:.1f} s ({b['started'] / b['start_s']:.0f} starts/s: they reach the "
            "engine at the Client's pace, not at once)"
            + (f", {b['refused']:,} refused" if b["refused"] else ""),
        )
    )
    ratio = b["step"]["p50_ms"] / st["step"]["p50_ms"]
    figs.append(
        Figure(
            SECTION,
            "burst: step-to-step p50 / p99 of the runs under way",
            f"{fmt_ms(b['step']['p50_ms'])} / {fmt_ms(b['step']['p99_ms'])}",
            fmt_ratio(ratio) + " steady",
            f"p50 <= {STEP_RATIO:.0f}x steady",
            bool(ratio <= STEP_RATIO),
            f"steady p50 / p99 {fmt_ms(st['step']['p50_ms'])} / {fmt_ms(st['step']['p99_ms'])}; "
            f"{b['step']['n']:,} steps decided within {b['budget_s']:.0f} s" + _bounds(b),
        )
    )
    figs.append(
        Figure(
            SECTION,
            f"burst: completions within {b['budget_s']:.0f} s, per s (first 30 s / overall); "
            "run p50",
            f"{b['completed']:,} ({b['first30_per_s']:.0f} / {b['overall_per_s']:.0f} runs/s); "
            f"{fmt_ms(b['run']['p50_ms'])}",
            fmt_ratio(b["overall_per_s"] / ceiling) + " ceiling",
            note=f"run p50 / p99 start to end of the runs completed: {fmt_ms(b['run']['p50_ms'])}"
            f" / {fmt_ms(b['run']['p99_ms'])} (steady p50 {fmt_ms(st['run']['p50_ms'])}); "
            f"ratio: overall completions/s to the steady ceiling",
        )
    )
    refused = f"{ad['refused']:,} of {ad['tried']:,} starts refused"
    figs.append(
        Figure(
            SECTION,
            f"admission: {ad['tried']:,} starts with {BACKLOG_ENV}={ad['limit']:,}",
            refused if ad["has_limit"] else f"no admission limit ({refused})",
            target=f"{OVER} refused",
            met=(ad["refused"] >= OVER * 0.9 and ad["tried"] - ad["refused"] <= ad["limit"] * 1.05)
            if ad["has_limit"]
            else None,
            note=f"Client.start p50 accepted {fmt_ms(ad['accepted_ms'])}, refused "
            f"{fmt_ms(ad['refused_ms'])}; an app with no engine, every run in its backlog",
        )
    )
    parts = ", ".join(f"{k.removeprefix('sagaloop_')} {v:.0f}" for k, v in sto["by_table"].items())
    figs.append(
        Figure(
            SECTION,
            f"storage per completed run of {STEPS} steps (PostgreSQL, retention off)",
            f"{sto['bytes_per_run'] / 1024:.1f} KB",
            note=f"pg_total_relation_size of the sagaloop tables before / after "
            f"{sto['runs']} runs, bytes per run: {parts} (outbox: rows deleted once published, "
            f"their space reused after autovacuum); after retention pruned them "
            f"(prune, VACUUM FULL) the tables hold {sto['pruned_total_bytes'] / 1024:.0f} KB "
            f"in all (before the runs: {sto['before_total_bytes'] / 1024:.0f} KB)",
        )
    )
    return figs


def _bounds(b: dict[str, Any]) -> str:
    """What bounds the step latency under the burst (see ``_burst``)."""
    if "cpu_while_starting" not in b:
        return ""
    cpu, after, running = b["cpu_while_starting"], b["cpu_after_starting"], b["running"]
    spent = ", ".join(
        f"{k} {cpu[k] / cpu['seconds']:.0%}" for k in ("starters", "engine", "worker", "rest")
    )

    def per_step(x: dict[str, Any]) -> str:
        n = max(x["steps"], 1)
        return f"{x['engine'] / n * 1000:.1f} + {x['worker'] / n * 1000:.1f} ms"

    return (
        f"; p50 while the starts came in / after: "
        f"{fmt_ms(b['step_while_starting']['p50_ms'])} / "
        f"{fmt_ms(b['step_after_starting']['p50_ms'])}; runs running (p50 / max of "
        f"{running['samples']} samples) {running['p50']:.0f} / {running['max']}; CPU while "
        f"starting ({cpu['seconds']:.0f} s, in cores): {spent}; engine + worker CPU per step "
        f"while starting / after: {per_step(cpu)} / {per_step(after)}"
    )


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.burst", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the plan of make bench's --quick")
    args = parser.parse_args()
    from benchmarks.run import FULL, QUICK, markdown

    result = measure(*(QUICK if args.quick else FULL)["burst"])
    print(markdown(figures(result)))
    print(json.dumps(result, indent=1, default=str))
