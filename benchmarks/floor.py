"""The floor: a hand-made saga-step round trip with plain psycopg 3 and pika, and nothing else.

Per step, on the critical path, 2 commits and 2 confirmed publishes, as sagaloop's design
needs at least:

1. the orchestrator, on a reply (or the start): one transaction (inbox insert of the reply,
   a business row, an outbox insert of the next task), commit; publish the task with a
   publisher confirm; ack the reply;
2. a worker consumes the task: one transaction (inbox insert, a business row, an outbox insert
   of the reply), commit; publish the reply with a confirm; ack the task.

Same guarantees as sagaloop's defaults: durable quorum queues, persistent messages, publisher
confirms with ``mandatory``, manual acks after the commit. The orchestrator runs in this
process, the worker in a child process (as sagaloop's engine and worker do). What the floor
leaves out is a relay (it publishes right after its own commit) and deleting sent outbox rows
(done after the run, off the clock): a crash between commit and publish would need a sweeper,
which costs nothing on the critical path.

Per-step latency is the time between two consecutive orchestrator transactions of one saga,
the same span as between two ``step_scheduled`` events of a sagaloop run.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import resource
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pika
import psycopg

from benchmarks.common import (
    cpu_seconds,
    delete_rabbit,
    fresh_database,
    latency,
    percentile,
    rabbitmq_url,
)

SCHEMA = """
CREATE TABLE floor_inbox (consumer text, message_id text, at timestamptz NOT NULL DEFAULT now(),
                          PRIMARY KEY (consumer, message_id));
CREATE TABLE floor_history (saga_id text, seq int, data text NOT NULL,
                            at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (saga_id, seq));
CREATE TABLE floor_effects (key text PRIMARY KEY, result text NOT NULL);
CREATE TABLE floor_outbox (id bigserial PRIMARY KEY, queue text NOT NULL, body bytea NOT NULL,
                           created_at timestamptz NOT NULL DEFAULT now());
"""
QUORUM = {"x-queue-type": "quorum"}
PERSISTENT = pika.BasicProperties(content_type="application/json", delivery_mode=2)


class _Amqp:
    """One connection with a consuming channel and a confirming publishing channel."""

    def __init__(self, url: str, exchange: str, queue: str, prefetch: int) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        self.exchange = exchange
        self.pub = self.conn.channel()
        self.pub.confirm_delivery()
        self.sub = self.conn.channel()
        self.sub.basic_qos(prefetch_count=prefetch)
        self.queue = queue

    def publish(self, key: str, body: bytes) -> None:
        # BlockingChannel with confirms: returns once the broker confirmed (raises if not).
        self.pub.basic_publish(self.exchange, key, body, PERSISTENT, mandatory=True)

    def messages(self, stop: Callable[[], bool]) -> Any:
        for method, _props, body in self.sub.consume(self.queue, inactivity_timeout=0.05):
            if stop():
                break
            if method is not None:
                yield method.delivery_tag, body

    def ack(self, tag: int) -> None:
        self.sub.basic_ack(tag)

    def close(self) -> None:
        try:
            self.sub.cancel()
            self.conn.close()
        except Exception:
            pass


def declare(url: str, ns: str) -> tuple[str, str, str]:
    exchange, tasks, replies = ns, f"{ns}.tasks", f"{ns}.replies"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare(exchange, "topic", durable=True)
    for q in (tasks, replies):
        ch.queue_declare(q, durable=True, arguments=QUORUM)
        ch.queue_bind(q, exchange, routing_key=q)
    conn.close()
    return exchange, tasks, replies


# --- the worker (a child process) ------------------------------------------------------------


def _worker_thread(db: str, amqp: str, exchange: str, tasks: str, stop: Any) -> None:
    bus = _Amqp(amqp, exchange, tasks, prefetch=16)
    with psycopg.connect(db) as conn:
        for tag, body in bus.messages(stop.is_set):
            task = json.loads(body)
            reply = {"id": f"r:{task['id']}", "saga": task["saga"], "step": task["step"]}
            out = json.dumps(reply).encode()
            conn.execute(
                "INSERT INTO floor_inbox (consumer, message_id) VALUES ('worker', %s)",
                (task["id"],),
            )
            conn.execute(
                "INSERT INTO floor_effects (key, result) VALUES (%s, %s)",
                (f"{task['saga']}/{task['step']}", "ok"),
            )
            conn.execute("INSERT INTO floor_outbox (queue, body) VALUES (%s, %s)", (tasks, out))
            conn.commit()
            bus.publish(task["reply_to"], out)
            bus.ack(tag)
    bus.close()


def _worker_main(db: str, amqp: str, exchange: str, tasks: str, threads: int, stop: Any) -> None:
    pool = [
        threading.Thread(target=_worker_thread, args=(db, amqp, exchange, tasks, stop))
        for _ in range(threads)
    ]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


# --- the orchestrator (this process) ---------------------------------------------------------


class _Orchestrator:
    def __init__(self, db: str, amqp: str, exchange: str, tasks: str, replies: str) -> None:
        self.db, self.amqp = db, amqp
        self.exchange, self.tasks, self.replies = exchange, tasks, replies
        self.lock = threading.Lock()
        self.issued: dict[str, list[float]] = {}  # saga -> time of each orchestrator tx
        self.steps: dict[str, int] = {}
        self.left = 0
        self.done = threading.Event()
        self.stopping = threading.Event()

    def wave(self, sagas: int, steps: int, consumers: int) -> tuple[float, list[float]]:
        """Run ``sagas`` sagas of ``steps`` steps at once; return the window and the gaps."""
        ids = [uuid.uuid4().hex[:12] for _ in range(sagas)]
        with self.lock:
            self.issued = {s: [] for s in ids}
            self.steps = dict.fromkeys(ids, steps)
            self.left = sagas
            self.done.clear()
        self.stopping.clear()
        threads = [threading.Thread(target=self._consume) for _ in range(consumers)]
        for t in threads:
            t.start()
        bus = _Amqp(self.amqp, self.exchange, self.replies, prefetch=16)
        started = time.time()
        with psycopg.connect(self.db) as conn:
            for s in ids:
                self._advance(conn, bus, s, f"start:{s}", 0)
        self.done.wait(300)
        finished = time.time()
        self.stopping.set()
        for t in threads:
            t.join()
        bus.close()
        gaps = [b - a for times in self.issued.values() for a, b in itertools.pairwise(times)]
        return finished - started, gaps

    def _advance(
        self, conn: psycopg.Connection[Any], bus: _Amqp, saga: str, msg: str, k: int
    ) -> None:
        """The orchestrator transaction after step ``k`` of ``saga`` (0: the start)."""
        with self.lock:
            self.issued[saga].append(time.time())
            last = k >= self.steps[saga]
        conn.execute(
            "INSERT INTO floor_inbox (consumer, message_id) VALUES ('orchestrator', %s)", (msg,)
        )
        conn.execute(
            "INSERT INTO floor_history (saga_id, seq, data) VALUES (%s, %s, %s)",
            (saga, k, "finished" if last else f"scheduled {k + 1}"),
        )
        body = b""
        if not last:
            task = {
                "id": f"t:{saga}:{k + 1}",
                "saga": saga,
                "step": k + 1,
                "reply_to": self.replies,
            }
            body = json.dumps(task).encode()
            conn.execute(
                "INSERT INTO floor_outbox (queue, body) VALUES (%s, %s)", (self.tasks, body)
            )
        conn.commit()
        if last:
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.done.set()
        else:
            bus.publish(self.tasks, body)

    def _consume(self) -> None:
        bus = _Amqp(self.amqp, self.exchange, self.replies, prefetch=16)
        with psycopg.connect(self.db) as conn:
            for tag, body in bus.messages(self.stopping.is_set):
                reply = json.loads(body)
                self._advance(conn, bus, reply["saga"], reply["id"], reply["step"])
                bus.ack(tag)
        bus.close()


def measure(
    *, sequential_steps: int, waves: int, sagas: int = 8, steps: int = 10
) -> dict[str, Any]:
    """The floor's sequential latency (one saga of ``sequential_steps``, one consumer per role)
    and its throughput (``waves`` waves of ``sagas`` sagas of ``steps``, two consumers per
    role)."""
    amqp = rabbitmq_url()
    ns = f"bench-floor-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {}
    with fresh_database() as db:
        with psycopg.connect(db) as conn:
            conn.execute(SCHEMA)  # type: ignore[arg-type]
        exchange, tasks, replies = declare(amqp, ns)
        try:
            for label, n_sagas, n_steps, consumers, n_waves in (
                ("sequential", 1, sequential_steps, 1, 1),
                ("concurrent", sagas, steps, 2, waves),
            ):
                ctx = multiprocessing.get_context("spawn")
                stop = ctx.Event()
                worker = ctx.Process(
                    target=_worker_main, args=(db, amqp, exchange, tasks, consumers, stop)
                )
                worker.start()
                orch = _Orchestrator(db, amqp, exchange, tasks, replies)
                orch.wave(1, 3, consumers)  # warm-up: connections, prepared statements
                window, gaps = 0.0, []
                assert worker.pid is not None
                cpu0 = (_self_cpu(), cpu_seconds(worker.pid))
                for _ in range(n_waves):
                    w, g = orch.wave(n_sagas, n_steps, consumers)
                    window += w
                    gaps += g
                cpu = (_self_cpu() - cpu0[0], cpu_seconds(worker.pid) - cpu0[1])
                stop.set()
                worker.join(30)
                out[label] = {
                    **latency(gaps),
                    "steps": len(gaps),
                    "steps_per_s": len(gaps) / window,
                    "consumers": consumers,
                    "cpu_ms_per_step": [c / len(gaps) * 1000 for c in cpu],
                    "window_s": window,
                    "samples": gaps,
                }
            out["unit_costs"] = unit_costs(db, amqp, exchange, tasks)
        finally:
            delete_rabbit(amqp, [tasks, replies], [exchange])
    return out


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def unit_costs(db: str, amqp: str, exchange: str, queue: str, n: int = 200) -> dict[str, float]:
    """p50 in ms of the unit operations a step is made of, on this machine now: a PostgreSQL
    round trip, a write transaction (BEGIN, an insert, COMMIT: WAL flush), the same one-row
    transaction through SQLAlchemy with sagaloop's engine options (its pool checks included),
    and a publish confirmed by RabbitMQ on a quorum queue."""
    from sagaloop.store.connect import create_sa_engine

    def p50(fn: Callable[[], object], count: int) -> float:
        samples = []
        for _ in range(count):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return percentile(samples, 50) * 1000

    out: dict[str, float] = {}
    with psycopg.connect(db, autocommit=True) as conn:
        out["pg_round_trip_ms"] = p50(lambda: conn.execute("SELECT 1"), n)
    with psycopg.connect(db) as conn:

        def write() -> None:
            conn.execute("INSERT INTO floor_effects VALUES (%s, 'x')", (uuid.uuid4().hex,))
            conn.commit()

        out["pg_write_commit_ms"] = p50(write, n // 2)
    engine = create_sa_engine(db, pool_size=1)
    try:
        import sqlalchemy as sa

        stmt = sa.text("INSERT INTO floor_effects VALUES (:k, 'x')")

        def sa_write() -> None:
            with engine.begin() as c:
                c.execute(stmt, {"k": uuid.uuid4().hex})

        out["sqlalchemy_write_tx_ms"] = p50(sa_write, n // 2)
    finally:
        engine.dispose()
    bus = _Amqp(amqp, exchange, queue, prefetch=1)
    body = b'{"unit": true}'
    out["amqp_confirmed_publish_ms"] = p50(lambda: bus.publish(queue, body), n // 2)
    bus.sub.queue_purge(queue)
    bus.close()
    return out


if __name__ == "__main__":
    result = measure(sequential_steps=200, waves=5)
    for part in ("sequential", "concurrent"):
        result[part].pop("samples")
    print(json.dumps(result, indent=2))
