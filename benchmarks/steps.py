"""Rows 1 to 4 and 11 of ``make bench``: the step figures, each judged against issue 27's
targets with a ratio to a figure of the same run (the machine is shared and small: absolute
figures move from run to run, ratios much less).

- in-process steps ahead of DBOS: p50 at most 0.8x DBOS's, steps/s at least 1.5x DBOS's at 8
  and at 64 sagas;
- broker steps at the floor's cost: CPU per step (engine + worker) at most 2x the floor's
  (orchestrator + worker) in the same run, database round trips at most the floor's 10, p50 at
  most 1.5x the floor's, steps/s at 64 sagas at least DBOS's at 64 and at least the floor's
  (which runs 8 sagas with 2 consumers per role: its best).

A target whose reference failed or was not run (``--only``) has no verdict; a section that
failed misses its targets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.common import Figure, fmt_ms, fmt_ratio, latency

BROKER_SEQUENTIAL = 1.5  # broker steps: sequential p50 <= 1.5x the floor's
BROKER_CPU = 2.0  # broker steps: CPU per step, engine + worker, <= 2x the floor's of the run
BROKER_TRIPS = 10  # broker steps: database round trips per step <= the floor's
FLOOR_TRIPS = 10  # the floor's round trips per step: 2 transactions of BEGIN, 3 inserts, COMMIT
BROKER_THROUGHPUT = 1.0  # broker steps/s at 64 sagas >= 1.0x DBOS's at 64 and the floor's
INPROCESS_SEQUENTIAL = 0.8  # in-process steps: sequential p50 <= 0.8x DBOS's p50
INPROCESS_THROUGHPUT = 1.5  # in-process steps: steps/s at 8 and at 64 >= 1.5x DBOS's at each


def ok(section: Any) -> bool:
    return isinstance(section, dict) and bool(section) and "error" not in section


def err(results: dict[str, Any], key: str) -> str:
    section = results.get(key)
    if section is None:
        return "not run"
    return f"FAILED: {section.get('error', '?')}"


def at_most(ratio: float, limit: float) -> bool | None:
    """The verdict of ``ratio <= limit``; none when the ratio could not be made."""
    return None if math.isnan(ratio) or math.isinf(ratio) else bool(ratio <= limit)


def at_least(ratio: float, limit: float) -> bool | None:
    return None if math.isnan(ratio) or math.isinf(ratio) else bool(ratio >= limit)


def pooled_floor(results: dict[str, Any]) -> dict[str, Any]:
    """The floor's two measurements (start and end of the run) pooled: latencies from all
    samples, steps/s and CPU per step over both windows."""
    parts = [results[k] for k in ("floor", "floor_after") if ok(results.get(k))]
    if not parts:
        return {}
    out: dict[str, Any] = {}
    for case in ("sequential", "concurrent"):
        samples = [x for p in parts for x in p[case]["samples"]]
        steps = sum(p[case]["steps"] for p in parts)
        window = sum(p[case]["window_s"] for p in parts)
        out[case] = {**latency(samples), "steps_per_s": steps / window}
        out[case]["p50_each"] = [p[case]["p50_ms"] for p in parts]
        out[case]["cpu_ms_per_step"] = [
            sum(p[case]["cpu_ms_per_step"][i] * p[case]["steps"] for p in parts) / steps
            for i in (0, 1)
        ]
    out["unit_costs"] = parts[0]["unit_costs"]
    return out


def trips(by_role: dict[str, Any], roles: Sequence[str]) -> tuple[float, str]:
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


def floor_figures(results: dict[str, Any], plan: dict[str, Any]) -> list[Figure]:
    """Row 1: the floor, the reference of the broker targets."""
    fl = pooled_floor(results)
    if not fl:
        return [Figure("1 floor", "hand-made step", err(results, "floor"))]
    s, c = fl["sequential"], fl["concurrent"]
    spread = " / ".join(fmt_ms(x) for x in s["p50_each"])
    cpu = s["cpu_ms_per_step"]
    return [
        Figure(
            "1 floor",
            f"hand-made step, sequential ({plan['sequential_steps']} steps), p50 / p99",
            f"{fmt_ms(s['p50_ms'])} / {fmt_ms(s['p99_ms'])}",
            "1.00x",
            note=f"p50 at start / end of run: {spread}",
        ),
        Figure(
            "1 floor",
            "hand-made step, CPU per step, orchestrator + worker",
            f"{cpu[0]:.1f} + {cpu[1]:.1f} ms",
            "1.00x",
            note="sequential case; each process's CPU time over its waves, per step; "
            f"{FLOOR_TRIPS} database round trips per step",
        ),
        Figure(
            "1 floor",
            "hand-made, 8 sagas x 10 steps, 2 consumers per role",
            f"{c['steps_per_s']:.0f} steps/s; p50 {fmt_ms(c['p50_ms'])}, p99 {fmt_ms(c['p99_ms'])}",
            "1.00x",
        ),
    ]


def broker_figures(results: dict[str, Any], plan: dict[str, Any]) -> list[Figure]:
    """Row 2 (sequential broker steps: p50, CPU, round trips) and row 4 (DBOS's sequential
    figures, next to them)."""
    fl = pooled_floor(results)
    seq = fl.get("sequential", {})
    n_seq = plan["sequential_steps"]
    figs: list[Figure] = []
    sg = results.get("sagaloop", {})
    if ok(sg):
        s = sg["sequential"]
        ratio = s["p50_ms"] / seq.get("p50_ms", math.nan)
        figs.append(
            Figure(
                "2 sequential",
                f"sagaloop, 1 saga of {n_seq} steps, per-step p50",
                fmt_ms(s["p50_ms"]),
                fmt_ratio(ratio) + " floor",
                f"<= {BROKER_SEQUENTIAL}x floor",
                at_most(ratio, BROKER_SEQUENTIAL),
                "engine and worker as separate processes (sagaloop engine / worker)",
            )
        )
        cpu, floor_cpu = s["cpu_ms_per_step"], seq.get("cpu_ms_per_step", [math.nan] * 2)
        ratio = sum(cpu) / sum(floor_cpu)
        figs.append(
            Figure(
                "2 sequential",
                "sagaloop, CPU per step, engine + worker",
                f"{cpu[0]:.1f} + {cpu[1]:.1f} ms",
                fmt_ratio(ratio) + " floor",
                f"<= {BROKER_CPU:.0f}x floor",
                at_most(ratio, BROKER_CPU),
                "each process's CPU time (/proc) over the run, per step; the floor's "
                f"orchestrator + worker {floor_cpu[0]:.1f} + {floor_cpu[1]:.1f} ms (row 1)",
            )
        )
        rt = results.get("roundtrips", {})
        if ok(rt):
            total, _ = trips(rt, ("engine", "relay", "worker"))
            polls, _ = trips(rt, ("timers",))
            figs.append(
                Figure(
                    "2 sequential",
                    "sagaloop, database round trips per step",
                    f"{total:.1f}",
                    fmt_ratio(total / FLOOR_TRIPS) + " floor",
                    f"<= {BROKER_TRIPS} (the floor's)",
                    at_most(total, BROKER_TRIPS),
                    "engine, relay and worker threads, counted by SQLAlchemy's events "
                    f"(benchmarks/roundtrips.py, --poll 0.05: the relay's share includes its "
                    f"sweeps); the timer scheduler's polling adds {polls:.1f}",
                )
            )
        elif "roundtrips" in results:
            figs.append(
                Figure(
                    "2 sequential",
                    "sagaloop, database round trips per step",
                    err(results, "roundtrips"),
                    target=f"<= {BROKER_TRIPS} (the floor's)",
                    met=False,
                )
            )
        figs.append(
            Figure(
                "2 sequential",
                "sagaloop, per-step p99",
                fmt_ms(s["p99_ms"]),
                fmt_ratio(s["p99_ms"] / seq.get("p99_ms", math.nan)) + " floor",
                note="ratio to the floor's p99",
            )
        )
    else:
        figs.append(
            Figure(
                "2 sequential",
                "sagaloop",
                err(results, "sagaloop"),
                target="issue 27's broker targets",
                met=None if "sagaloop" not in results else False,
            )
        )

    db = results.get("dbos", {})
    if ok(db):
        d = db["sequential"]
        vs = sg["sequential"]["p50_ms"] / d["p50_ms"] if ok(sg) else math.nan
        figs.append(
            Figure(
                "4 peer",
                f"DBOS Transact {db.get('version', '')}, 1 workflow of {n_seq} steps, "
                "per-step p50 / p99",
                f"{fmt_ms(d['p50_ms'])} / {fmt_ms(d['p99_ms'])}",
                f"{fmt_ratio(d['p50_ms'] / seq.get('p50_ms', math.nan))} floor",
                note=f"sagaloop's broker step is {fmt_ratio(vs)} DBOS; DBOS runs steps "
                "in-process (no broker): row 11 compares sagaloop's in-process steps",
            )
        )
    else:
        figs.append(
            Figure(
                "4 peer",
                "DBOS Transact",
                err(results, "dbos"),
                met=None if "dbos" not in results else False,  # a failure misses; --only skips
            )
        )
    return figs


def throughput_figures(results: dict[str, Any], plan: dict[str, Any]) -> list[Figure]:
    """Row 3: broker steps/s at 1, 8 and 64 sagas; at 64 against DBOS's at 64 and the
    floor's (8 sagas)."""
    sg = results.get("sagaloop", {})
    if not ok(sg):
        return []
    fl = pooled_floor(results)
    tput_floor = fl.get("concurrent", {}).get("steps_per_s", math.nan)
    db = results.get("dbos", {})
    figs: list[Figure] = []
    for c in plan["concurrency"]:
        x = sg[f"concurrent_{c}"]
        peer = db.get(f"concurrent_{c}") if ok(db) else None
        vs_floor = x["steps_per_s"] / tput_floor
        vs_dbos = x["steps_per_s"] / peer["steps_per_s"] if peer else math.nan
        note = f"{x['steps']} steps"
        if peer:
            note += f"; DBOS {peer['steps_per_s']:.0f} steps/s, p99 {fmt_ms(peer['p99_ms'])}"
        ratio, target, met = fmt_ratio(vs_floor) + " floor-8", "", None
        if c == 64:
            ratio += f", {fmt_ratio(vs_dbos)} DBOS"
            target = f">= {BROKER_THROUGHPUT}x DBOS at 64 and >= {BROKER_THROUGHPUT}x floor-8"
            verdicts = (at_least(vs_dbos, BROKER_THROUGHPUT), at_least(vs_floor, 1.0))
            met = False if False in verdicts else None if None in verdicts else True
        elif peer:
            ratio += f", {fmt_ratio(vs_dbos)} DBOS"
        figs.append(
            Figure(
                "3 throughput",
                f"sagaloop, {c} concurrent sagas x 10 steps",
                f"{x['steps_per_s']:.0f} steps/s; p50 {fmt_ms(x['p50_ms'])}, "
                f"p99 {fmt_ms(x['p99_ms'])}",
                ratio,
                target,
                met,
                note,
            )
        )
        if c == 8:
            p99 = fl.get("concurrent", {}).get("p99_ms", math.nan)
            figs.append(
                Figure(
                    "3 throughput",
                    "sagaloop, 8 concurrent sagas, per-step p99",
                    fmt_ms(x["p99_ms"]),
                    fmt_ratio(x["p99_ms"] / p99) + " floor",
                    note="ratio to the floor's p99 at 8",
                )
            )
    return figs


def _dbos_cpu(case: dict[str, Any]) -> str:
    """DBOS's CPU per step (its one process, GIL-bound as sagaloop's engine is: the throughput
    ratio at 8 and 64 sagas follows the ratio of the two), if the run measured it."""
    cpu = case.get("cpu_ms_per_step")
    return "" if cpu is None else f", CPU {cpu:.1f} ms per step (its one process)"


def inprocess_figures(results: dict[str, Any], plan: dict[str, Any]) -> list[Figure]:
    """Row 11: in-process steps (``chain_local`` on one ``sagaloop engine`` process, no
    worker), each figure next to DBOS's of the same run."""
    targets = (
        f"p50 <= {INPROCESS_SEQUENTIAL}x DBOS p50; "
        f"steps/s at 8 and 64 >= {INPROCESS_THROUGHPUT}x DBOS's"
    )
    if not ok(results.get("inprocess")):
        # a failure misses; a section skipped with --only does not
        met = None if "inprocess" not in results else False
        return [Figure("11 in-process", "", err(results, "inprocess"), target=targets, met=met)]
    ip: dict[str, Any] = results["inprocess"]
    db = results.get("dbos", {})
    peer = db if ok(db) else None
    no_peer = "" if peer else f"; DBOS {err(results, 'dbos')}"
    threads = ip.get("engine_concurrency")
    engine = f"sagaloop engine --concurrency {threads}" if threads else "sagaloop engine"
    seq_floor = pooled_floor(results).get("sequential", {}).get("p50_ms", math.nan)
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
            f"sagaloop, local steps, 1 saga of {plan['sequential_steps']} steps, "
            "per-step p50 / p99",
            f"{fmt_ms(s['p50_ms'])} / {fmt_ms(s['p99_ms'])}",
            f"{fmt_ratio(ratio)} DBOS",
            f"p50 <= {INPROCESS_SEQUENTIAL}x DBOS p50",
            at_most(ratio, INPROCESS_SEQUENTIAL),
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
            f"p99 {fmt_ms(other['p99_ms'])}{_dbos_cpu(other)}; "
            if other
            else ""
        )
        target, met = "", None
        if c >= 8:
            target = f">= {INPROCESS_THROUGHPUT}x DBOS at {c}"
            met = at_least(ratio, INPROCESS_THROUGHPUT)
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
