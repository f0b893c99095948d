"""The app of the chaos soak (tests/chaos/soak.py), run by real `sagaloop engine` and
`sagaloop worker` processes that the soak kills, stops and restarts.

Every run's input says which effects it makes: ``{"seq": [names], "par": [names]}``. The four
sagas of the mix are sequential effects (``seq``), a gather of concurrent effects (``fan``),
effects around a ``wait_for_event`` that the soak answers (``wait``), and effects followed by a
step that refuses, so that the run compensates every effect (``fail``). One effect of ``seq``
(its last) and of ``fail`` (its first, so its compensation too) is an in-process step
(``local_effect``: the same effect, run by the engines), which the soak kills like the others.

Effects go to a provider outside the engine: a SQLite ledger named by ``$LEDGER_PATH``. Like a
payment provider it honours idempotency keys (a key already applied is not applied again), and
it records every request it gets, so the soak can tell apart a step body that ran twice (allowed:
bodies run at least once) from an effect applied twice (a duplicate: never allowed).
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import time
from datetime import timedelta
from typing import Any

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext

app = App("soakapp")
RETRY = RetryPolicy(max_attempts=10, initial_interval=timedelta(milliseconds=100))
EVENT = "go"

SCHEMA = """
create table if not exists requests (
    id integer primary key autoincrement,
    key text not null, run_id text not null, name text not null, direction text not null,
    attempt int, in_doubt int, pid int, started real, finished real, outcome text
);
create table if not exists applied (
    id integer primary key autoincrement,
    key text not null, run_id text not null, name text not null, direction text not null,
    pid int, at real
);
create index if not exists applied_key on applied (key);
"""


def ledger() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60, isolation_level=None)
    conn.execute("pragma journal_mode=wal")
    conn.execute("pragma synchronous=normal")
    return conn


def create_ledger(path: str) -> None:
    """Create the ledger's tables (the soak does it once, before any process starts)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("pragma journal_mode=wal")
        conn.executescript(SCHEMA)
    finally:
        conn.close()


def _delay() -> None:
    low, _, high = os.environ.get("SOAK_STEP_DELAY", "0.05,0.25").partition(",")
    time.sleep(random.uniform(float(low), float(high or low)))


def apply(ctx: StepContext, name: str, direction: str) -> None:
    """The provider: record the request, take a while (a worker may be stopped or killed
    here), then apply the effect unless its idempotency key was applied already."""
    key = ctx.idempotency_key
    conn = ledger()
    try:
        request = conn.execute(
            "insert into requests (key, run_id, name, direction, attempt, in_doubt, pid, started)"
            " values (?, ?, ?, ?, ?, ?, ?, ?)",
            (key, ctx.run_id, name, direction, ctx.attempt, int(ctx.in_doubt), os.getpid(), now()),
        ).lastrowid
        _delay()
        conn.execute("begin immediate")
        seen = conn.execute("select 1 from applied where key = ?", (key,)).fetchone()
        if seen is None:
            conn.execute(
                "insert into applied (key, run_id, name, direction, pid, at)"
                " values (?, ?, ?, ?, ?, ?)",
                (key, ctx.run_id, name, direction, os.getpid(), now()),
            )
        conn.execute("commit")
        conn.execute(
            "update requests set finished = ?, outcome = ? where id = ?",
            (now(), "applied" if seen is None else "already applied", request),
        )
    finally:
        conn.close()


def applied(key: str) -> bool:
    conn = ledger()
    try:
        return conn.execute("select 1 from applied where key = ?", (key,)).fetchone() is not None
    finally:
        conn.close()


def now() -> float:
    return time.time()


@app.step(queue="work", retry=RETRY)
def effect(ctx: StepContext, name: str) -> str:
    apply(ctx, name, "do")
    return f"{name}:done"


@effect.compensation
def undo_effect(ctx: StepContext, name: str, result: str) -> None:
    apply(ctx, name, "undo")


@effect.reconcile
def find_effect(ctx: StepContext, name: str) -> str | None:
    return f"{name}:done" if applied(ctx.idempotency_key) else None


@app.step(local=True, retry=RETRY)
def local_effect(ctx: StepContext, name: str) -> str:
    """``effect`` as an in-process step, run by the engines (``local-N`` threads)."""
    apply(ctx, name, "do")
    return f"{name}:done"


@local_effect.compensation
def undo_local_effect(ctx: StepContext, name: str, result: str) -> None:
    apply(ctx, name, "undo")


@local_effect.reconcile
def find_local_effect(ctx: StepContext, name: str) -> str | None:
    return f"{name}:done" if applied(ctx.idempotency_key) else None


@app.step(queue="other", retry=RETRY)
def refuse(ctx: StepContext, reason: str) -> str:
    raise ApplicationError(f"refused: {reason}", non_retryable=True)


@app.saga(name="seq")
async def seq(ctx: SagaContext, plan: dict[str, Any]) -> list[str]:
    *first, last = plan["seq"]  # the last effect in-process
    return [*[await ctx.call(effect, n) for n in first], await ctx.call(local_effect, last)]


@app.saga(name="fan")
async def fan(ctx: SagaContext, plan: dict[str, Any]) -> list[str]:
    return list(await asyncio.gather(*(ctx.call(effect, n) for n in plan["par"])))


@app.saga(name="wait")
async def wait(ctx: SagaContext, plan: dict[str, Any]) -> list[str]:
    done = [await ctx.call(effect, n) for n in plan["seq"]]
    reply = await ctx.wait_for_event(EVENT, timeout=timedelta(hours=1))
    done += await asyncio.gather(*(ctx.call(effect, n) for n in plan["par"]))
    return [*done, str(reply)]


@app.saga(name="fail")
async def fail(ctx: SagaContext, plan: dict[str, Any]) -> None:
    for i, n in enumerate(plan["seq"]):
        await ctx.call(local_effect if i == 0 else effect, n)  # the first in-process: undone too
    await asyncio.gather(*(ctx.call(effect, n) for n in plan["par"]))
    await ctx.call(refuse, "the mix says so")
