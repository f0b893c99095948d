"""Liveness files: each service process (``engine``, ``worker``, ``dev``) keeps a small JSON
file ``<pid>.json`` in a local directory (``SAGALOOP_RUN_DIR``, else ``/tmp/sagaloop-<uid>``),
rewritten by its registry thread on every beat (``SEEN_EVERY`` seconds) before that thread
touches the database, so a database that refuses or fails the beat leaves the file fresh.

``sagaloop health --live`` judges this host's processes from those files alone, without the
database or the broker (:func:`read_all`, :func:`judge`): unhealthy when no live process has a
file, when a live process's file was not refreshed for ``STALE_AFTER`` seconds (its beat is
stuck), or when a process reports problems (a dead thread, a stalled activation, every step
thread held past its timeout). Files of processes that are gone are deleted as they are read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from sagaloop.runtime.registry import SEEN_EVERY
from sagaloop.runtime.takeover import pid_alive, start_of

logger = logging.getLogger(__name__)

RUN_DIR_ENV = "SAGALOOP_RUN_DIR"
"""The environment variable naming the directory of the liveness files."""
STALE_AFTER = 3 * SEEN_EVERY
"""A live process whose file is older than this many seconds is stuck."""


class Beat(BaseModel):
    """The content of a liveness file."""

    model_config = ConfigDict(frozen=True)

    name: str
    app: str
    role: str
    pid: int
    host: str
    started_at: datetime
    beat_at: datetime
    problems: list[str] = []
    process_start: str | None = None
    """When the pid started (clock ticks since boot; ``takeover.start_of``): a file whose pid
    now belongs to another process is a dead process's."""


class Live(BaseModel):
    """A live process as ``sagaloop health --live`` lists it."""

    name: str
    app: str
    role: str
    pid: int
    beat_age_s: float
    problems: list[str]


class Verdict(BaseModel):
    """What ``sagaloop health --live`` prints (``--json``: this model's JSON)."""

    healthy: bool
    processes: list[Live]
    reason: str


def run_dir() -> Path:
    """The directory of the liveness files: ``$SAGALOOP_RUN_DIR``, else ``/tmp/sagaloop-<uid>``."""
    return Path(os.environ.get(RUN_DIR_ENV) or f"/tmp/sagaloop-{os.getuid()}")


def write(beat: Beat, directory: Path) -> None:
    """Write ``beat`` as ``<pid>.json`` atomically (a temporary file, then ``os.replace``),
    creating ``directory`` (mode 0700) when missing. Raises ``OSError``."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{beat.pid}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(beat.model_dump_json())
        os.replace(tmp, directory / f"{beat.pid}.json")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove(pid: int, directory: Path) -> None:
    """Delete the file of ``pid`` (nothing when there is none)."""
    with contextlib.suppress(OSError):
        (directory / f"{pid}.json").unlink()


def read_all(
    directory: Path,
    *,
    alive: Callable[[int], bool | None] = pid_alive,
    started: Callable[[int], str | None] = start_of,
) -> list[Beat]:
    """The files of the live processes, by pid. A file whose pid is gone (or now belongs to a
    process started at another time) is deleted and left out; one that cannot be read or
    parsed is left out."""
    beats: list[Beat] = []
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            beat = Beat.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as e:
            logger.debug("skipping liveness file %s: %s", path, e)
            continue
        state = alive(beat.pid)
        if state is True and beat.process_start is not None:
            now_start = started(beat.pid)
            state = now_start is None or now_start == beat.process_start
        if state is False:
            remove(beat.pid, directory)
            continue
        beats.append(beat)
    return sorted(beats, key=lambda b: b.pid)


def judge(beats: Sequence[Beat], now: datetime, *, stale_after: float = STALE_AFTER) -> Verdict:
    """Healthy when there is a live process, each refreshed its file within ``stale_after``
    seconds and none reports a problem. Pure: ``beats`` are the live processes' files."""
    listed: list[Live] = []
    reasons: list[str] = []
    for b in beats:
        age = (now - b.beat_at).total_seconds()
        listed.append(
            Live(
                name=b.name,
                app=b.app,
                role=b.role,
                pid=b.pid,
                beat_age_s=round(age, 1),
                problems=list(b.problems),
            )
        )
        who = f"{b.name} ({b.role} of app {b.app!r})"
        if age > stale_after:
            reasons.append(f"{who}: not refreshed for {age:.0f} s (stuck)")
        if b.problems:
            reasons.append(f"{who}: {'; '.join(b.problems)}")
    if not beats:
        reasons.append(
            "no live service process (sagaloop engine, worker, dev) on this host has a liveness "
            f"file (is {RUN_DIR_ENV} the same for the services and for health?)"
        )
    reason = (
        "; ".join(reasons)
        or f"{len(beats)} live process(es), refreshed within {stale_after:.0f} s, no problem"
    )
    return Verdict(healthy=not reasons, processes=listed, reason=reason)
