"""Database round trips per step, counted: a sagaloop ``Runtime`` (engine, worker, relay and
timers as threads of this process) runs a sequential saga on RabbitMQ + PostgreSQL while
SQLAlchemy's events count, per thread role, the statements, the transactions (each one a
``BEGIN`` and a ``COMMIT`` or ``ROLLBACK`` round trip; an autocommit read sends neither, so
only its statement counts) and the pings of pooled connections (a round trip each). The floor
needs 10 per step: two transactions of three inserts.

Counted twice: ``chain`` (steps on a worker) with the roles of ``sagaloop engine`` and
``sagaloop worker`` together, and ``chain_local`` (in-process steps) with only those of
``sagaloop engine`` (no worker), as :func:`count_all` reports them."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from sqlalchemy import event

from benchmarks import benchapp
from benchmarks.common import (
    count_driver_reads,
    delete_rabbit,
    fresh_database,
    namespace,
    rabbitmq_url,
    wait_until,
)
from benchmarks.sagaloop_bench import ENGINE_THREADS
from sagaloop.brokers.rabbitmq import RabbitBroker
from sagaloop.client import Client
from sagaloop.runtime.service import Runtime
from sagaloop.store.sql import SqlStore

FLOOR = {"statements": 6, "begin": 2, "commit": 2, "ping": 0}


def _role() -> str:
    name = threading.current_thread().name
    for role in ("engine", "worker", "relay", "timers", "step", "local"):
        if name.startswith(role):
            return role
    return "other"


def count_all(steps: int) -> dict[str, Any]:
    """:func:`count` of ``chain`` (by role: engine, relay, worker...) and, under
    ``"inprocess"``, of ``chain_local`` with the engine's roles only (or its error)."""
    out: dict[str, Any] = dict(count(steps))
    try:
        out["inprocess"] = count(steps, in_process=True)
    except Exception as e:
        out["inprocess"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out


def count(steps: int, *, in_process: bool = False) -> dict[str, dict[str, float]]:
    """Round trips per step by thread role and kind, over a sequential run of ``steps``:
    of ``chain`` with an engine and a worker, or with ``in_process``, of ``chain_local`` with
    only an engine (as ``sagaloop engine`` runs it: no worker threads)."""
    amqp, ns = rabbitmq_url(), namespace("trips")
    with fresh_database() as url:
        store = SqlStore(url)
        store.upgrade()
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        on = threading.Event()

        def hit(kind: str) -> Any:
            def listener(*_: Any, **__: Any) -> None:
                if on.is_set():
                    counts[(_role(), kind)] += 1

            return listener

        def hit_transaction(kind: str) -> Any:
            def listener(conn: Any, *_: Any) -> None:
                # An autocommit read sends no BEGIN and no ROLLBACK: its statement is its trip.
                autocommit = conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
                if on.is_set() and not autocommit:
                    counts[(_role(), kind)] += 1

            return listener

        event.listen(store.engine, "before_cursor_execute", hit("statements"))
        undo_reads = count_driver_reads(hit("statements"))
        event.listen(store.engine, "begin", hit_transaction("begin"))
        event.listen(store.engine, "commit", hit_transaction("commit"))
        event.listen(store.engine, "rollback", hit_transaction("rollback"))
        ping, count_ping = store.engine.dialect.do_ping, hit("ping")

        def counted_ping(dbapi_conn: Any) -> bool:
            count_ping()
            return ping(dbapi_conn)

        store.engine.dialect.do_ping = counted_ping  # type: ignore[method-assign]
        broker = RabbitBroker(amqp, namespace=ns, signing_key=store.signing_key())
        if in_process:
            saga: Any = benchapp.chain_local
            runtime = Runtime(
                benchapp.app, store, broker, queues=[], concurrency=ENGINE_THREADS, poll=0.05
            )
        else:
            saga = benchapp.chain
            runtime = Runtime(benchapp.app, store, broker, concurrency=2, poll=0.05)
        runtime.start()
        client = Client(store, benchapp.app)
        try:
            warm = client.start(saga, 3)
            wait_until(lambda: client.get(warm).status == "completed", 60, "warm-up")
            on.set()
            run_id = client.start(saga, steps)
            wait_until(lambda: client.get(run_id).status == "completed", 60 + steps, "the run")
            on.clear()
            time.sleep(0.2)
        finally:
            runtime.stop()
            undo_reads()
            broker.close()
            store.close()
            queues = [f"{ns}.bench.engine", f"{ns}.bench.steps.bench", f"{ns}.dead"]
            delete_rabbit(amqp, queues, [ns, f"{ns}.dlx"])
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for (role, kind), n in sorted(counts.items()):
        out[role][kind] = n / steps
    return dict(out)


if __name__ == "__main__":
    import json

    print(json.dumps(count_all(50), indent=1))
