"""From URLs to a store, a broker and a live channel, and :func:`connect`: a
:class:`~sagaloop.Client` on the database an engine serves. The command line's settings
(``SAGALOOP_DATABASE_URL``, ``SAGALOOP_BROKER_URL``) are opened here too.

Every driver is imported when a URL needs it: importing this module loads none."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from sagaloop._secrets import mask_url
from sagaloop.brokers.local_streams import LOCAL
from sagaloop.client import Client
from sagaloop.engine.ports import Streams
from sagaloop.errors import SagaloopError
from sagaloop.sagas.app import App

if TYPE_CHECKING:
    from sagaloop.brokers.kombu import KombuBroker
    from sagaloop.brokers.rabbitmq import RabbitBroker
    from sagaloop.engine.ports import Broker
    from sagaloop.store.sql import SqlStore

BROKERS = "database, memory, amqp:// or redis://"
"""The broker URLs sagaloop knows, as its error messages name them."""
SCHEMES = ("amqp://", "amqps://", "redis://", "rediss://")
CONNECTIONS = 5
"""The pool of a store opened for one thread or a few (a client, a command); a service's store
is opened with its ``Tuning.connections``."""


class URLError(SagaloopError, ValueError):
    """A database or broker URL that sagaloop cannot use; the message says which and why
    (passwords masked). A ``ValueError`` too."""


def open_store(
    url: str, *, upgrade: bool = False, verify: bool = True, connections: int = CONNECTIONS
) -> SqlStore:
    """The store at the database ``url``. ``upgrade``: create or upgrade its schema first (an
    SQLite file that does not exist is created); else, with ``verify``, check that its schema
    is this version's (the error says what to run). ``connections``: the pool's size, the
    connections it keeps once opened (a service's store: its ``Tuning.connections``). Raises
    :class:`URLError` for a database that does not exist or a URL that cannot be used."""
    from sagaloop.store.connect import sqlite_file
    from sagaloop.store.sql import SqlStore

    if connections < 1:
        raise ValueError(f"a store needs at least 1 connection in its pool, not {connections}")
    missing = sqlite_file(url)
    if not upgrade and missing is not None and not missing.exists():
        raise URLError(  # and do not leave an empty database behind
            f"no database at {missing}: `sagaloop dev --app M` creates it (or run "
            "`sagaloop db upgrade`), or set SAGALOOP_DATABASE_URL to the engine's"
        )
    try:
        store = SqlStore(url, pool_size=connections)
    except Exception as e:
        raise URLError(f"cannot use database {mask_url(url)}: {e}") from e
    if upgrade:
        store.upgrade()
    elif verify:
        store.check_schema()
    return store


def open_broker(
    url: str,
    store: SqlStore,
    *,
    lease: timedelta = timedelta(seconds=60),
    namespace: str = "sagaloop",
    queue_type: Literal["quorum", "classic"] = "quorum",
    connect_timeout: float | None = None,
    what: str = "broker URL",
) -> Broker:
    """The broker at ``url``: ``database`` (the outbox table of ``store``), ``memory``,
    ``amqp://`` (RabbitMQ) or ``redis://`` (through kombu). Internal messages are signed with
    ``store``'s key, shared by every process of the database. Raises :class:`URLError` (naming
    the URL as ``what``) for a URL that cannot be used, ``ValidationError`` for a namespace
    RabbitMQ's permissions could not fence, ``ImportError`` (saying what to install) for a
    missing client library."""
    timeout = timedelta(seconds=connect_timeout) if connect_timeout else None
    if url == "database":
        from sagaloop.brokers.database import DatabaseBroker

        return DatabaseBroker(store, lease=lease)
    if url == "memory":
        from sagaloop.brokers.memory import MemoryBroker

        return MemoryBroker(lease=lease)
    options: dict[str, Any] = {}
    kind: type[RabbitBroker] | type[KombuBroker]
    if url.startswith(("amqp://", "amqps://")):
        from sagaloop.brokers._amqp import check_namespace
        from sagaloop.brokers.rabbitmq import RabbitBroker

        check_namespace(namespace)
        kind, options["queue_type"] = RabbitBroker, queue_type
    elif url.startswith(("redis://", "rediss://")):
        from sagaloop.brokers.kombu import KombuBroker  # ImportError: says what to install

        kind = KombuBroker
    else:
        raise URLError(f"unsupported {what} {mask_url(url)!r}: use {BROKERS}")
    try:
        return kind(
            url,
            namespace=namespace,
            lease=lease,
            connect_timeout=timeout,
            signing_key=store.signing_key(),  # shared through the database
            **options,
        )
    except ValueError as e:  # the client library cannot parse the URL (a bad port, say)
        raise URLError(f"invalid {what} {mask_url(url)!r}: {e}") from e


def open_streams(url: str, *, namespace: str = "sagaloop") -> Streams:
    """The per-run live channel for the broker at ``url``: RabbitMQ's with an ``amqp://``
    broker, else this process's."""
    if url.startswith(("amqp://", "amqps://")):
        from sagaloop.brokers._amqp import check_namespace
        from sagaloop.brokers.streams import RabbitStreams

        check_namespace(namespace)
        return RabbitStreams(url, namespace=namespace)
    return LOCAL


def connect(
    url: str,
    app: App | str | None,
    *,
    broker: str | None = None,
    namespace: str = "sagaloop",
    connections: int = CONNECTIONS,
) -> Client:
    """A :class:`~sagaloop.Client` of ``app`` on the database at ``url``, whose engine runs
    elsewhere (``sagaloop engine``, ``sagaloop dev``, a ``Service``): it starts, signals and
    reads runs, in the database's transactions; the relay of that engine publishes what it
    writes. ``broker``: the engine's broker URL (default ``database``), for the live channel
    of :meth:`Client.stream` (RabbitMQ's with ``amqp://``); ``namespace`` as the engine's.
    ``connections``: the pool's size, for a client that many threads use at once (a web
    server's: one per thread, else each call beyond the pool's size at once opens a
    connection and closes it again). The database's schema must be this version's (run
    ``sagaloop db upgrade``)."""
    broker = broker or "database"
    if broker not in ("database", "memory") and not broker.startswith(SCHEMES):
        raise URLError(f"unsupported broker URL {mask_url(broker)!r}: use {BROKERS}")
    streams = open_streams(broker, namespace=namespace)
    store = open_store(url, connections=connections)
    return Client(store, app, streams=streams)
