"""What the console's runs page costs the server on PostgreSQL with many runs (issue 26): a live
poll of a page that did not move, one that did, the first page and page 100 (by keyset cursor),
a search by run id prefix and by input text, each against the floor of a bare ``SELECT 1``
round trip on the same pool.

    python -m benchmarks.console_runs [--sizes 10000,100000] [--repeat 50]

A fresh database of its own gets the runs (one app, three sagas, mixed statuses; every tenth
run waiting on a timer), written straight to the table; the console runs in this process
(Starlette's test client, so a figure is the server's work without a socket). Each figure is the
median (and p90) of ``--repeat`` requests, in milliseconds. A size runs only if the previous
one took under two minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from starlette.testclient import TestClient

from benchmarks.common import fresh_database, percentile
from sagaloop.client import Client
from sagaloop.engine.listing import PAGE, RunOrder, run_cursor
from sagaloop.store import listing
from sagaloop.store import tables as t
from sagaloop.store.sql import SqlStore
from sagaloop.ui import create_app

APP = "bench-console"
SAGAS = ("refund", "charge", "triage")
STATUSES = ("completed", "completed", "completed", "failed", "waiting", "running", "cancelled")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
BUDGET = 120.0
"""Seconds a size may take for the next size to run."""


def fill(store: SqlStore, start: int, stop: int) -> None:
    """Runs ``start`` .. ``stop - 1``, one second apart, with their timers (waiting ones)."""
    batch = 5000
    for lo in range(start, stop, batch):
        runs, timers = [], []
        for i in range(lo, min(lo + batch, stop)):
            at = T0 + timedelta(seconds=i)
            status = "waiting" if i % 10 == 0 else STATUSES[i % len(STATUSES)]
            runs.append(
                {
                    "run_id": f"run-{i:07}",
                    "app": APP,
                    "saga": SAGAS[i % len(SAGAS)],
                    "status": status,
                    "input": {"order": f"O-{i}", "city": ("Paris", "Rome", "Oslo")[i % 3]},
                    "last_seq": 4,
                    "processed_seq": 4,
                    "created_at": at,
                    "updated_at": at + timedelta(milliseconds=i % 997),
                }
            )
            if status == "waiting":
                timers.append(
                    {
                        "app": APP,
                        "run_id": f"run-{i:07}",
                        "pos": 2,
                        "kind": "sleep",
                        "fire_at": at + timedelta(days=1),
                        "attempt": 0,
                    }
                )
        with store.engine.begin() as conn:
            conn.execute(t.runs.insert(), runs)
            if timers:
                conn.execute(t.timers.insert(), timers)
    # what autovacuum would have done by then: statistics, and the visibility map that lets
    # the counts by status read the index alone
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE sagaloop_runs"))


def timed(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    fn()  # warm: statement caches, pool
    samples = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - began) * 1000)
    return {"p50": statistics.median(samples), "p90": percentile(samples, 90)}


def expect(status: int, path: str, client: TestClient, **headers: str) -> Callable[[], Any]:
    def go() -> Any:
        response = client.get(path, headers=headers, follow_redirects=False)
        assert response.status_code == status, (path, response.status_code)
        return response

    return go


def plan(store: SqlStore, query: sa.Select[Any]) -> str:
    """The index names PostgreSQL's plan of ``query`` uses (or "seq scan")."""
    compiled = query.compile(store.engine, compile_kwargs={"literal_binds": True})
    with store.engine.connect() as conn:
        lines = [r[0] for r in conn.execute(sa.text(f"EXPLAIN {compiled}"))]
    used = sorted({w for line in lines for w in line.split() if w.startswith("sagaloop_runs")})
    return ", ".join(used) or "seq scan"


def measure(store: SqlStore, n: int, repeat: int) -> dict[str, dict[str, float] | str]:
    client = Client(store, APP)
    console = TestClient(create_app(client.scoped()), base_url="http://127.0.0.1:8765")
    scoped = client.scoped()

    def select_1() -> None:
        with store.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1")).scalar()

    first = console.get("/runs").text
    stamp = first.split("v=", 1)[1].split('"', 1)[0]
    etag = console.get("/runs/live").headers["etag"]
    cursor = None
    for _ in range(99):  # the cursor of page 100, as Next links walk to it
        page = scoped.list(limit=PAGE, after=cursor)
        cursor = run_cursor(page[-1], RunOrder.UPDATED_DESC)
    prefix = f"run-{n // 2:07}"[:-2]  # 100 runs share it
    whole = f"run-{n // 3:07}"
    q = listing.page_query(
        dialect="postgresql",
        status=None,
        saga=None,
        app=APP,
        limit=PAGE + 1,
        id_prefix=prefix,
        input_text=None,
        updated_since=None,
        order=RunOrder.UPDATED_DESC,
        after=None,
    )
    figures: dict[str, dict[str, float] | str] = {
        "floor: SELECT 1 round trip": timed(select_1, repeat),
        "floor: a request that reads nothing (GET /, 303)": timed(
            expect(303, "/", console), repeat
        ),
        "store: last_run_update (the poll's read)": timed(
            lambda: store.last_run_update(app=APP), repeat
        ),
        "poll, unchanged (?v=, 204)": timed(expect(204, f"/runs/live?v={stamp}", console), repeat),
        "poll, unchanged (If-None-Match, 304)": timed(
            expect(304, "/runs/live", console, **{"if-none-match": etag}), repeat
        ),
        "poll, changed (200, page re-rendered)": timed(
            expect(200, "/runs/live?v=old", console), repeat
        ),
        "page 1 (GET /runs)": timed(expect(200, "/runs", console), repeat),
        "page 100 (keyset cursor)": timed(expect(200, f"/runs?after={cursor}", console), repeat),
        "store: counts by status (count_runs)": timed(lambda: scoped.count(), repeat),
        "store: run_waits of a page": timed(
            lambda: store.run_waits(scoped.list(limit=PAGE, status="waiting")), repeat
        ),
        "store: page 100 (list_runs)": timed(
            lambda: scoped.list(limit=PAGE + 1, after=cursor), repeat
        ),
        f"search run id prefix {prefix!r}": timed(
            expect(200, f"/runs?q={prefix}", console), repeat
        ),
        "store: id prefix (list_runs)": timed(
            lambda: scoped.list(limit=PAGE + 1, id_prefix=prefix), repeat
        ),
        f"search a whole run id {whole!r}": timed(expect(200, f"/runs?q={whole}", console), repeat),
        "search input text (many match: one page read)": timed(
            expect(200, "/runs?q=O-7&field=input", console), max(repeat // 5, 3)
        ),
        "search input text (no match: every run read)": timed(
            expect(200, "/runs?q=nowhere&field=input", console), max(repeat // 5, 3)
        ),
        "plan of the id prefix search": plan(store, q),
    }
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with fresh_database() as url:
        store = SqlStore(url)
        store.upgrade()
        try:
            had = 0
            for n in sizes:
                began = time.perf_counter()
                fill(store, had, n)
                had = n
                filled = time.perf_counter() - began
                figures = measure(store, n, args.repeat)
                took = time.perf_counter() - began
                print(
                    f"\n{n:,} runs in PostgreSQL (filled in {filled:.1f} s; measured in "
                    f"{took - filled:.1f} s), ms p50 / p90:"
                )
                for name, value in figures.items():
                    if isinstance(value, str):
                        print(f"  {name:48} {value}")
                    else:
                        print(f"  {name:48} {value['p50']:7.2f} / {value['p90']:7.2f}")
                if took > BUDGET:
                    print(f"(took {took:.0f} s, over {BUDGET:.0f} s: larger sizes skipped)")
                    break
        finally:
            store.close()


if __name__ == "__main__":
    main()
