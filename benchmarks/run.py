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
from collections.abc import Callable
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
    steps,
)
from benchmarks.common import Figure, fmt_ms, fmt_ratio, load_average, settle
from benchmarks.steps import err, ok, pooled_floor, trips

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
        waited = settle()
        t0, load0 = time.monotonic(), load_average()
        print(
            f"bench: {name} ... (after {waited:.0f} s for the load to settle)",
            file=sys.stderr,
            flush=True,
        )
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


def table(results: dict[str, Any], plan: dict[str, Any]) -> list[Figure]:
    figs: list[Figure] = []
    fl = pooled_floor(results)
    seq_floor = fl.get("sequential", {}).get("p50_ms", math.nan)
    tput_floor = fl.get("concurrent", {}).get("steps_per_s", math.nan)
    n_seq = plan["sequential_steps"]

    # 1. the floor; 2. sequential broker steps; 4. the peer, next to the figures it is
    # compared with; 3. broker throughput; 11. in-process steps (benchmarks/steps.py)
    figs.extend(steps.floor_figures(results, plan))
    figs.extend(steps.broker_figures(results, plan))
    figs.extend(steps.throughput_figures(results, plan))
    figs.extend(steps.inprocess_figures(results, plan))

    # 5. long agent loops
    lp = results.get("loops", {})
    if ok(lp):
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
        figs.append(Figure("5 agent loops", "", err(results, "loops")))

    # 6. waiting is free
    wt = results.get("waiting", {})
    if ok(wt):
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
        figs.append(Figure("6 waiting", "", err(results, "waiting")))

    # 7. recovery
    rc = results.get("recovery", {})
    if ok(rc):
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
        figs.append(Figure("7 recovery", "", err(results, "recovery")))

    # 8. the embedded default
    sq = results.get("sqlite", {})
    if ok(sq):
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
        figs.append(Figure("8 embedded", "", err(results, "sqlite")))

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
    if ok(sg) and fl:
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
    if ok(rt):
        total, parts = trips(rt, ("engine", "relay", "worker"))
        text = (
            f"Database round trips per step: {total:.0f} ({parts}), against the floor's 10 "
            "(2 transactions of 3 inserts)"
        )
        ip = rt.get("inprocess")
        if ok(ip):  # the engine's threads: activations, in-process steps (local-N), relay
            roles = [r for r in ("engine", "local", "relay", "other") if r in ip]
            total, parts = trips(ip, roles)
            text += (
                f"; in-process: {total:.0f} round trips per step ({parts}), with `sagaloop "
                "engine` alone"
            )
        elif ip:
            text += f"; in-process: FAILED: {ip.get('error', '?')}"
        out.append(text + ".")
    ip = results.get("inprocess", {})
    if ok(ip):
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
    if ok(pr):
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
