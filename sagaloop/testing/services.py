"""Finding PostgreSQL and RabbitMQ for integration tests, in this order:

1. the environment: ``SAGALOOP_TEST_DATABASE_URL`` / ``SAGALOOP_TEST_BROKER_URL``;
2. testcontainers, when a Docker engine answers (the containers live until the process exits);
3. the local defaults ``postgresql://postgres@127.0.0.1:5432/postgres`` and
   ``amqp://guest:guest@127.0.0.1:5672/``, when their ports answer;
4. otherwise :class:`ServiceNotFoundError`, whose message says how to get the service. A
   missing service fails the tests; it never skips them silently.

Importing this module needs neither testcontainers nor a server; it does no I/O.
:func:`fresh_database` gives each test session (or test) a database of its own;
:func:`migrated_database`, one with sagaloop's schema.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from sagaloop.errors import SagaloopError

__all__ = [
    "BROKER_ENV",
    "DATABASE_ENV",
    "ServiceNotFoundError",
    "docker_answers",
    "fresh_database",
    "migrated_database",
    "on_server",
    "port_answers",
    "postgres_url",
    "queue_depth",
    "rabbitmq_url",
]

DATABASE_ENV = "SAGALOOP_TEST_DATABASE_URL"
BROKER_ENV = "SAGALOOP_TEST_BROKER_URL"
LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
LOCAL_RABBITMQ = "amqp://guest:guest@127.0.0.1:5672/"
POSTGRES_IMAGE = "postgres:16-alpine"
RABBITMQ_IMAGE = "rabbitmq:3.13-alpine"

_found: dict[str, str] = {}
_lock = threading.Lock()


class ServiceNotFoundError(SagaloopError):
    """No service for the integration tests; the message says how to provide one."""


def port_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def docker_answers(timeout: float = 1.0) -> bool:
    """Whether a Docker engine answers ``/_ping`` (on ``DOCKER_HOST`` or the default socket).

    A ``docker`` client without an engine behind it fails this quickly, so that tests fall
    through to local services instead of waiting for testcontainers to time out."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    parts = urlsplit(host)
    try:
        if parts.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(parts.path)
        elif parts.scheme in ("tcp", "http"):
            sock = socket.create_connection((parts.hostname or "", parts.port or 2375), timeout)
        else:
            return False  # ssh:// and friends: let the env vars or local services decide
        with sock:
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return sock.recv(64).startswith((b"HTTP/1.0 200", b"HTTP/1.1 200"))
    except OSError:
        return False


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


def _find(
    kind: str, env: str, container: Callable[[], str], local: str, port: int, how: str
) -> str:
    with _lock:
        if kind in _found:
            return _found[kind]
        url = os.environ.get(env)
        if not url:
            if docker_answers():
                url = container()
            elif port_answers(*_host_port(local, port)):
                url = local
            else:
                raise ServiceNotFoundError(
                    f"no {kind} for the integration tests: set {env} to its URL, or start a "
                    f"Docker engine (testcontainers then runs one), or {how}"
                )
        _found[kind] = url
        return url


def postgres_url() -> str:
    """A URL of a PostgreSQL server whose user may create databases (see the module doc)."""
    return _find(
        "PostgreSQL",
        DATABASE_ENV,
        _postgres_container,
        LOCAL_POSTGRES,
        5432,
        "install and start PostgreSQL on 127.0.0.1:5432 with trust authentication for the "
        "user postgres (Debian: `apt-get install postgresql && service postgresql start`)",
    )


def rabbitmq_url() -> str:
    """A URL of a RabbitMQ broker (see the module doc)."""
    return _find(
        "RabbitMQ",
        BROKER_ENV,
        _rabbitmq_container,
        LOCAL_RABBITMQ,
        5672,
        "install and start RabbitMQ on 127.0.0.1:5672 with the guest user "
        "(Debian: `apt-get install rabbitmq-server && service rabbitmq-server start`)",
    )


def _start(container: Any) -> None:
    container.start()
    atexit.register(container.stop)


def _postgres_container() -> str:
    module: Any = importlib.import_module("testcontainers.postgres")
    container = module.PostgresContainer(POSTGRES_IMAGE, driver=None)
    _start(container)
    url: str = container.get_connection_url()
    return url


def _rabbitmq_container() -> str:
    module: Any = importlib.import_module("testcontainers.rabbitmq")
    container = module.RabbitMqContainer(RABBITMQ_IMAGE)
    _start(container)
    host = container.get_container_host_ip()
    port = container.get_exposed_port(container.port)
    return f"amqp://{container.username}:{container.password}@{host}:{port}/"


def fresh_database(admin_url: str) -> tuple[str, Callable[[], None]]:
    """Create a uniquely named database (``sagaloop_test_<8 hex>``) on the server of
    ``admin_url``; return its URL and a function that drops it, ending leftover connections.
    """
    import sqlalchemy as sa

    name = f"sagaloop_test_{uuid.uuid4().hex[:8]}"
    with on_server(admin_url) as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        with on_server(admin_url) as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
            with contextlib.suppress(sa.exc.DBAPIError):  # before 13: no FORCE
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                return
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')

    return url, drop


@contextlib.contextmanager
def on_server(admin_url: str) -> Iterator[Any]:
    """A connection to the server of ``admin_url`` outside any transaction (for ``CREATE`` or
    ``DROP DATABASE``), closed with its one-connection engine after the block."""
    from sagaloop.store.connect import create_sa_engine

    engine = create_sa_engine(admin_url, pool_size=1, max_overflow=0)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            yield conn
    finally:
        engine.dispose()


def queue_depth(amqp_url: str, queue: str) -> int:
    """How many messages RabbitMQ holds ready in ``queue``; 0 if it was never declared."""
    import pika
    import pika.exceptions

    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker:
        return 0
    finally:
        if conn.is_open:
            conn.close()


@contextlib.contextmanager
def migrated_database(admin_url: str) -> Iterator[str]:
    """A :func:`fresh_database` with sagaloop's schema made, for the ``with`` block; its URL.
    Dropped at the block's end."""
    from sagaloop.store.sql import SqlStore

    url, drop = fresh_database(admin_url)
    try:
        store = SqlStore(url)
        try:
            store.upgrade()
        finally:
            store.close()
        yield url
    finally:
        drop()
