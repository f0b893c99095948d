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
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path("/usr/lib/rabbitmq/bin")
SERVER = BIN / "rabbitmq-server"
CTL = BIN / "rabbitmqctl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class PrivateRabbit:
    """One private node; ``start``, ``stop`` and ``restart`` keep its port and data."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.dist_port = free_port()
        while self.dist_port == self.port:
            self.dist_port = free_port()
        self.node = f"sagaloop-{uuid.uuid4().hex[:8]}@localhost"
        for name in ("home", "mnesia", "log"):
            (root / name).mkdir(parents=True, exist_ok=True)
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
        subprocess.run([str(SERVER), "-detached"], env=self.env, check=True, timeout=30)
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

    def _pid(self) -> int | None:
        try:
            return int((self.root / "rabbitmq.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self, timeout: float = 30.0) -> None:
        if not self.running:
            return
        pid = self._pid()
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
