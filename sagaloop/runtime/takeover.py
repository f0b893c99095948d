"""Taking over the work of dead processes at once, not after their leases.

Every service process registers a token (``sagaloop_processes.token``) that starts the claim
token of every outbox row it claims (``<token>.<random>``: the database broker's deliveries,
the in-process lane's steps, the relay's rows to publish). A process that starts, and every
running one each ``SEEN_EVERY`` seconds, looks at the registry; the claims of a process proven
dead are released in one statement, and the log says what was taken over.

Dead means known, never guessed (:func:`verdict`): a process that is alive but slow keeps its
claims, so a step is not run twice needlessly.

- **Same machine** (the same boot and PID namespace): its pid is gone (``os.kill(pid, 0)``
  raises ``ProcessLookupError``) or a zombie not yet reaped, or now belongs to a process that
  started at another time.
  A live pid is never judged stale, however long it has been silent.
- **Another machine**: its row's ``seen_at`` stayed unchanged for ``STALE_AFTER`` seconds *as
  this process observed it* (measured on this process's monotonic clock, so a skewed clock on
  either host cannot make a live process look dead); ``SEEN_EVERY`` seconds for a process that
  wrote that it stopped.

What cannot be proven waits for the lease as before: a restarted container that reuses its
predecessor's name (same host name and pid), say, replaces its row.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from sagaloop.runtime.registry import SEEN_EVERY
from sagaloop.store.processes import ProcessRecord
from sagaloop.store.queue import Released

logger = logging.getLogger(__name__)

STALE_AFTER = 6 * SEEN_EVERY
"""Seconds a process on another machine must have missed its refreshes (as observed here)
before its claims are taken over: six beats, half the default lease."""
SHOWN = 10
"""Messages named one by one in the log line of a takeover."""


def host_identity(pid: int | None = None) -> dict[str, Any]:
    """Where this process runs: what :func:`verdict` compares."""
    pid = os.getpid() if pid is None else pid
    return {
        "hostname": socket.gethostname(),
        "machine": machine(),
        "pid": pid,
        "start": start_of(pid),
    }


def machine() -> str:
    """What two processes share exactly when each can see the other's pid: the boot and the
    PID namespace (Linux); elsewhere the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"host:{socket.gethostname()}"
    return f"{boot}/{namespace}"


def start_of(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None


def pid_alive(pid: int) -> bool | None:
    """Whether ``pid`` runs on this machine (None: cannot tell)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it runs, as another user
    except (OSError, ValueError, OverflowError):
        return None
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` exited and waits to be reaped by its parent (it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[:1]
    except OSError:
        return False
    return state == ["Z"]


def verdict(
    row: ProcessRecord,
    me: dict[str, Any],
    observed_for: float,
    *,
    alive: Callable[[int], bool | None] = pid_alive,
    started: Callable[[int], str | None] = start_of,
) -> str | None:
    """Why the process of ``row`` is dead, or None when that is not known. ``observed_for``:
    for how many seconds this process has seen its row unchanged."""
    host = row.host if isinstance(row.host, dict) else {}
    pid = host.get("pid")
    if host.get("machine") == me.get("machine") and isinstance(pid, int) and pid > 0:
        if pid == me.get("pid"):
            if host.get("start") == me.get("start"):
                return None  # this very process (another runtime in it)
            return f"its pid {pid} is now this process's"
        state = alive(pid)
        if state is False:
            return f"its pid {pid} is gone"
        if state is True:
            now_start = started(pid)
            if host.get("start") and now_start and now_start != host.get("start"):
                return f"its pid {pid} now belongs to another process"
            return None  # alive: slow or silent, it keeps its claims
    if row.stopped_at is not None and observed_for >= SEEN_EVERY:
        return "it stopped"
    if observed_for >= STALE_AFTER:
        return f"its registry row was not refreshed for {observed_for:.0f} s"
    return None


class Registry(Protocol):
    """What a takeover reads and writes (``SqlStore`` is one)."""

    def processes(self) -> list[ProcessRecord]: ...

    def take_over(self, name: str, token: str) -> list[Released]: ...


class Takeover:
    """Finds dead processes in the registry and releases their claims (:meth:`sweep`)."""

    def __init__(self, registry: Registry, name: str, token: str) -> None:
        self.registry = registry
        self.name = name
        self.token = token
        self.me = host_identity()
        self._observed: dict[tuple[str, str], tuple[Any, float]] = {}
        """(name, token) -> (what its row said, since when it says so: monotonic)."""

    def sweep(self) -> list[tuple[str, str, list[Released]]]:
        """Take over from every process proven dead now; return (name, why, rows released)
        of each."""
        now = time.monotonic()
        taken: list[tuple[str, str, list[Released]]] = []
        keys: set[tuple[str, str]] = set()
        for row in self.registry.processes():
            if not row.token or row.token == self.token:
                continue
            key, said = (row.name, row.token), (row.seen_at, row.stopped_at)
            keys.add(key)
            first = self._observed.get(key)
            if first is None or first[0] != said:
                self._observed[key] = first = (said, now)
            why = verdict(row, self.me, now - first[1])
            if why is None:
                continue
            released = self.registry.take_over(row.name, row.token)
            taken.append((row.name, why, released))
            _log(row, why, released)
        for key in set(self._observed) - keys:
            del self._observed[key]
        return taken


def _log(row: ProcessRecord, why: str, released: list[Released]) -> None:
    if not released:
        logger.info("process %s is dead (%s); it held no messages", row.name, why)
        return
    shown = ", ".join(f"{r.message_id} on {r.queue}" for r in released[:SHOWN])
    more = f" and {len(released) - SHOWN} more" if len(released) > SHOWN else ""
    logger.warning(
        "took over the work of process %s (%s of app %r), dead: %s; %d message(s) it held are "
        "redelivered now instead of after their lease: %s%s",
        row.name,
        row.role,
        row.app,
        why,
        len(released),
        shown,
        more,
    )
