"""Issue 27: the agent-loop figures that users compare, with the definitions of Vercel's
Workflow SDK, on three setups:

- **in-process**: ``sagaloop engine --concurrency 4`` alone on RabbitMQ + PostgreSQL, steps
  ``local=True`` (as row 11 runs them);
- **broker**: ``sagaloop engine`` and ``sagaloop worker --queue bench --concurrency 2`` as
  separate processes on RabbitMQ + PostgreSQL (as row 2 runs them);
- **embedded**: the embedded default assembled in this process as ``sagaloop dev`` assembles
  it (``Service(app, store, broker)`` with its roles and ``--concurrency 4 --poll 0.1``) on a
  SQLite file with the database broker: its live channel is this process's, so the stream
  reader has to be here.

    python -m benchmarks.agent_loop [--quick] [--only SETUP,...] [--json PATH]
    python -m benchmarks.agent_loop --profile CASE [--only SETUP]   # cProfile, see profile()

Runs are started with ``Client.start`` (``sagaloop.connect``) and read back with
``Client.result``. Each step body of ``benchmarks.loopapp`` returns when it began and ended,
read from ``time.time()`` inside the body (the host's wall clock, the same in every process);
the start is ``time.time()`` just before ``Client.start``; a run's end is its ``run_finished``
event's timestamp (the engine's wall clock). The figures:

- **time to first step**: the start to the first step body's beginning;
- **step-to-step**: the end of one step body to the beginning of the next, in runs of 10
  sequential steps (p50 / p75 / p99 of every gap);
- **outside steps**: a 10-step run's wall time (start to ``run_finished``) minus the sum of its
  step bodies' times;
- **stream**: one step sends 300 four-byte chunks on a schedule of 100 a second
  (``ctx.stream``) to the run's live channel; ``Client.stream`` (what ``sagaloop tail`` reads)
  reads them from the start on. Overhead: from the first chunk sent to the last received,
  beyond the 2.99 s the schedule takes; first-chunk latency: sent to received;
- **agent loop**: ``SagaAgent(stream=True)`` around a Pydantic AI agent whose scripted model
  (``FunctionModel``, offline) streams five text deltas 10 ms apart per request and calls one of
  two tools (each sleeps 20 ms) in each of five turns: 6 model steps, 5 tool steps. Overhead:
  wall time minus the model's and the tools' scripted time (0.4 s). On the in-process setup
  the same agent with ``local=True`` (its model requests and tools in-process steps);
- **fan-out**: ``asyncio.gather`` of 256 ``ctx.call`` of a trivial step; overhead: the run's
  wall time minus its slowest step body's time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import json
import pstats
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import loopapp
from benchmarks.common import Figure, fmt_ms, load_average, percentile
from benchmarks.sagaloop_bench import ENGINE_THREADS, system
from sagaloop import Client, Roles, Service, Tuning, connect
from sagaloop.runtime.connect import open_broker, open_store

APP = "benchmarks.loopapp"
SETUPS = ("inprocess", "broker", "embedded")
LABELS = {
    "inprocess": "in-process steps",
    "broker": "broker steps",
    "embedded": "embedded (SQLite)",
}
FULL = {"runs": 20, "stream_runs": 2, "fanout_runs": 5, "agent_runs": 3, "fanout": 256}
QUICK = {"runs": 8, "stream_runs": 1, "fanout_runs": 1, "agent_runs": 2, "fanout": 256}
GAP_P75_MS = {"inprocess": 5.0, "broker": 8.0, "embedded": 8.0}
STREAM_OVERHEAD_MS = 20.0
FIRST_CHUNK_MS = 10.0
AGENT_OVERHEAD_MS = 100.0
FANOUT_OVERHEAD_S = 1.0
DEV_CONCURRENCY, DEV_POLL = 4, 0.1  # sagaloop dev's defaults


@dataclass
class Setup:
    client: Client
    local: bool


@contextlib.contextmanager
def setup(kind: str) -> Iterator[Setup]:
    """The processes of ``kind`` (see the module's docstring) and a client of their app."""
    if kind == "embedded":
        tmp = Path(tempfile.mkdtemp(prefix="sagaloop-bench-loop-"))
        url = f"sqlite:///{tmp / 'loop.db'}"
        tuning = Tuning(concurrency=DEV_CONCURRENCY, poll=DEV_POLL)
        store = open_store(url, upgrade=True, connections=tuning.connections)  # as `dev` does
        broker = open_broker("database", store)
        service = Service(loopapp.app, store, broker, roles=Roles(), tuning=tuning).start()
        client = connect(url, loopapp.app)  # the database broker: this process's live channel
        try:
            yield Setup(client, local=False)
        finally:
            service.stop()
            broker.close()
            store.close()
            client.store.close()
            shutil.rmtree(tmp, ignore_errors=True)
        return
    with system("rabbitmq", APP) as s:
        if kind == "inprocess":
            s.engine(ENGINE_THREADS)
        else:
            s.engine()
            s.worker()
        client = connect(s.database_url, loopapp.app, broker=s.broker_url, namespace=s.namespace)
        try:
            yield Setup(client, local=kind == "inprocess")
        finally:
            client.store.close()


def _run(c: Client, saga: str, spec: Any, timeout: float = 120) -> tuple[Any, float, str]:
    """Start a run and wait for its output: (output, start time, run id)."""
    t0 = time.time()
    run_id = c.start(saga, spec)
    return c.result(run_id, timeout=timeout), t0, run_id


def _finished_at(c: Client, run_id: str) -> float:
    (at,) = [e.at for e in c.store.load_history(None, run_id) if e.kind == "run_finished"]
    return float(at.timestamp())


def _dist(samples_s: Sequence[float]) -> dict[str, float]:
    ms = [x * 1000 for x in samples_s]
    return {f"p{q}_ms": percentile(ms, q) for q in (50, 75, 99)} | {"n": len(ms)}


def sequential(s: Setup, runs: int) -> dict[str, Any]:
    """``runs`` runs of 10 steps, one after the other: time to first step, step-to-step gaps,
    time outside step bodies."""
    first, gaps, outside = [], [], []
    for _ in range(runs):
        bodies, t0, run_id = _run(s.client, "stamps", {"steps": 10, "local": s.local})
        first.append(bodies[0][0] - t0)
        gaps += [b[0] - a[1] for a, b in itertools.pairwise(bodies)]
        wall = _finished_at(s.client, run_id) - t0
        outside.append(wall - sum(e - b for b, e in bodies))
    return {"first_step": _dist(first), "gaps": _dist(gaps), "outside": _dist(outside)}


def streamed(s: Setup, runs: int) -> dict[str, Any]:
    """``runs`` runs of the streaming step, each read by ``Client.stream`` from its start."""
    overheads, firsts, latencies, lost = [], [], [], 0
    for _ in range(runs):
        run_id = s.client.start("stream", {"local": s.local})
        received: dict[int, float] = {}
        for item in s.client.stream(run_id, timeout=60):
            if item.get("source") == "live":
                received[int(item["data"])] = time.time()
        sent = s.client.result(run_id, timeout=30)
        lost += len(sent) - len(received)
        if not received:
            continue
        overheads.append(max(received.values()) - sent[0] - (len(sent) - 1) * loopapp.CHUNK_EVERY)
        if 0 in received:
            firsts.append(received[0] - sent[0])
        latencies += [at - sent[i] for i, at in received.items()]
    return {
        "overhead": _dist(overheads),
        "first_chunk": _dist(firsts),
        "chunk_latency": _dist(latencies),
        "lost": lost,
        "chunks": runs * loopapp.CHUNKS,
    }


def fanned(s: Setup, runs: int, width: int) -> dict[str, Any]:
    """``runs`` runs of ``width`` steps at once: wall time beyond the slowest step body."""
    overheads, walls, spreads = [], [], []
    for _ in range(runs):
        bodies, t0, run_id = _run(s.client, "fanout", {"steps": width, "local": s.local})
        wall = _finished_at(s.client, run_id) - t0
        walls.append(wall)
        overheads.append(wall - max(e - b for b, e in bodies))
        spreads.append(max(b for b, _ in bodies) - min(b for b, _ in bodies))
    return {"overhead": _dist(overheads), "wall": _dist(walls), "start_spread": _dist(spreads)}


def agent(s: Setup, runs: int) -> dict[str, Any]:
    """``runs`` five-turn agent loops: wall time beyond the model's and the tools' own."""
    own = loopapp.MODEL_S + loopapp.TOOLS_S
    walls = []
    for _ in range(runs):
        calls, t0, run_id = _run(s.client, "agent5", {"local": s.local})
        if calls != loopapp.TURNS:
            raise RuntimeError(f"the agent made {calls} tool calls, not {loopapp.TURNS}")
        walls.append(_finished_at(s.client, run_id) - t0)
    return {"overhead": _dist([w - own for w in walls]), "wall": _dist(walls), "own_s": own}


def measure_setup(kind: str, plan: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"load": [load_average()]}
    with setup(kind) as s:
        _run(s.client, "stamps", {"steps": 3, "local": s.local})  # warm up
        out["sequential"] = sequential(s, plan["runs"])
        out["stream"] = streamed(s, plan["stream_runs"])
        out["fanout"] = fanned(s, plan["fanout_runs"], plan["fanout"])
        out["agent"] = agent(s, plan["agent_runs"])
    out["load"].append(load_average())
    return out


def measure(quick: bool = False, only: Sequence[str] = SETUPS) -> dict[str, Any]:
    """Every setup of ``only``, one after the other; a setup that fails is reported so."""
    plan = QUICK if quick else FULL
    results: dict[str, Any] = {"plan": plan}
    for kind in only:
        try:
            results[kind] = measure_setup(kind, plan)
        except Exception as e:
            results[kind] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return results


@contextlib.contextmanager
def assembled(kind: str) -> Iterator[Setup]:
    """``kind``'s setup with its services in this process (for a profile of their threads):
    the embedded setup as it is; on RabbitMQ + PostgreSQL, the ``Service`` that ``sagaloop
    engine`` runs (and, for ``broker``, the one ``sagaloop worker`` runs, with a store and a
    broker of its own) instead of the processes."""
    if kind == "embedded":
        with setup(kind) as s:
            yield s
        return
    from sagaloop.runtime.connect import open_streams

    with system("rabbitmq", APP) as sy:
        roles = [(Roles(queues=()), ENGINE_THREADS)]
        if kind == "broker":
            roles.append((Roles(engine=False, timers=False, queues=["bench"]), 2))
        opened: list[tuple[Service, Any, Any]] = []
        streams = open_streams(sy.broker_url, namespace=sy.namespace)
        try:
            for role, concurrency in roles:
                tuning = Tuning(concurrency=concurrency, poll=DEV_POLL)
                store = open_store(sy.database_url, connections=tuning.connections)
                broker = open_broker(sy.broker_url, store, namespace=sy.namespace)
                service = Service(
                    loopapp.app, store, broker, roles=role, tuning=tuning, streams=streams
                )
                opened.append((service.start(), broker, store))
            client = connect(
                sy.database_url, loopapp.app, broker=sy.broker_url, namespace=sy.namespace
            )
            try:
                yield Setup(client, local=kind == "inprocess")
            finally:
                client.store.close()
        finally:
            for service, broker, store in opened:
                service.stop()
                broker.close()
                store.close()


def profile(case: str, runs: int, kind: str = "embedded", top: int = 25) -> str:
    """cProfile of every thread of ``kind``'s setup assembled in this process
    (:func:`assembled`) over ``runs`` runs of ``case`` (``sequential``, ``agent`` or
    ``fanout``), by each thread's CPU time (``time.thread_time``): what the threads compute,
    not what they wait for. Threads still running at the end (a step's keep-alive, asleep)
    are left out: their profile cannot be read from another thread."""
    profiles: list[tuple[threading.Thread, cProfile.Profile]] = []
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)
        profiles.append((self, prof))
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    threading.Thread.run = profiled  # type: ignore[method-assign]
    main = cProfile.Profile(time.thread_time)
    try:
        with assembled(kind) as s:
            _run(s.client, "stamps", {"steps": 3, "local": s.local})
            main.enable()
            if case == "agent":
                figure = agent(s, runs)
            elif case == "fanout":
                figure = fanned(s, runs, FULL["fanout"])
            else:
                figure = sequential(s, runs)
            main.disable()
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]
    ended = [prof for thread, prof in profiles if not thread.is_alive()]  # the services stopped
    buf = io.StringIO()
    stats = pstats.Stats(main, stream=buf)
    for prof in ended:
        with contextlib.suppress(TypeError):  # a thread that never ran profiled code
            stats.add(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("sagaloop|pydantic_ai", top)
    return f"{case}, {runs} runs, {kind}: {json.dumps(figure)}\n{buf.getvalue()}"


# --- the rows ---------------------------------------------------------------------------------


def _three(d: dict[str, float]) -> str:
    return " / ".join(fmt_ms(d[f"p{q}_ms"]) for q in (50, 75, 99))


def figures(results: dict[str, Any] | None) -> list[Figure]:
    """Section 14 of ``make bench``: one row per figure and setup."""
    sec = "14 agent loop"
    if not results:
        return [Figure(sec, "agent-loop figures (benchmarks/agent_loop.py)", "not run")]
    if "error" in results:
        return [Figure(sec, "agent-loop figures", f"FAILED: {results['error']}", met=False)]
    figs: list[Figure] = []
    ok = {k: results[k] for k in SETUPS if k in results and "error" not in results[k]}
    for kind in SETUPS:
        if kind in results and kind not in ok:
            figs.append(Figure(sec, LABELS[kind], f"FAILED: {results[kind]['error']}", met=False))
    broker_gap = ok.get("broker", {}).get("sequential", {}).get("gaps", {}).get("p50_ms")

    def vs_broker(ms: float) -> str:
        return f"{ms / broker_gap:.2f}x broker p50" if broker_gap else ""

    for kind, r in ok.items():
        q, lab = r["sequential"], LABELS[kind]
        load = " -> ".join(f"{x:.1f}" for x in r["load"])
        figs.append(
            Figure(
                sec,
                f"{lab}: time to first step (start -> first step body), p50 / p75 / p99",
                _three(q["first_step"]),
                note=f"{q['first_step']['n']} runs; load average {load}",
            )
        )
        target = GAP_P75_MS[kind]
        figs.append(
            Figure(
                sec,
                f"{lab}: step-to-step (one body's end -> the next's start), p50 / p75 / p99",
                _three(q["gaps"]),
                vs_broker(q["gaps"]["p50_ms"]) if kind != "broker" else "",
                f"p75 < {target:.0f} ms",
                q["gaps"]["p75_ms"] < target,
                f"{q['gaps']['n']} gaps in runs of 10 steps"
                + ("; the database broker's steps" if kind == "embedded" else ""),
            )
        )
        figs.append(
            Figure(
                sec,
                f"{lab}: time outside step bodies, 10-step run (wall - bodies), p50 / p99",
                f"{fmt_ms(q['outside']['p50_ms'])} / {fmt_ms(q['outside']['p99_ms'])}",
                f"{q['outside']['p50_ms'] / 10 / q['gaps']['p50_ms']:.2f}x 10 gaps p50",
                note="start -> run_finished, less the 10 bodies",
            )
        )
        st = r["stream"]
        met = (
            st["overhead"]["p50_ms"] < STREAM_OVERHEAD_MS
            and st["first_chunk"]["p50_ms"] < FIRST_CHUNK_MS
            and not st["lost"]
        )
        figs.append(
            Figure(
                sec,
                f"{lab}: stream, 300 x 4 B at 100/s via Client.stream: overhead beyond 2.99 s "
                "/ first-chunk latency",
                f"{fmt_ms(st['overhead']['p50_ms'])} / {fmt_ms(st['first_chunk']['p50_ms'])}",
                "",
                f"< {STREAM_OVERHEAD_MS:.0f} ms / < {FIRST_CHUNK_MS:.0f} ms",
                met,
                f"per-chunk latency p50 / p75 / p99 {_three(st['chunk_latency'])}; "
                f"{st['lost']} of {st['chunks']} chunks lost; p50 of "
                f"{st['overhead']['n']} run(s)",
            )
        )
        fo = r["fanout"]
        figs.append(
            Figure(
                sec,
                f"{lab}: fan-out of {results['plan']['fanout']} steps (asyncio.gather of "
                "ctx.call): wall - slowest step",
                fmt_ms(fo["overhead"]["p50_ms"]),
                "",
                f"< {FANOUT_OVERHEAD_S:.0f} s",
                fo["overhead"]["p50_ms"] < FANOUT_OVERHEAD_S * 1000,
                f"p50 of {fo['overhead']['n']} run(s); bodies began over "
                f"{fmt_ms(fo['start_spread']['p50_ms'])}",
            )
        )
        ag = r.get("agent")
        if ag:
            figs.append(
                Figure(
                    sec,
                    f"{lab}: five-turn Pydantic AI loop, two tools, streamed (scripted model): "
                    "wall - model and tools",
                    fmt_ms(ag["overhead"]["p50_ms"]),
                    f"{ag['overhead']['p50_ms'] / 11:.1f} ms per step",
                    f"< {AGENT_OVERHEAD_MS:.0f} ms",
                    ag["overhead"]["p50_ms"] < AGENT_OVERHEAD_MS,
                    f"wall p50 {fmt_ms(ag['wall']['p50_ms'])}, of which model and tools "
                    f"{ag['own_s'] * 1000:.0f} ms and time to first step (row above) "
                    f"{fmt_ms(q['first_step']['p50_ms'])}; 6 model steps + 5 tool steps; "
                    f"p50 of {ag['wall']['n']} runs",
                )
            )
    return figs


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import markdown

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.agent_loop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer runs of each case")
    parser.add_argument("--only", help=f"comma-separated setups of {', '.join(SETUPS)}")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument(
        "--profile",
        choices=("sequential", "agent", "fanout"),
        help="instead, cProfile the threads of the setup of --only (default: embedded), "
        "assembled in this process, over this case",
    )
    args = parser.parse_args(argv)
    if args.profile:
        kind = args.only or "embedded"
        if kind not in SETUPS:
            parser.error(f"--profile: one setup of {', '.join(SETUPS)} with --only")
        print(profile(args.profile, 5 if args.profile != "fanout" else 1, kind))
        return 0
    only = [k.strip() for k in args.only.split(",")] if args.only else list(SETUPS)
    unknown = set(only) - set(SETUPS)
    if unknown:
        parser.error(f"unknown setups {sorted(unknown)}: choose from {', '.join(SETUPS)}")
    results = measure(args.quick, only)
    print(markdown(figures(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
