"""Redis for the KombuBroker tests: the server's URL, fresh key namespaces deleted afterwards,
a System whose processes run on Redis, and (run as a script) a consumer process that claims
messages and then waits to be killed or closes."""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.parse
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis

from sagaloop.brokers.kombu import KombuBroker

DEFAULT_URL = "redis://127.0.0.1:6379/15"
"""Database 15: away from the default database 0 that other users of the server write to."""


def redis_url() -> str | None:
    """The test server's URL (``SAGALOOP_TEST_REDIS_URL`` or the local default), or None when
    nothing answers there."""
    url = os.environ.get("SAGALOOP_TEST_REDIS_URL", DEFAULT_URL)
    parts = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), 2).close()
    except OSError:
        return None
    return url


def delete_namespace(url: str, namespace: str) -> int:
    """Delete every key of ``namespace`` (its lists ``ns.*`` and its own keys ``ns:*``)."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}[.:]*", count=1000))
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


def held_messages(url: str, namespace: str, queue: str) -> int:
    """How many messages of ``queue`` are claimed now (by live or dead consumers)."""
    client = redis.Redis.from_url(url)
    try:
        records = client.hgetall(f"{namespace}:held").values()
    finally:
        client.close()
    key = f"{namespace}.{queue}".encode()
    return sum(1 for r in records if r.startswith(b"%d:%s" % (len(key), key)))


class Namespace:
    """Brokers on one fresh namespace (``test-<uuid>``), closed and deleted afterwards."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = f"test-{uuid.uuid4().hex[:12]}"
        self.brokers: list[KombuBroker] = []

    def broker(self, **options: Any) -> KombuBroker:
        broker = KombuBroker(self.url, namespace=self.name, **options)
        self.brokers.append(broker)
        return broker

    def cleanup(self) -> None:
        for b in self.brokers:
            b.close()
        delete_namespace(self.url, self.name)


def make_system(tmp: Path, url: str) -> Any:
    """A :class:`system.System` whose engine and workers run on Redis (``url``)."""
    from system import System

    class RedisSystem(System):
        def _delete_namespace(self) -> None:
            delete_namespace(self.broker_url, self.namespace)

        def dead_letter_count(self) -> int:
            client = redis.Redis.from_url(self.broker_url)
            try:
                return int(client.zcard(f"{self.namespace}:dead-ids"))
            finally:
                client.close()

    return RedisSystem(tmp, url)


def hold(url: str, namespace: str, queue: str, n: int, lease: float, then: str) -> None:
    """Claim ``n`` messages of ``queue``, say ``held`` on stdout, then wait to be killed
    (``then == "wait"``) or close the broker and exit (``"close"``)."""
    broker = KombuBroker(url, namespace=namespace, lease=timedelta(seconds=lease))
    got: list[Any] = []
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got += broker.receive([queue], n - len(got), 1.0)
    print("held" if len(got) == n else f"only {len(got)}", flush=True)
    if then == "close":
        broker.close()
        return
    time.sleep(60)


if __name__ == "__main__":
    url, namespace, queue, n, lease, then = sys.argv[1:]
    hold(url, namespace, queue, int(n), float(lease), then)
