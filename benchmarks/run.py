"""``make bench``: measure everything in one run and print one table.

    python -m benchmarks.run [--quick] [--json PATH] [--markdown PATH]

Every figure is put next to a floor measured in the same run (the machine is shared and small,
so absolute figures move from run to run; ratios move much less). The floor is measured at the
start and again at the end of the run, and both samples are pooled. Each section that fails is
reported as failed, with its error, never with made-up figures.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks import (
    agent_loop,
    agent_transcript,
    approvals,
    burst,
    floor,
    peer_dbos,
    profile,
    roundtrips,
    sagaloop_bench,
    scale,
)
from benchmarks.common import Figure, fmt_ms, fmt_ratio, latency, load_average

FULL: dict[str, Any] = {
    "sequential_steps": 200,
    "concurrency": [1, 8, 64],
    "waves": {1: 10, 8: 5, 64: 1},
    "floor_waves": 5,
    "loops": [10, 100, 1000, 10_000],
    "loop_iterations": 200,
    "waiting": (10, 10_000),
    "recovery_runs": 1000,
    "profile_steps": 300,
    "roundtrip_steps": 50,
    "transcript_turns": agent_transcript.TURNS,
    "scale_waves": 3,
    "approvals_waiting": 10_000,
    "burst": (20_000, 120.0, 200, 500),  # starts, budget (s), steady runs, saturated wave
    "agent_loop_quick": False,
}
QUICK: dict[str, Any] = {
    "sequential_steps": 100,
    "concurrency": [1, 8, 64],
    "waves": {1: 5, 8: 2, 64: 1},
    "floor_waves": 2,
    "loops": [10, 100, 300],
    "loop_iterations": 100,
    "waiting": (10, 1_000),
    "recovery_runs": 200,
    "profile_steps": 0,
    "roundtrip_steps": 20,
    "transcript_turns": agent_transcript.QUICK_TURNS,
    "scale_waves": 1,
    "approvals_waiting": 10_000,
    "burst": (2_000, 40.0, 100, 300),
    "agent_loop_quick": True,
}
FLAT = 1.25  # "flat": the per-iteration cost of the longest loop within 25 % of the shortest
BROKER_SEQUENTIAL = 1.5  # broker steps: sequential p50 <= 1.5x the floor's
BROKER_CPU_MS = 1.5  # broker steps: CPU per step, engine + worker
BROKER_TRIPS = 10  # broker steps: database round trips per step (engine, relay, worker)
INPROCESS_SEQUENTIAL = 1.0  # in-process steps: sequential p50 <= 1.0x DBOS's p50
INPROCESS_THROUGHPUT = 1.2  # in-process steps: steps/s at 8 and at 64 >= 1.2x DBOS's at each
NEEDS = {"inprocess": ("dbos",)}
"""What a section is compared with, run with it under ``--only`` (the floor always runs)."""


def sections(plan: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    waves = plan["waves"]
    conc = plan["concurrency"]
    return [
        (
            "floor",
            lambda: floor.measure(
                sequential_steps=plan["sequential_steps"], waves=plan["floor_waves"]
            ),
        ),
        (
            "sagaloop",
            lambda: sagaloop_bench.measure_main(
                "rabbitmq",
                sequential_steps=plan["sequential_steps"],
                concurrency=conc,
                waves=waves,
            ),
        ),
        (
            "dbos",
            lambda: peer_dbos.measure(
                sequential_steps=plan["sequential_steps"],
                concurrency=conc,
                waves={str(k): v for k, v in waves.items()},
            ),
        ),
        (
            "inprocess",
            lambda: sagaloop_bench.measure_inprocess(
                sequential_steps=plan["sequential_steps"],
                concurrency=conc,
                waves=waves,
            ),
        ),
        ("loops", lambda: sagaloop_bench.measure_loops(plan["loops"], plan["loop_iterations"])),
        ("waiting", lambda: sagaloop_bench.measure_waiting(*plan["waiting"])),
        ("recovery", lambda: sagaloop_bench.measure_recovery(plan["recovery_runs"])),
        (
            "sqlite",
            lambda: sagaloop_bench.measure_main(
                "sqlite",
                sequential_steps=plan["sequential_steps"],
                concurrency=conc,
                waves=waves,
            ),
        ),
        ("roundtrips", lambda: roundtrips.count_all(plan["roundtrip_steps"])),
        ("scale", lambda: scale.measure(waves=plan["scale_waves"])),
        ("agent_transcript", lambda: agent_transcript.measure(plan["transcript_turns"])),
        ("agent_storage", lambda: agent_transcript.measure_storage()),
        ("approvals", lambda: approvals.measure(plan["approvals_waiting"])),
        ("burst", lambda: burst.measure(*plan["burst"])),
        ("agent_loop", lambda: agent_loop.measure(plan["agent_loop_quick"])),
        (
            "profile",
            lambda: (
                profile.profile_sequential(
                    plan["profile_steps"], Path("/tmp/sagaloop-bench-profile")
                )
                if plan["profile_steps"]
                else {"error": "skipped (--quick)"}
            ),
        ),
        (
            "floor_after",
            lambda: floor.measure(
                sequential_steps=plan["sequential_steps"], waves=plan["floor_waves"]
            ),
        ),
    ]


def measure(plan: dict[str, Any], only: set[str] | None = None) -> dict[str, Any]:
    """Run the sections (those named in ``only``, if given, and what they are compared with:
    the floor's always, see ``NEEDS``)."""
    results: dict[str, Any] = {"started": datetime.now(UTC).isoformat(timespec="seconds")}
    if only is not None:
        only = only | {need for name in only for need in NEEDS.get(name, ())}
    for name, fn in sections(plan):
        if only is not None and name not in only and name not in ("floor", "floor_after"):
            continue
        t0, load0 = time.monotonic(), load_average()
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = fn()
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        results[name]["_seconds"] = time.monotonic() - t0
        results[name]["_load"] = (load0, load_average())
        print(
            f"bench: {name} done in {results[name]['_seconds']:.0f} s "
            f"(load average {load0:.1f} -> {load_average():.1f})",
            file=sys.stderr,
            flush=True,
        )
    return results


# --- the table --------------------------------------------------------------------------------


def _ok(section: Any) -> bool:
    return isinstance(section, dict) and bool(section) and "error" not in section


def pooled_floor(results: dict[str, Any]) -> dict[str, Any]:
    """The floor's two measurements (start and end of the run) pooled."""
    parts = [results[k] for k in ("floor", "floor_after") if _ok(results.get(k))]
    if not parts:
        return {}
    out: dict[str, Any] = {}
    for case in ("sequential", "concurrent"):
        samples = [x for p in parts for x in p[case]["samples"]]
        steps = sum(p[case]["steps"] for p in parts)
        window = sum(p[case]["window_s"] for p in parts)
        out[case] = {**latency(samples), "steps_per_s": steps / window}
        out[case]["p50_each"] = [p[case]["p50_ms"] for p in parts]
        out[case]["cpu_ms_per_step"] = parts[0][case]["cpu_ms_per_step"]
    out["unit_costs"] = parts[0]["unit_costs"]
    return out


def table(results: dict[str, Any], plan: dict[str, Any]) -> list[Figure]:
    figs: list[Figure] = []
    fl = pooled_floor(results)
    seq_floor = fl.get("sequential", {}).get("p50_ms", math.nan)
    seq_floor99 = fl.get("sequential", {}).get("p99_ms", math.nan)
    tput_floor = fl.get("concurrent", {}).get("steps_per_s", math.nan)
    n_seq = plan["sequential_steps"]

    # 1. the floor
    if fl:
        s, c = fl["sequential"], fl["concurrent"]
        spread = " / ".join(fmt_ms(x) for x in s["p50_each"])
        figs.append(
            Figure(
                "1 floor",
                f"hand-made step, sequential ({n_seq} steps), p50 / p99",
                f"{fmt_ms(s['p50_ms'])} / {fmt_ms(s['p99_ms'])}",
                "1.00x",
                note=f"p50 at start / end of run: {spread}",
            )
        )
        figs.append(
            Figure(
                "1 floor",
                "hand-made, 8 sagas x 10 steps, 2 consumers per role",
                f"{c['steps_per_s']:.0f} steps/s; p50 {fmt_ms(c['p50_ms'])}, "
                f"p99 {fmt_ms(c['p99_ms'])}",
                "1.00x",
            )
        )
    else:
        figs.append(Figure("1 floor", "hand-made step", _err(results, "floor")))

    # 2. sequential latency
    sg = results.get("sagaloop", {})
    if _ok(sg):
        s = sg["sequential"]
        ratio = s["p50_ms"] / seq_floor
        figs.append(
            Figure(
                "2 sequential",
                f"sagaloop, 1 saga of {n_seq} steps, per-step p50",
                fmt_ms(s["p50_ms"]),
                fmt_ratio(ratio),
                f"<= {BROKER_SEQUENTIAL}x floor",
                ratio <= BROKER_SEQUENTIAL,
                note="engine and worker as separate processes (sagaloop engine / worker)",
            )
        )
        cpu = sum(s["cpu_ms_per_step"])
        figs.append(
            Figure(
                "2 sequential",
                "sagaloop, CPU per step, engine + worker",
                f"{s['cpu_ms_per_step'][0]:.1f} + {s['cpu_ms_per_step'][1]:.1f} ms",
                "",
                f"<= {BROKER_CPU_MS} ms",
                cpu <= BROKER_CPU_MS,
                "each process's CPU time (/proc) over the run, per step",
            )
        )
        rt = results.get("roundtrips", {})
        if _ok(rt):
            trips, _ = _trips(rt, ("engine", "relay", "worker"))
            polls, _ = _trips(rt, ("timers",))
            figs.append(
                Figure(
                    "2 sequential",
                    "sagaloop, database round trips per step",
                    f"{trips:.1f}",
                    f"{trips / 10:.2f}x floor",
                    f"<= {BROKER_TRIPS}",
                    trips <= BROKER_TRIPS,
                    "engine, relay and worker threads, counted by SQLAlchemy's events "
                    f"(benchmarks/roundtrips.py, --poll 0.05: the relay's share includes its "
                    f"sweeps); the timer scheduler's polling adds {polls:.1f}; the floor does 10",
                )
            )
        figs.append(
            Figure(
                "2 sequential",
                "sagaloop, per-step p99",
                fmt_ms(s["p99_ms"]),
                fmt_ratio(s["p99_ms"] / seq_floor99),
                note="ratio to the floor's p99",
            )
        )
    else:
        figs.append(Figure("2 sequential", "sagaloop", _err(results, "sagaloop")))

    # 4. the peer (next to the sequential figures it is compared with)
    db = results.get("dbos", {})
    if _ok(db):
        d = db["sequential"]
        ratio = sg["sequential"]["p50_ms"] / d["p50_ms"] if _ok(sg) else math.nan
        figs.append(
            Figure(
                "4 peer",
                f"DBOS Transact {db.get('version', '')}, 1 workflow of {n_seq} steps, "
                "per-step p50 / p99",
                f"{fmt_ms(d['p50_ms'])} / {fmt_ms(d['p99_ms'])}",
                f"{fmt_ratio(d['p50_ms'] / seq_floor)} floor",
                note=f"sagaloop's broker step is {fmt_ratio(ratio)} DBOS; DBOS runs steps "
                "in-process (no broker): row 11 compares sagaloop's in-process steps",
            )
        )
    else:
        figs.append(
            Figure(
                "4 peer",
                "DBOS Transact",
                _err(results, "dbos"),
                met=None if "dbos" not in results else False,  # a failure misses; --only skips
            )
        )

    # 3. throughput
    if _ok(sg):
        for c in plan["concurrency"]:
            x = sg[f"concurrent_{c}"]
            peer = db.get(f"concurrent_{c}") if _ok(db) else None
            note = f"{x['steps']} steps"
            if peer:
                vs = fmt_ratio(x["steps_per_s"] / peer["steps_per_s"])
                note += (
                    f"; DBOS {peer['steps_per_s']:.0f} steps/s, p99 "
                    f"{fmt_ms(peer['p99_ms'])} (sagaloop {vs})"
                )
            target, met = "", None
            if c == 64:  # as many steps/s as the floor with 8 sagas, and as DBOS with 64
                target = "1.0x floor-8 and DBOS"
                met = x["steps_per_s"] >= tput_floor and (
                    peer is None or x["steps_per_s"] >= peer["steps_per_s"]
                )
            figs.append(
                Figure(
                    "3 throughput",
                    f"sagaloop, {c} concurrent sagas x 10 steps",
                    f"{x['steps_per_s']:.0f} steps/s; p50 {fmt_ms(x['p50_ms'])}, "
                    f"p99 {fmt_ms(x['p99_ms'])}",
                    fmt_ratio(x["steps_per_s"] / tput_floor) + " floor-8",
                    target,
                    met,
                    note,
                )
            )
            if c == 8:
                figs.append(
                    Figure(
                        "3 throughput",
                        "sagaloop, 8 concurrent sagas, per-step p99",
                        fmt_ms(x["p99_ms"]),
                        fmt_ratio(x["p99_ms"] / fl["concurrent"]["p99_ms"]) if fl else "n/a",
                        note="ratio to the floor's p99 at 8",
                    )
                )

    # 11. in-process steps, next to the peer's figures of the same run
    figs.extend(inprocess_figures(results, plan))

    # 5. long agent loops
    lp = results.get("loops", {})
    if _ok(lp):
        sizes = [str(n) for n in plan["loops"]]
        base, base_cpu = lp[sizes[0]]["p50_ms"], lp[sizes[0]]["engine_cpu_ms_per_iteration"]
        for n in sizes:
            x = lp[n]
            flat = x["p50_ms"] / base
            flat_cpu = x["engine_cpu_ms_per_iteration"] / base_cpu
            note = (
                f"mean {fmt_ms(x['wall_ms_per_iteration'])}, engine CPU "
                f"{x['engine_cpu_ms_per_iteration']:.1f} ms ({fmt_ratio(flat_cpu)}) per "
                f"iteration; {x['iterations']} iterations"
            )
            target, met = "", None
            if n == sizes[-1]:
                inner = x.get("last_vs_first_third", math.nan)
                note += f"; within this run, last third vs first third: {fmt_ratio(inner)}"
                target = f"flat: p50 and engine CPU <= {FLAT}x the {sizes[0]}-loop's"
                met = flat <= FLAT and flat_cpu <= FLAT
            figs.append(
                Figure(
                    "5 agent loops",
                    f"{int(n):,} iterations, per-iteration p50",
                    fmt_ms(x["p50_ms"]),
                    f"{fmt_ratio(x['p50_ms'] / seq_floor)} floor, "
                    f"{fmt_ratio(flat)} {sizes[0]}-loop",
                    target,
                    met,
                    note,
                )
            )
    else:
        figs.append(Figure("5 agent loops", "", _err(results, "loops")))

    # 6. waiting is free
    wt = results.get("waiting", {})
    if _ok(wt):
        small, large = wt["small"], wt["large"]
        figs.append(
            Figure(
                "6 waiting",
                f"engine RSS, {small['runs']:,} vs {large['runs']:,} runs waiting",
                f"{small['rss_mb']:.0f} MB vs {large['rss_mb']:.0f} MB (+{wt['delta_mb']:.1f} MB)",
                f"{fmt_ratio(large['rss_mb'] / small['rss_mb'])} the {small['runs']}-run RSS",
                "<= +50 MB",
                wt["delta_mb"] <= 50,
                f"VmRSS of the engine process; {wt['activations_per_s']:.0f} starts/s processed",
            )
        )
    else:
        figs.append(Figure("6 waiting", "", _err(results, "waiting")))

    # 7. recovery
    rc = results.get("recovery", {})
    if _ok(rc):
        ready = rc.get("ready_s")
        ratio = fmt_ratio(rc["first_s"] / ready) + " start-up" if ready else "n/a"
        figs.append(
            Figure(
                "7 recovery",
                f"engine restart -> first resumed step, {rc['runs']:,} runs in flight",
                f"{rc['first_s']:.2f} s",
                ratio,
                "< 5 s",
                rc["first_s"] < 5,
                f"process start-up (log line 'engine: app') {ready:.2f} s; all {rc['runs']:,} "
                f"resumed after {rc['all_s']:.1f} s"
                if ready
                else "",
            )
        )
    else:
        figs.append(Figure("7 recovery", "", _err(results, "recovery")))

    # 8. the embedded default
    sq = results.get("sqlite", {})
    if _ok(sq):
        s = sq["sequential"]
        figs.append(
            Figure(
                "8 embedded",
                f"SQLite + database broker (sagaloop dev), {n_seq} steps, p50 / p99",
                f"{fmt_ms(s['p50_ms'])} / {fmt_ms(s['p99_ms'])}",
                fmt_ratio(s["p50_ms"] / seq_floor),
                note="one process: engine, worker, timers",
            )
        )
        for c in plan["concurrency"]:
            x = sq[f"concurrent_{c}"]
            figs.append(
                Figure(
                    "8 embedded",
                    f"SQLite, {c} concurrent sagas x 10 steps",
                    f"{x['steps_per_s']:.0f} steps/s; p50 {fmt_ms(x['p50_ms'])}, "
                    f"p99 {fmt_ms(x['p99_ms'])}",
                    fmt_ratio(x["steps_per_s"] / tput_floor) + " floor-8",
                )
            )
    else:
        figs.append(Figure("8 embedded", "", _err(results, "sqlite")))

    # 9. an agent's transcript stored once (offline: the harness, a FunctionModel)
    figs.extend(agent_transcript.figures(results.get("agent_transcript"), plan["transcript_turns"]))
    # storage per agent turn against what the turn adds, both adapters (issue 27)
    figs.extend(agent_transcript.storage_figures(results.get("agent_storage")))

    # 10. scale-out: more worker and engine processes on the same wave
    figs.extend(scale.figures(results.get("scale")))

    # 12. the pending approvals, listed page by page with many runs waiting
    figs.extend(approvals.figures(results.get("approvals")))

    # 13. a burst of starts (overload), and the storage each run costs
    figs.extend(burst.figures(results.get("burst")))

    # 14. the agent-loop figures users compare (issue 27: Vercel Workflow's definitions)
    figs.extend(agent_loop.figures(results.get("agent_loop")))
    return figs


def inprocess_figures(results: dict[str, Any], plan: dict[str, Any]) -> list[Figure]:
    """Row 11: in-process steps (``chain_local`` on one ``sagaloop engine`` process, no
    worker), each figure next to DBOS's of the same run."""
    targets = (
        f"p50 <= {INPROCESS_SEQUENTIAL}x DBOS p50; "
        f"steps/s at 8 and 64 >= {INPROCESS_THROUGHPUT}x DBOS's"
    )
    if not _ok(results.get("inprocess")):
        # a failure misses; a section skipped with --only does not
        met = None if "inprocess" not in results else False
        return [Figure("11 in-process", "", _err(results, "inprocess"), target=targets, met=met)]
    ip: dict[str, Any] = results["inprocess"]
    db = results.get("dbos", {})
    peer = db if _ok(db) else None
    no_peer = "" if peer else f"; DBOS {_err(results, 'dbos')}"
    threads = ip.get("engine_concurrency")
    engine = f"sagaloop engine --concurrency {threads}" if threads else "sagaloop engine"
    fl = pooled_floor(results)
    seq_floor = fl.get("sequential", {}).get("p50_ms", math.nan)
    n_seq = plan["sequential_steps"]
    figs: list[Figure] = []

    s = ip["sequential"]
    ratio = s["p50_ms"] / peer["sequential"]["p50_ms"] if peer else math.nan
    note = (
        f"DBOS p50 {fmt_ms(peer['sequential']['p50_ms'])} / p99 "
        f"{fmt_ms(peer['sequential']['p99_ms'])}; "
        if peer
        else ""
    )
    figs.append(
        Figure(
            "11 in-process",
            f"sagaloop, local steps, 1 saga of {n_seq} steps, per-step p50 / p99",
            f"{fmt_ms(s['p50_ms'])} / {fmt_ms(s['p99_ms'])}",
            f"{fmt_ratio(ratio)} DBOS",
            f"p50 <= {INPROCESS_SEQUENTIAL}x DBOS p50",
            None if math.isnan(ratio) else bool(ratio <= INPROCESS_SEQUENTIAL),
            note + f"{fmt_ratio(s['p50_ms'] / seq_floor)} floor; engine CPU "
            f"{s['cpu_ms_per_step'][0]:.1f} ms per step; one {engine} process, no worker" + no_peer,
        )
    )
    for c in plan["concurrency"]:
        x = ip[f"concurrent_{c}"]
        other = peer.get(f"concurrent_{c}") if peer else None
        ratio = x["steps_per_s"] / other["steps_per_s"] if other else math.nan
        note = (
            f"DBOS {other['steps_per_s']:.0f} steps/s, p50 {fmt_ms(other['p50_ms'])}, "
            f"p99 {fmt_ms(other['p99_ms'])}; "
            if other
            else ""
        )
        target, met = "", None
        if c >= 8:
            target = f">= {INPROCESS_THROUGHPUT}x DBOS at {c}"
            met = None if math.isnan(ratio) else bool(ratio >= INPROCESS_THROUGHPUT)
        figs.append(
            Figure(
                "11 in-process",
                f"sagaloop, local steps, {c} concurrent sagas x 10 steps",
                f"{x['steps_per_s']:.0f} steps/s; p50 {fmt_ms(x['p50_ms'])}, "
                f"p99 {fmt_ms(x['p99_ms'])}",
                f"{fmt_ratio(ratio)} DBOS",
                target,
                met,
                note + f"{x['steps']} steps; engine CPU {x['cpu_ms_per_step'][0]:.1f} ms "
                "per step" + no_peer,
            )
        )
    return figs


def _trips(by_role: dict[str, Any], roles: Sequence[str]) -> tuple[float, str]:
    """Round trips per step of ``roles`` in all, and the share of each role."""
    parts, total = [], 0.0
    for role in roles:
        r = by_role.get(role, {})
        n = sum(v for k, v in r.items() if not k.startswith("_"))
        total += n
        parts.append(
            f"{role} {n:.1f} ({r.get('begin', 0):.1f} transactions, "
            f"{r.get('statements', 0):.1f} statements, {r.get('ping', 0):.1f} pings)"
        )
    return total, "; ".join(parts)


def _err(results: dict[str, Any], key: str) -> str:
    section = results.get(key)
    if section is None:
        return "not run"
    return f"FAILED: {section.get('error', '?')}"


def markdown(figs: list[Figure]) -> str:
    lines = [
        "| # | case | measured | ratio | target | verdict | notes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in figs:
        cells = [f.section, f.case, f.value, f.ratio, f.target, f.verdict, f.note]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def bounds(results: dict[str, Any]) -> str:
    """What bounds the figures: unit costs, round trips, CPU per step, segments, profile."""
    out: list[str] = []
    fl = pooled_floor(results)
    if fl:
        u = fl["unit_costs"]
        out.append(
            "Unit costs (p50): PostgreSQL round trip "
            f"{u['pg_round_trip_ms']:.3f} ms; write transaction with commit "
            f"{u['pg_write_commit_ms']:.2f} ms (psycopg), "
            f"{u['sqlalchemy_write_tx_ms']:.2f} ms (SQLAlchemy with sagaloop's engine options); "
            f"confirmed publish to a quorum queue {u['amqp_confirmed_publish_ms']:.2f} ms."
        )
    sg = results.get("sagaloop", {})
    if _ok(sg) and fl:
        seg = sg["sequential"].get("segments", {})
        cpu_s = sg["sequential"]["cpu_ms_per_step"]
        floor_cpu = fl["sequential"]["cpu_ms_per_step"]
        out.append(
            "Sequential step, p50 by segment: engine decision -> worker's reply transaction "
            f"{fmt_ms(seg.get('to_worker', math.nan))}; -> the next decision "
            f"{fmt_ms(seg.get('to_engine', math.nan))}. CPU per step: engine "
            f"{cpu_s[0]:.1f} ms + worker {cpu_s[1]:.1f} ms (floor: {floor_cpu[0]:.1f} + "
            f"{floor_cpu[1]:.1f} ms)."
        )
        for c in (8, 64):
            x = sg.get(f"concurrent_{c}")
            if x:
                seen = ""
                for probe in x.get("queues_mid_wave", []):
                    seen = "; RabbitMQ mid-wave: " + ", ".join(
                        f"{q} queue {ready} ready / {consumers} consumer(s)"
                        for q, (ready, consumers) in probe.items()
                    )
                out.append(
                    f"{c} concurrent: CPU per step engine {x['cpu_ms_per_step'][0]:.1f} ms + "
                    f"worker {x['cpu_ms_per_step'][1]:.1f} ms{seen}."
                )
    rt = results.get("roundtrips", {})
    if _ok(rt):
        total, parts = _trips(rt, ("engine", "relay", "worker"))
        text = (
            f"Database round trips per step: {total:.0f} ({parts}), against the floor's 10 "
            "(2 transactions of 3 inserts)"
        )
        ip = rt.get("inprocess")
        if _ok(ip):  # the engine's threads: activations, in-process steps (local-N), relay
            roles = [r for r in ("engine", "local", "relay", "other") if r in ip]
            total, parts = _trips(ip, roles)
            text += (
                f"; in-process: {total:.0f} round trips per step ({parts}), with `sagaloop "
                "engine` alone"
            )
        elif ip:
            text += f"; in-process: FAILED: {ip.get('error', '?')}"
        out.append(text + ".")
    ip = results.get("inprocess", {})
    if _ok(ip):
        cpu = ", ".join(
            f"{c} concurrent {ip[f'concurrent_{c}']['cpu_ms_per_step'][0]:.1f} ms"
            for c in (1, 8, 64)
            if f"concurrent_{c}" in ip
        )
        out.append(
            "In-process steps, CPU per step of the engine process (the only process): "
            f"sequential {ip['sequential']['cpu_ms_per_step'][0]:.1f} ms; {cpu}."
        )
    scaled = scale.bounds(results.get("scale"))
    if scaled:
        out.append(scaled)
    pr = results.get("profile", {})
    if _ok(pr):
        for role in ("engine", "worker"):
            p = pr.get(role)
            if not p:
                continue
            spots = "\n".join(
                f"  - {share:5.1%}  {label.strip()}" for label, share in p["hotspots"] if share
            )
            out.append(
                f"Profile of the {role} process (py-spy --gil over a sequential run of "
                f"{pr['steps']} steps: {p['samples']} samples, {p['ms_per_step']:.1f} ms of "
                f"GIL time per step), inclusive share of each hot spot:\n{spots}"
            )
    elif pr:
        out.append(f"Profile: {pr.get('error')}")
    return "\n\n".join(out)


def header(plan: dict[str, Any], results: dict[str, Any], command: str) -> str:
    import pika

    from benchmarks.common import rabbitmq_url

    try:
        conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url()))
        rabbit = conn._impl.server_properties.get("version", b"?")
        rabbit = rabbit.decode() if isinstance(rabbit, bytes) else str(rabbit)
        conn.close()
    except Exception:
        rabbit = "?"
    import os

    return (
        f"Run {results['started']} with `{command}`: {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, PostgreSQL 15 on 127.0.0.1, RabbitMQ {rabbit} "
        f"(quorum queues), load average at start {results['floor']['_load'][0]:.1f} "
        "(the machine is shared)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller run (about a minute)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument(
        "--from-json", type=Path, help="print the table of results saved with --json instead"
    )
    parser.add_argument(
        "--only",
        help="run only these sections (comma-separated, e.g. 'scale' or 'inprocess'), with the "
        "floor (and what they are compared with: DBOS for 'inprocess')",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    command = "make bench" + (" BENCH_ARGS=--quick" if args.quick else "")
    if args.only:
        command = f"python -m benchmarks.run{' --quick' if args.quick else ''} --only {args.only}"
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        results["floor"]["_load"] = tuple(results["floor"]["_load"])
    else:
        results = measure(plan, set(args.only.split(",")) if args.only else None)
    if args.json:  # first: the figures are kept even if the table cannot be made
        args.json.write_text(json.dumps(results, indent=1, default=str))
    figs = table(results, plan)
    text = "\n\n".join([header(plan, results, command), markdown(figs), bounds(results)])
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
