"""What every benchmark shares: statistics, services (a fresh database, a RabbitMQ namespace,
both deleted afterwards), process memory and a figure to put in the table."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pika

from sagaloop.testing import eventually, services

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def latency(samples_s: Sequence[float]) -> dict[str, float]:
    """p50 and p99 in milliseconds of samples in seconds."""
    ms = [s * 1000 for s in samples_s]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "n": len(ms)}


wait_until = eventually  # polls until truthy; AssertionError naming what it waited for


def rss_mb(pid: int) -> float:
    """The resident set size of a process (VmRSS of /proc/PID/status), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by a process (from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    return os.getloadavg()[0]


def settle(below: float = 1.5, at_most: float = 45.0) -> float:
    """Wait until the one-minute load average is under ``below`` (the section before may
    have left it high: it lags a minute behind), for ``at_most`` seconds; the seconds waited.
    On a machine that others keep busy it gives up at ``at_most``: the load is printed with
    every section's figures either way."""
    t0 = time.monotonic()
    while load_average() >= below and time.monotonic() - t0 < at_most:
        time.sleep(1.0)
    return time.monotonic() - t0


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """A database of its own on the local PostgreSQL, dropped afterwards."""
    url, drop = services.fresh_database(services.postgres_url())
    try:
        yield url
    finally:
        drop()


def rabbitmq_url() -> str:
    return services.rabbitmq_url()


def namespace(prefix: str) -> str:
    return f"bench-{prefix}-{uuid.uuid4().hex[:8]}"


def delete_rabbit(url: str, queues: Sequence[str], exchanges: Sequence[str]) -> None:
    """Delete what a benchmark declared on RabbitMQ (missing ones are ignored)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for kind, names in (("queue", queues), ("exchange", exchanges)):
            for name in names:
                ch = conn.channel()
                try:
                    if kind == "queue":
                        ch.queue_delete(name)
                    else:
                        ch.exchange_delete(name)
                except pika.exceptions.ChannelClosedByBroker:
                    pass
                finally:
                    if ch.is_open:
                        ch.close()
    finally:
        conn.close()


@dataclasses.dataclass
class Figure:
    """One row of the table: a measured value, its floor, the target and the verdict."""

    section: str
    case: str
    value: str
    ratio: str = ""
    target: str = ""
    met: bool | None = None
    note: str = ""

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: ""}[self.met]


def fmt_ms(ms: float) -> str:
    return "n/a" if math.isnan(ms) else f"{ms:.2f} ms" if ms < 100 else f"{ms:.0f} ms"


def fmt_ratio(x: float) -> str:
    return "n/a" if math.isnan(x) or math.isinf(x) else f"{x:.2f}x"


def count_driver_reads(count: Callable[[], None]) -> Callable[[], None]:
    """Call ``count`` for each statement the store runs below SQLAlchemy's statement layer
    (``SqlCore._fetch_one``: a step's inbox read on PostgreSQL), which SQLAlchemy's events do
    not see; an autocommit read, one round trip. Returns what undoes it."""
    from sagaloop.store.core import SqlCore

    fetch_one = SqlCore._fetch_one

    def counted(self: SqlCore, *args: Any) -> Any:
        count()
        return fetch_one(self, *args)

    SqlCore._fetch_one = counted  # type: ignore[method-assign]

    def undo() -> None:
        SqlCore._fetch_one = fetch_one  # type: ignore[method-assign]

    return undo
