"""A three-node RabbitMQ cluster under real `sagaloop engine` and `sagaloop worker` processes,
given the URL list of the nodes (``SAGALOOP_BROKER_URL=amqp://…node1,amqp://…node2,…``).

The cluster is private (tests/integration/private_rabbit.py: three nodes on their own ports,
node names and directories, one Erlang cookie, joined with ``rabbitmqctl join_cluster``); the
store is a fresh database on the shared PostgreSQL. The queues are quorum queues with a member
on every node. While runs are in flight the node that leads the engine queue's and the step
queue's quorum (``rabbitmq-queues quorum_status``) is stopped, then started again: every run
completes, each effect is applied once (a ledger outside the engine counts them), and nothing
is dead-lettered.

The engine and the first worker list the nodes from the first: they are connected to the
leader and lose their connection with it. The second worker lists them from the second node:
it keeps its connection and only sees the queue's leader change.

The soak (``CLUSTER_SOAK=1``, marker ``soak``: `make chaos CLUSTER=1` runs it) does the same in
a loop for ``CLUSTER_SOAK_SECONDS`` (default 240) with SIGKILLs: of the engine or a worker, and
of the leading node (every other time a clean stop instead); a process killed while the node is
down starts again without it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pika
import pika.exceptions
import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
if str(INTEGRATION) not in sys.path:
    sys.path.insert(0, str(INTEGRATION))

from private_rabbit import PrivateCluster, PrivateRabbit, private_cluster  # noqa: E402, F401
from system import System  # noqa: E402

from sagaloop.testing import eventually  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

EFFECTS = "select key, step from effects"  # one row per idempotency key: run/position/do


def rss_mb(pid: int) -> int | None:
    """The resident memory of process ``pid`` (``VmRSS``, as ``ps -o rss`` shows it), MB."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return round(kb / 1024)


class Progress:
    """Samples how many step bodies ran (the ledger's ``bodies``) every 0.1 s, to measure how
    long the work stalled around a failure."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def bodies(self) -> int:
        rows = self.system.ledger("select count(*) from bodies")
        return int(rows[0][0]) if rows else 0

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append((time.monotonic(), self.bodies()))

    def stall(self, since: float, until: float) -> float:
        """The longest time without a new step body between ``since`` and ``until``."""
        last, longest, seen = since, 0.0, None
        for at, n in self.samples:
            if at < since or at > until:
                continue
            if seen is not None and n > seen:
                longest, last = max(longest, at - last), at
            seen = n
        return max(longest, until - last)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Cluster:
    """The system of the test on the cluster: names, leaders, logs and the checks."""

    def __init__(self, cluster: PrivateCluster, system: System) -> None:
        self.cluster = cluster
        self.system = system
        prefix = f"{system.namespace}.itapp"
        self.engine_queue = f"{prefix}.engine"
        self.step_queues = [f"{prefix}.steps.work", f"{prefix}.steps.other"]

    def urls_from(self, first: int) -> str:
        nodes = self.cluster.nodes
        return ",".join(n.url for n in nodes[first:] + nodes[:first])

    def logs(self, role: str) -> list[str]:
        return [
            p.read_text(errors="replace") for p in sorted(self.system.tmp.glob(f"{role}-*.log"))
        ]

    def ready(self, role: str, count: int) -> None:
        eventually(
            lambda: sum(f"{role}: app" in log for log in self.logs(role)) >= count,
            60,
            f"{count} {role} process(es) to start",
        )

    def failover(self, role: str) -> float:
        """Seconds from the first ``lost the connection`` to the next ``reconnected`` line of
        the first ``role`` process's log."""
        stamps: dict[str, datetime] = {}
        for line in self.logs(role)[0].splitlines():
            for what in ("lost the connection to RabbitMQ", "reconnected to RabbitMQ"):
                if what in line and what not in stamps:
                    stamps[what] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        lost, back = stamps.values()
        return (back - lost).total_seconds()

    def leading(self) -> tuple[PrivateRabbit, list[str]]:
        """The node that leads the engine queue, and the queues it leads."""
        leaders = {q: self.cluster.leader(q) for q in [self.engine_queue, *self.step_queues]}
        node = leaders[self.engine_queue]
        return node, [q for q, n in leaders.items() if n is node]

    def assert_replicated(self) -> None:
        every = sorted(n.node for n in self.cluster.nodes)
        rows = {r["name"]: r for r in self.cluster.queues("name", "type", "members", "online")}
        for q in [self.engine_queue, *self.step_queues]:
            assert rows[q]["type"] == "quorum", rows[q]
            assert sorted(rows[q]["members"]) == every, rows[q]
            assert sorted(rows[q]["online"]) == every, rows[q]

    def dead_letters(self) -> int:
        node = self.cluster.running()[0]
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        try:
            declared = conn.channel().queue_declare(f"{self.system.namespace}.dead", passive=True)
            return int(declared.method.message_count)
        except pika.exceptions.ChannelClosedByBroker:
            return 0
        finally:
            if conn.is_open:
                conn.close()

    def start_loops(self, count: int, steps: int) -> dict[str, int]:
        runs = {f"loop-{i}-{uuid.uuid4().hex[:6]}": steps for i in range(count)}
        for run_id, n in runs.items():
            self.system.client.start("loop", n, run_id=run_id)
        return runs

    def assert_exactly_once(self, runs: dict[str, int]) -> None:
        """Every run completed with its output, each effect applied once (one ledger row per
        idempotency key: a missing or extra key is a lost or duplicated effect), no step
        completed twice, nothing dead-lettered."""
        system = self.system
        assert system.wait_final(list(runs), timeout=120) == dict.fromkeys(runs, "completed")
        applied = sorted((key.split("/")[0], step) for key, step in system.ledger(EFFECTS))
        expected = sorted((r, f"it{i}") for r, n in runs.items() for i in range(n))
        assert applied == expected, "an effect was lost or applied twice"
        for run_id, n in runs.items():
            assert system.client.get(run_id).output == n
            events = system.client.history(run_id)
            done = [e.pos for e in events if e.kind == "step_completed"]
            assert len(done) == len(set(done)) == n, f"{run_id}: a step completed twice"
        system.assert_histories_sound(list(runs))
        assert self.dead_letters() == 0
        assert system.store.dead_letters() == []


@pytest.fixture
def on_cluster(private_cluster: PrivateCluster, tmp_path: Path) -> Iterator[Cluster]:  # noqa: F811
    system = System(tmp_path, private_cluster.url, lease=3.0)
    try:
        yield Cluster(private_cluster, system)
    finally:
        system.close()


@pytest.mark.alone  # three Erlang nodes: their failover is timed by the CPU a neighbour takes
def test_losing_the_node_that_leads_the_quorums(on_cluster: Cluster) -> None:
    c, system = on_cluster, on_cluster.system
    engine = system.engine()
    c.ready("engine", 1)  # it declared the queues: their leaders are on its node
    workers = [
        system.worker(STEP_DELAY="0.2"),
        system.worker(STEP_DELAY="0.2", SAGALOOP_BROKER_URL=c.urls_from(1)),
    ]
    c.ready("worker", 2)
    c.assert_replicated()
    leader, led = c.leading()
    assert c.step_queues[0] in led, f"the engine queue and {c.step_queues[0]} have one leader"
    assert leader is c.cluster.nodes[0], "the first node of the list declared the queues"

    progress = Progress(system)
    runs = c.start_loops(16, 20)  # 320 steps of 0.2 s on 8 threads: about 8 s of work
    total = sum(runs.values())
    eventually(lambda: progress.bodies() >= 16, 60, "the first steps to run")
    stopping = time.monotonic()
    leader.stop()
    down = time.monotonic()
    assert progress.bodies() < total, "the runs finished before the node stopped: make them longer"
    new_leader, _ = c.leading()
    assert new_leader is not leader
    for role in ("engine", "worker"):  # the engine and the first worker lost their node
        eventually(
            lambda role=role: "reconnected to RabbitMQ at" in c.logs(role)[0],
            30,
            f"the {role} to fail over",
        )
    after = min(progress.bodies() + 16, total)
    eventually(lambda: progress.bodies() >= after, 60, "steps to run without the node")
    # The dead-letter queue (classic) lives on the stopped node. The engine may have declared it
    # again before the node's shutdown ended (then it said nothing); a process that starts now
    # meets it down for certain: it says so once and serves the other queues.
    workers.append(system.worker(STEP_DELAY="0.2", SAGALOOP_BROKER_URL=c.urls_from(1)))
    c.ready("worker", 3)
    unavailable = f"the dead-letter queue {system.namespace}.dead is unavailable"
    eventually(lambda: unavailable in c.logs("worker")[2], 30, "the late worker to say so")
    # healthy without the dead-letter queue's node: the count unknown, the services serving
    health = json.loads(system.sagaloop("health", "--json"))
    assert health["healthy"] and health["broker"] == "ok", health
    assert health["dead_letters"] is None and "dead_letters_unknown" in health, health
    recovered = time.monotonic()
    leader.start()
    restarted = time.monotonic()
    c.assert_exactly_once(runs)
    progress.close()

    worker_logs = c.logs("worker")
    assert "lost the connection to RabbitMQ" not in worker_logs[1], worker_logs[1]
    assert len(c.cluster.cluster_nodes()) == 3
    c.assert_replicated()
    print(
        f"\nCLUSTER node stop took {down - stopping:.1f} s; lost connection to reconnected: "
        f"engine {c.failover('engine'):.2f} s, worker {c.failover('worker'):.2f} s; longest "
        f"stall of step bodies from the stop to 16 more: {progress.stall(stopping, recovered):.1f}"
        f" s; node start took {restarted - recovered:.1f} s; queues led by the stopped node: {led}"
        f"; RSS engine {rss_mb(engine.pid)} MB, workers "
        f"{' and '.join(str(rss_mb(w.pid)) for w in workers)} MB, nodes "
        f"{', '.join(str(rss_mb(n.pid() or 0)) for n in c.cluster.nodes)} MB"
    )


# --- the soak ----------------------------------------------------------------------------------


@pytest.mark.soak
@pytest.mark.skipif(not os.environ.get("CLUSTER_SOAK"), reason="set CLUSTER_SOAK=1 (make chaos)")
def test_cluster_soak(on_cluster: Cluster) -> None:
    """For ``CLUSTER_SOAK_SECONDS``: runs keep being started; every cycle SIGKILLs the engine or
    a worker (restarted at once), takes the node leading the engine queue down (SIGKILL or a
    clean stop, in turn) for a few seconds, and SIGKILLs another process meanwhile; one node at
    a time, so the quorum holds."""
    c, system = on_cluster, on_cluster.system
    seconds = float(os.environ.get("CLUSTER_SOAK_SECONDS", "240"))
    rng = random.Random(int(os.environ.get("CLUSTER_SOAK_SEED", "7")))
    procs: dict[str, subprocess.Popen[bytes]] = {"engine": system.engine()}
    c.ready("engine", 1)
    procs["worker-a"] = system.worker(STEP_DELAY="0.1")
    procs["worker-b"] = system.worker(STEP_DELAY="0.1", SAGALOOP_BROKER_URL=c.urls_from(1))
    c.assert_replicated()
    restart = {
        "engine": lambda: system.engine(),
        "worker-a": lambda: system.worker(STEP_DELAY="0.1"),
        "worker-b": lambda: system.worker(STEP_DELAY="0.1", SAGALOOP_BROKER_URL=c.urls_from(1)),
    }
    runs: dict[str, int] = {}
    kills = node_downs = 0

    def kill_one() -> None:
        nonlocal kills
        role = rng.choice(sorted(procs))
        procs[role].send_signal(signal.SIGKILL)
        procs[role].wait(timeout=30)
        procs[role] = restart[role]()
        kills += 1

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        runs.update(c.start_loops(6, 8))
        time.sleep(rng.uniform(0.5, 2.0))
        kill_one()
        leader, _ = c.leading()
        if node_downs % 2 == 0:
            leader.kill()
        else:
            leader.stop()
        node_downs += 1
        time.sleep(rng.uniform(1.0, 3.0))
        kill_one()  # it starts while a node is down, maybe the first of its list
        time.sleep(rng.uniform(1.0, 3.0))
        leader.start()
        eventually(lambda: len(c.cluster.cluster_nodes()) == 3, 60, "the node to rejoin")
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited ({proc.returncode})"
    c.assert_exactly_once(runs)
    print(f"\nCLUSTER SOAK runs={len(runs)} kills={kills} node_downs={node_downs}")
