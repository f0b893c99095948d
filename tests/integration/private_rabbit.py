"""A private RabbitMQ node for tests that stop or restart the broker, so the shared node on
5672 is never disturbed.

The node gets its own AMQP and distribution ports (from the free-port finder), node name, data
and log directories, an empty plugins file (no management listener to collide with the shared
one), and an empty config and env file: the machine's ``/etc/rabbitmq`` files name the shared
node and its listener. It is started with ``rabbitmq-server -detached`` from
``/usr/lib/rabbitmq/bin`` (the ``/usr/sbin`` wrapper switches user and drops the environment)
and stopped with ``rabbitmqctl -n NODE stop``.

Erlang cookie: the server and ``rabbitmqctl`` read it from ``$HOME/.erlang.cookie`` and create it
when missing. Both run with ``HOME`` set to a private directory, so the private node gets a fresh
cookie of its own and neither ``/root/.erlang.cookie`` (absent on these machines) nor the shared
node's cookie is read or written.

:class:`PrivateCluster` makes three such nodes share one cookie (written into each private
``HOME`` before the first start) and joins the second and third to the first with
``rabbitmqctl stop_app; join_cluster; start_app``. Its ``url`` lists every node's URL, separated
by commas, as ``SAGALOOP_BROKER_URL`` accepts it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

BIN = Path("/usr/lib/rabbitmq/bin")
SERVER = BIN / "rabbitmq-server"
CTL = BIN / "rabbitmqctl"


def free_port(avoid: set[int] | None = None) -> int:
    """A port nothing listens on now, not one of ``avoid`` (which it joins)."""
    avoid = set() if avoid is None else avoid
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in avoid:
            avoid.add(port)
            return port


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class PrivateRabbit:
    """One private node; ``start``, ``stop`` and ``restart`` keep its port and data. ``cookie``
    (the nodes of a cluster share one) is written to its ``HOME``; ``taken`` holds the ports
    other nodes of the same test use (and receives this one's)."""

    def __init__(
        self, root: Path, *, cookie: str | None = None, taken: set[int] | None = None
    ) -> None:
        self.root = root
        taken = set() if taken is None else taken
        self.port = free_port(taken)
        self.dist_port = free_port(taken)
        self.node = f"sagaloop-{uuid.uuid4().hex[:8]}@localhost"
        for name in ("home", "mnesia", "log"):
            (root / name).mkdir(parents=True, exist_ok=True)
        if cookie is not None:
            path = root / "home" / ".erlang.cookie"
            path.write_text(cookie)
            path.chmod(0o400)  # Erlang refuses a cookie file that others may read
        for name in ("enabled_plugins", "rabbitmq.conf", "rabbitmq-env.conf"):
            (root / name).write_text("")
        self.env = {
            **os.environ,
            "HOME": str(root / "home"),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(root / "log"),
            "RABBITMQ_PID_FILE": str(root / "rabbitmq.pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(root / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(root / "rabbitmq.conf"),
            "RABBITMQ_CONF_ENV_FILE": str(root / "rabbitmq-env.conf"),
        }
        self.running = False

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self, timeout: float = 30.0) -> None:
        # in its own folder: a node that crashes writes its MnesiaCore dump to its cwd
        subprocess.run(
            [str(SERVER), "-detached"], env=self.env, cwd=self.root, check=True, timeout=30
        )
        self.running = True
        deadline = time.monotonic() + timeout
        while not answers(self.port):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the private RabbitMQ node {self.node} did not answer on port {self.port} "
                    f"within {timeout} s; see its log under {self.root / 'log'}"
                )
            time.sleep(0.1)

    def pid(self) -> int | None:
        """The pid of the node's Erlang VM (from its pid file)."""
        try:
            return int((self.root / "rabbitmq.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self, timeout: float = 30.0) -> None:
        if not self.running:
            return
        pid = self.pid()
        subprocess.run(
            [str(CTL), "-n", self.node, "stop"],
            env=self.env,
            timeout=timeout,
            capture_output=True,
            check=False,
        )
        deadline = time.monotonic() + timeout
        while answers(self.port) or (pid is not None and _alive(pid)):
            if time.monotonic() > deadline:
                if pid is not None:
                    os.kill(pid, 9)  # our own node only, by the pid it wrote
                break
            time.sleep(0.1)
        self.running = False

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL the node's Erlang VM (by the pid it wrote): no goodbye to its peers."""
        pid = self.pid()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        self.running = False

    def ctl(self, *args: str, tool: Path = CTL, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl`` (or ``tool``, say ``rabbitmq-queues``) against this node; its
        standard output, or RuntimeError with what it said."""
        out = subprocess.run(
            [str(tool), "-n", self.node, *args],
            env=self.env,
            capture_output=True,
            timeout=timeout,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{tool.name} -n {self.node} {' '.join(args)}: {out.stderr}")
        return out.stdout


class PrivateCluster:
    """``size`` private nodes sharing one Erlang cookie, clustered with ``join_cluster``: the
    first node is the one the others join. ``start`` boots the nodes in parallel."""

    def __init__(self, root: Path, size: int = 3) -> None:
        cookie = uuid.uuid4().hex.upper()
        taken: set[int] = set()
        self.nodes = [
            PrivateRabbit(root / f"node{i + 1}", cookie=cookie, taken=taken) for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (``SAGALOOP_BROKER_URL`` accepts such a list)."""
        return ",".join(node.url for node in self.nodes)

    def node(self, name: str) -> PrivateRabbit:
        return next(n for n in self.nodes if n.node == name)

    def running(self) -> list[PrivateRabbit]:
        return [n for n in self.nodes if n.running]

    def start(self) -> None:
        """Boot every node at once, stop their apps at once, then join the others to the first
        one by one (``join_cluster``, ``start_app``): two nodes joining at the same moment
        sometimes fail to start Mnesia."""
        first, others = self.nodes[0], self.nodes[1:]
        try:
            _together([functools.partial(n.start, 60) for n in self.nodes])
            _together([functools.partial(n.ctl, "stop_app") for n in others])
            for node in others:
                node.ctl("join_cluster", first.node)
                node.ctl("start_app")
            running = self.cluster_nodes()
            if sorted(running) != sorted(n.node for n in self.nodes):
                raise RuntimeError(f"the private cluster did not form: running nodes {running}")
        except BaseException:
            self.stop()
            raise

    def cluster_nodes(self) -> list[str]:
        """The running nodes of the cluster, as a running member sees them."""
        status = json.loads(self.running()[0].ctl("cluster_status", "--formatter", "json"))
        nodes: list[str] = status["running_nodes"]
        return nodes

    def queues(self, *items: str) -> list[dict[str, Any]]:
        """``rabbitmqctl list_queues`` (say ``"name", "leader", "members"``) on a running node."""
        out = self.running()[0].ctl("list_queues", "-q", "--formatter", "json", *items)
        rows: list[dict[str, Any]] = json.loads(out)
        return rows

    def quorum_status(self, queue: str) -> list[dict[str, Any]]:
        """``rabbitmq-queues quorum_status``: one row per member (``Node Name``, ``Raft
        State``: leader or follower, ...)."""
        out = self.running()[0].ctl(
            "quorum_status", queue, "--formatter", "json", tool=BIN / "rabbitmq-queues"
        )
        rows: list[dict[str, Any]] = json.loads(out)
        return rows

    def leader(self, queue: str) -> PrivateRabbit:
        """The node that leads ``queue``'s quorum now."""
        for row in self.quorum_status(queue):
            if row.get("Raft State") == "leader":
                return self.node(row["Node Name"])
        raise RuntimeError(f"quorum queue {queue} has no leader now: {self.quorum_status(queue)}")

    def stop(self) -> None:
        _together([node.stop for node in self.nodes])


def _together(calls: list[Callable[[], object]]) -> None:
    """Run ``calls`` on threads of their own; raise the first error once all ended."""
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture
def private_rabbit(tmp_path: Path) -> Iterator[PrivateRabbit]:
    if not SERVER.exists():
        pytest.fail(f"{SERVER} is missing: install RabbitMQ (`apt-get install rabbitmq-server`)")
    node = PrivateRabbit(tmp_path / "rabbit")
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[PrivateCluster]:
    """Three clustered private nodes, started; stopped (and their data deleted) at the end."""
    if not SERVER.exists():
        pytest.fail(f"{SERVER} is missing: install RabbitMQ (`apt-get install rabbitmq-server`)")
    cluster = PrivateCluster(tmp_path / "cluster")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
