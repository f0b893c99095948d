"""The process registry: each service process (``engine``, ``worker``, ``dev``) keeps a row in
``sagaloop_processes`` (written at start, refreshed every ``SEEN_EVERY`` seconds with its
problems, closed at exit), and ``sagaloop health`` judges the fleet from those rows.

A row not refreshed for ``LIVE_WITHIN`` seconds and never closed belongs to a process that was
killed without a chance to say so (SIGKILL, out of memory, a lost host): health lists it as
``not seen for N s`` but does not fail for it. Its claims are taken over once it is proven
dead (``sagaloop.runtime.takeover``), and whether a replacement runs is the supervisor's business,
not the probe's: failing every probe because one process vanished would restart the healthy
ones too. What fails is an app with runs in flight and no live engine, or a queue nobody
consumes (:func:`fleet`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

from sagaloop.engine.messages import engine_queue
from sagaloop.engine.ports import Clock
from sagaloop.store.processes import Identity, ProcessRecord

logger = logging.getLogger(__name__)

SEEN_EVERY = 5.0
"""Seconds between two refreshes of a running process's row."""
LIVE_WITHIN = 3 * SEEN_EVERY
"""A row refreshed within this many seconds belongs to a running process."""
RECENT_PROBLEM = 60.0
"""Health fails for a problem reported (or an exit because of one) within this many seconds, so
that a crash-looping service shows between its restarts."""
PRUNE_AFTER = timedelta(hours=1)
"""Rows not refreshed for this long are deleted (by any running process)."""
MAX_PROBLEM = 2000
"""Characters of a problem kept in the registry."""


class ProcessRegistry(Protocol):
    """Where processes say that they run (``SqlStore`` is one)."""

    def process_started(
        self, name: str, app: str, role: str, now: datetime, identity: Identity | None = None
    ) -> None: ...

    def process_seen(
        self,
        name: str,
        now: datetime,
        problem: str | None,
        abandoned: Sequence[dict[str, Any]] = (),
    ) -> bool: ...

    def process_stopped(self, name: str, now: datetime, problem: str | None) -> None: ...

    def prune_processes(self, before: datetime) -> int: ...


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, printable and storable even when its ``__str__``
    raises or returns a lone surrogate."""
    try:
        text = str(exc)
    except Exception:
        text = "<str() of the exception failed>"
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


def _storable(problems: Sequence[str]) -> str | None:
    """The problems as one text any database stores: no NUL, no lone surrogate, bounded."""
    return _clip(problems, MAX_PROBLEM) if problems else None


def abandoned_text(abandoned: Sequence[dict[str, Any]]) -> str | None:
    """``N abandoned threads (step X, run Y, since T; ...)``, or None when there are none."""
    if not abandoned:
        return None
    what = "thread" if len(abandoned) == 1 else "threads"
    each = "; ".join(
        f"step {a.get('step')!r}, run {a.get('run_id')}, attempt {a.get('attempt')}, "
        f"since {a.get('since')}"
        for a in abandoned
    )
    return _clip([f"{len(abandoned)} abandoned {what} ({each})"], MAX_PROBLEM)


def _clip(lines: Sequence[str], limit: int) -> str:
    text = "; ".join(lines).replace("\x00", "\\x00").replace("\n", " ")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Outage:
    """Says once that a repeated background write fails (a warning at the first failure of
    an outage), not at each retry; a success ends the outage."""

    def __init__(self) -> None:
        self.failing = False

    def attempt(self, write: Callable[[], None], warning: str, *args: Any) -> None:
        """Run ``write``; on an exception, log ``warning % (*args, error)`` if the outage
        just began. Never raises an ``Exception``."""
        try:
            write()
        except Exception as e:
            if not self.failing:
                logger.warning(warning, *args, e)
            self.failing = True
        else:
            self.failing = False


@dataclasses.dataclass
class Registration:
    """This process's row. Database errors are logged (once per outage) and retried at the next
    refresh: the registry never stops a service."""

    registry: ProcessRegistry
    name: str
    app: str
    role: str
    clock: Clock
    identity: Identity | None = None
    _registered: bool = dataclasses.field(default=False, init=False)
    _outage: Outage = dataclasses.field(default_factory=Outage, init=False)
    _next_prune: float = dataclasses.field(default=0.0, init=False)

    def started(self) -> None:
        self._try("register", self._register)

    def beat(self, problems: Sequence[str], abandoned: Sequence[dict[str, Any]] = ()) -> None:
        """Refresh the row with the process's current problems and the attempts it abandoned
        whose threads still run (no problem: health lists them, ``status`` shows them under
        their run); prune old rows now and then."""
        self._try("refresh", lambda: self._beat(_storable(problems), abandoned))

    def stopped(self, problems: Sequence[str]) -> None:
        """Close the row, keeping the problems the process exits with."""
        problem = _storable(problems)
        self._try("close", lambda: self.registry.process_stopped(self.name, self._now(), problem))

    def _now(self) -> datetime:
        return self.clock.now()

    def _register(self) -> None:
        self.registry.process_started(self.name, self.app, self.role, self._now(), self.identity)
        self._registered = True

    def _beat(self, problem: str | None, abandoned: Sequence[dict[str, Any]]) -> None:
        now = self._now()
        seen = self.registry.process_seen
        if not self._registered or not seen(self.name, now, problem, abandoned):
            self._register()  # not yet written, or pruned while this process was stuck
            seen(self.name, now, problem, abandoned)
        if now.timestamp() >= self._next_prune:
            self.registry.prune_processes(now - PRUNE_AFTER)
            self._next_prune = now.timestamp() + PRUNE_AFTER.total_seconds() / 12

    def _try(self, what: str, write: Callable[[], None]) -> None:
        warning = "could not %s this process in the registry (%s); retrying"
        self._outage.attempt(write, warning, what)


def _host(name: str) -> str:
    """The host of a ``role@host:pid`` name."""
    return name.partition("@")[2].rpartition(":")[0]


def assess(
    rows: Sequence[ProcessRecord], now: datetime, *, host: str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The processes to list (those of ``host`` only, when given) and the problems for which
    health fails: a process seen within ``RECENT_PROBLEM`` seconds that reports one, or one that
    exited because of one within that time."""
    listed: list[dict[str, Any]] = []
    problems: list[str] = []
    for row in rows:
        if host is not None and _host(row.name) != host:
            continue
        seen = (now - row.seen_at).total_seconds()
        end = row.stopped_at or now
        problem, notes = row.problem, abandoned_text(row.abandoned or [])
        entry: dict[str, Any] = {
            "name": row.name,
            "role": row.role,
            "app": row.app,
            "up_s": round((end - row.started_at).total_seconds(), 1),
            "seen_s_ago": round(seen, 1),
            "problem": problem,
            "notes": notes if row.stopped_at is None and seen <= LIVE_WITHIN else None,
        }
        who = f"{row.name} ({row.role} of app {row.app})"
        if row.stopped_at is not None:
            ago = (now - row.stopped_at).total_seconds()
            if problem:
                entry["state"] = f"exited {ago:.0f} s ago because of a problem"
                if ago <= RECENT_PROBLEM:
                    problems.append(f"{who} exited {ago:.0f} s ago: {problem}")
            else:
                entry["state"] = f"stopped {ago:.0f} s ago"
        else:
            entry["state"] = "running" if seen <= LIVE_WITHIN else f"not seen for {seen:.0f} s"
            if problem and seen <= RECENT_PROBLEM:
                problems.append(f"{who}: {problem}")
        listed.append(entry)
    return listed, problems


def _live(row: ProcessRecord, now: datetime) -> bool:
    return row.stopped_at is None and (now - row.seen_at).total_seconds() <= LIVE_WITHIN


def fleet(
    rows: Sequence[ProcessRecord], now: datetime, in_flight: dict[str, int]
) -> tuple[dict[str, list[str]], list[str]]:
    """The step queues of each app that no live process consumes (as the app's processes
    declare them), and the problems for which health fails: an app with runs in flight and
    no live engine, or with runs in flight and a queue nobody consumes (its steps would wait
    there unseen)."""
    apps = sorted({r.app for r in rows} | {a for a, n in in_flight.items() if n > 0})
    unserved: dict[str, list[str]] = {}
    problems: list[str] = []
    for app in apps:
        mine = [r for r in rows if r.app == app]
        live = [r for r in mine if _live(r, now)]
        consumed = {q for r in live for q in r.queues or []}
        declared = {q for r in (live or mine) for q in r.app_queues or []}
        queues = sorted(declared - consumed)
        if queues:
            unserved[app] = queues
        runs = in_flight.get(app, 0)
        if runs and engine_queue(app) not in consumed:
            problems.append(
                f"app {app!r} has {runs} run(s) in flight and no live engine: nothing moves "
                "them (start `sagaloop engine`, or `sagaloop dev`)"
            )
        if runs and queues:
            names = ", ".join(queues)
            problems.append(
                f"app {app!r} has {runs} run(s) in flight and no live process consumes queue(s) "
                f"{names}: their steps wait there (start `sagaloop worker --queue ...`)"
            )
    return unserved, problems
