"""Row 12: the pending approvals, listed with many runs waiting (issue 22).

One real run asks for an approval on a fresh PostgreSQL database; its rows (run, history,
approvals index) are then copied in SQL until ``waiting`` runs wait, each with its own run id.
Measured, with that many waiting: a page of ``Client.approvals`` (the CLI's and MCP's
listing), the console's ``/approvals`` page, and the console's 2-second poll that finds
nothing new (``/approvals/live?v=STAMP``: 204). Next to them, the floor of the same run: one
run read by its key (``Client.get``).

The console is driven as a server drives it: one event loop for all requests (Starlette's
``TestClient`` used as a context manager). Outside one, the test client starts a thread and an
event loop for every request, which on this loaded 2-core machine adds 1 to 2 ms to each and
20 to 60 ms to some: a cost of the test client, not of the console. The poll is timed
``POLLS`` times after one untimed poll, so its p99 is not its slowest sample; the slowest is
shown (a collection of the benchmark process's heap or another process's burst can land in
one sample).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import sqlalchemy as sa

from benchmarks.common import Figure, fmt_ms, fmt_ratio, fresh_database, latency
from sagaloop import App, SagaContext
from sagaloop.client import Client
from sagaloop.testing import Harness

PAGE_MS = 200.0
PAGE_KB = 200.0
POLL_MS = 20.0
REPEAT = 30
POLLS = 200

app = App("bench-approvals")


@app.saga(name="refund")
async def refund(ctx: SagaContext, cents: int) -> bool:
    ok = await ctx.approval("issue_refund", {"customer": "ann", "cents": cents}, reason="late")
    return ok.approved


def _copy_waiting(store: Any, run_id: str, n: int) -> None:
    """Copy the waiting run ``run_id`` (its run row, history and approval) ``n - 1`` times."""
    copies = "SELECT g FROM generate_series(1, :n) AS g"
    with store.engine.begin() as conn:
        for table, columns in (
            (
                "sagaloop_runs",
                "app, saga, status, input, output, error, reason, last_seq, "
                "processed_seq, created_at, updated_at",
            ),
            ("sagaloop_history", "seq, kind, pos, name, data, at"),
            (
                "sagaloop_approvals",
                "call_id, app, saga, status, request, request_id, "
                "requested_at + g * interval '1 millisecond', answer_id, answer, updated_at",
            ),
        ):
            target = columns.replace(" + g * interval '1 millisecond'", "")
            conn.execute(
                sa.text(
                    f"INSERT INTO {table} (run_id, {target}) SELECT :run || '-' || g, {columns} "
                    f"FROM {table}, ({copies}) AS c WHERE run_id = :run"
                ),
                {"run": run_id, "n": n - 1},
            )


def _timed(fn: Any, repeat: int = REPEAT) -> tuple[dict[str, float], Any]:
    samples, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t0)
    return {**latency(samples), "max_ms": max(samples) * 1000}, out


def measure(waiting: int) -> dict[str, Any]:
    from starlette.testclient import TestClient

    from sagaloop.ui import create_app

    with fresh_database() as url:
        env = Harness(app, url=url)
        try:
            run_id = env.start(refund, 1299)
            env.run_until_idle(skip_time=False)
            _copy_waiting(env.store, run_id, waiting)
            with env.store.engine.connect() as conn:
                conn.execute(sa.text("ANALYZE"))
            client = Client(env.store, app)
            listed = len(client.approvals(limit=1000))
            floor, _ = _timed(lambda: client.get(run_id))
            first, page = _timed(lambda: client.approvals(limit=50))
            middle_at = client.approvals(limit=1000)[-1].cursor  # 1,000 in
            middle, _ = _timed(lambda: client.approvals(after=middle_at, limit=50))
            page_bytes = len(json.dumps([p.model_dump(mode="json") for p in page]).encode())
            with TestClient(create_app(client, app), base_url="http://127.0.0.1:8765") as console:
                html, body = _timed(lambda: console.get("/approvals"), 10)
                stamp = body.text.split("/approvals/live?v=", 1)[1].split('"', 1)[0]
                console.get(f"/approvals/live?v={stamp}")  # untimed: the first poll
                poll, answer = _timed(lambda: console.get(f"/approvals/live?v={stamp}"), POLLS)
            return {
                "waiting": env.store.count_runs().get("waiting", 0),
                "listed_first_1000": listed,
                "floor": floor,
                "page": first,
                "page_middle": middle,
                "page_kb": page_bytes / 1024,
                "console": html,
                "console_kb": len(body.content) / 1024,
                "poll": poll,
                "poll_status": answer.status_code,
            }
        finally:
            env.close()


def figures(result: dict[str, Any] | None) -> list[Figure]:
    if not result or "error" in result:
        error = (result or {}).get("error", "not run")
        return [Figure("12 approvals", "", f"failed: {error}")]
    n, floor = result["waiting"], result["floor"]["p50_ms"]
    figs = []
    for key, case, size in (
        ("page", "Client.approvals (CLI, MCP), first page of 50", result["page_kb"]),
        ("page_middle", "Client.approvals, a page 1,000 in", result["page_kb"]),
        ("console", "the console's /approvals page", result["console_kb"]),
    ):
        x = result[key]
        figs.append(
            Figure(
                "12 approvals",
                f"{case}, {n:,} runs waiting, p50 / p99",
                f"{fmt_ms(x['p50_ms'])} / {fmt_ms(x['p99_ms'])}; {size:.0f} KB",
                fmt_ratio(x["p50_ms"] / floor) + " floor",
                f"< {PAGE_MS:.0f} ms and < {PAGE_KB:.0f} KB",
                x["p99_ms"] < PAGE_MS and size < PAGE_KB,
                "floor: one run read by its key (Client.get) in the same run",
            )
        )
    poll = result["poll"]
    figs.append(
        Figure(
            "12 approvals",
            f"the console's poll that finds nothing new, {n:,} waiting, p50 / p99",
            f"{fmt_ms(poll['p50_ms'])} / {fmt_ms(poll['p99_ms'])} (HTTP {result['poll_status']})",
            fmt_ratio(poll["p50_ms"] / floor) + " floor",
            f"p99 < {POLL_MS:.0f} ms",
            poll["p99_ms"] < POLL_MS and result["poll_status"] == 204,
            f"{poll['n']} polls after an untimed one, on one event loop (as a server); the "
            f"slowest {fmt_ms(poll.get('max_ms', math.nan))}",
        )
    )
    return figs
