"""Which registered processes are proven dead (issue 23, item 3): ``verdict`` as a table, and a
takeover releasing exactly the dead process's claims."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sagaloop.runtime.takeover import STALE_AFTER, Takeover, verdict
from sagaloop.store.processes import Identity, ProcessRecord
from sagaloop.store.sql import SqlStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ME = {"hostname": "h", "machine": "boot/ns", "pid": 100, "start": "500"}


def row(host: dict[str, object] | None, *, stopped: bool = False) -> ProcessRecord:
    return ProcessRecord(
        "dev@h:7", "shop", "dev", T0, T0, None, T0 if stopped else None, token="t", host=host
    )


HERE = {"hostname": "h", "machine": "boot/ns", "pid": 7, "start": "300"}
ELSEWHERE = {"hostname": "g", "machine": "other/ns", "pid": 7, "start": "300"}


@pytest.mark.parametrize(
    ("host", "alive", "start_now", "observed", "stopped", "dead"),
    [
        (HERE, False, None, 0.0, False, "its pid 7 is gone"),
        (HERE, True, "300", 0.0, False, None),
        (HERE, True, "300", 10 * STALE_AFTER, False, None),  # alive but silent: kept
        (HERE, True, "301", 0.0, False, "its pid 7 now belongs to another process"),
        (HERE, None, None, 0.0, False, None),
        ({**HERE, "pid": 100, "start": "500"}, True, "500", 99.0, False, None),  # myself
        ({**HERE, "pid": 100}, True, "500", 0.0, False, "its pid 100 is now this process's"),
        (ELSEWHERE, False, None, 0.0, False, None),  # another machine's pid says nothing
        (ELSEWHERE, None, None, STALE_AFTER - 1, False, None),
        (ELSEWHERE, None, None, STALE_AFTER, False, "its registry row was not refreshed"),
        (ELSEWHERE, None, None, 5.0, True, "it stopped"),
        (None, None, None, 1.0, False, None),
    ],
)
def test_verdict(
    host: dict[str, object] | None,
    alive: bool | None,
    start_now: str | None,
    observed: float,
    stopped: bool,
    dead: str | None,
) -> None:
    why = verdict(
        row(host, stopped=stopped),
        ME,
        observed,
        alive=lambda pid: alive,
        started=lambda pid: start_now,
    )
    assert (why is None) == (dead is None), why
    if dead is not None:
        assert why is not None and why.startswith(dead)


def test_a_takeover_releases_only_the_dead_processes_claims(tmp_path: Path) -> None:
    store = SqlStore(f"sqlite:///{tmp_path / 'db'}")
    store.upgrade()
    now = datetime.now(UTC)
    store.enqueue_raw([("q", b"{}")] * 3, now)
    dead = {"hostname": "h", "machine": "m", "pid": 2**22 + 12345, "start": None}
    live = {"hostname": "h", "machine": "m", "pid": 1, "start": None}
    store.process_started("worker@h:dead", "shop", "worker", now, Identity(["q"], [], "d", dead))
    store.process_started("worker@h:live", "shop", "worker", now, Identity(["q"], [], "l", live))
    store.claim_owner = "d"
    [first] = store.claim(["q"], 1, now, timedelta(minutes=1))
    store.claim_owner = "l"
    [second] = store.claim(["q"], 1, now, timedelta(minutes=1))
    assert first.claim_token.startswith("d.") and second.claim_token.startswith("l.")

    takeover = Takeover(store, "worker@h:me", "me")
    takeover.me = {**takeover.me, "machine": "m"}
    taken = takeover.sweep()

    assert [(name, [r.id for r in rows]) for name, _, rows in taken] == [
        ("worker@h:dead", [first.id])
    ]
    again = store.claim(["q"], 5, now, timedelta(minutes=1))
    assert first.id in {m.id for m in again} and second.id not in {m.id for m in again}
    assert [r.token for r in store.processes()] == [None, "l"]
    assert takeover.sweep() == [], "a process is taken over once"


def test_a_killed_child_not_yet_reaped_is_dead_and_a_running_one_alive() -> None:
    import signal
    import subprocess
    import sys

    from sagaloop.runtime.takeover import pid_alive
    from sagaloop.testing import eventually

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid) is True
        child.send_signal(signal.SIGKILL)
        eventually(lambda: pid_alive(child.pid) is False, what="the zombie to count as dead")
    finally:
        child.kill()
        child.wait()
    assert pid_alive(child.pid) is False
