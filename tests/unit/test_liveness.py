"""The liveness form of `sagaloop health` (``--live``): the files the service processes keep in
their run directory, how they are read and judged without the database, and the Runtime that
writes them on every beat, even while the database refuses the beat."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from sagaloop import App
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.cli.main import cli
from sagaloop.runtime import liveness
from sagaloop.runtime import service as services
from sagaloop.runtime.takeover import start_of
from sagaloop.store.processes import Identity
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


def beat(pid: int | None = None, *, age: float = 1.0, problems: list[str] | None = None) -> Any:
    pid = os.getpid() if pid is None else pid
    return liveness.Beat(
        name=f"dev@box:{pid}",
        app="shop",
        role="dev",
        pid=pid,
        host="box",
        started_at=NOW - timedelta(hours=1),
        beat_at=NOW - timedelta(seconds=age),
        problems=problems or [],
        process_start=start_of(pid),
    )


def test_a_written_file_is_read_back_and_judged_healthy(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    liveness.write(beat(), run_dir)
    liveness.write(beat(age=2.0), run_dir)  # rewritten in place, atomically
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in run_dir.iterdir()) == [f"{os.getpid()}.json"], "no temp file"
    data = json.loads((run_dir / f"{os.getpid()}.json").read_text())
    assert {"name", "app", "role", "pid", "host", "started_at", "beat_at", "problems"} <= set(data)
    [read] = liveness.read_all(run_dir)
    assert read == beat(age=2.0)
    verdict = liveness.judge([read], NOW)
    assert verdict.healthy, verdict.reason
    [listed] = verdict.processes
    assert (listed.name, listed.pid, listed.beat_age_s, listed.problems) == (
        f"dev@box:{os.getpid()}",
        os.getpid(),
        2.0,
        [],
    )
    liveness.remove(os.getpid(), run_dir)
    assert liveness.read_all(run_dir) == []


def test_a_file_older_than_three_beats_is_a_stuck_process() -> None:
    assert liveness.judge([beat(age=liveness.STALE_AFTER - 1)], NOW).healthy
    verdict = liveness.judge([beat(age=42.0)], NOW)
    assert not verdict.healthy
    assert "not refreshed for 42 s" in verdict.reason and f"dev@box:{os.getpid()}" in verdict.reason


def test_the_problems_a_process_reports_make_it_unhealthy() -> None:
    problems = ["thread 'worker-0' died: RuntimeError: boom", "activation of run r stalled"]
    verdict = liveness.judge([beat(problems=problems)], NOW)
    assert not verdict.healthy
    assert all(problem in verdict.reason for problem in problems)
    assert verdict.processes[0].problems == problems


def test_no_live_process_is_unhealthy(tmp_path: Path) -> None:
    assert liveness.read_all(tmp_path / "never-created") == []
    verdict = liveness.judge([], NOW)
    assert not verdict.healthy and "no live service process" in verdict.reason


def test_the_file_of_a_dead_pid_is_ignored_and_deleted(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = beat(child.pid)  # its start time recorded: a reused pid is told apart
    child.kill()
    child.wait()
    liveness.write(dead, tmp_path)
    liveness.write(beat(), tmp_path)
    assert [b.pid for b in liveness.read_all(tmp_path)] == [os.getpid()]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{os.getpid()}.json"]


def test_a_pid_now_of_another_process_is_dead_and_an_unknown_state_is_kept(
    tmp_path: Path,
) -> None:
    liveness.write(beat(4242).model_copy(update={"process_start": "1234"}), tmp_path / "a")
    reused = liveness.read_all(tmp_path / "a", alive=lambda _: True, started=lambda _: "other")
    assert reused == [] and not list((tmp_path / "a").iterdir())
    liveness.write(beat(4242), tmp_path / "b")
    assert len(liveness.read_all(tmp_path / "b", alive=lambda _: None)) == 1


def test_an_unreadable_file_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "77.json").write_text("{not json")
    liveness.write(beat(), tmp_path)
    assert [b.pid for b in liveness.read_all(tmp_path)] == [os.getpid()]


# The command.


def health(run_dir: Path, *args: str) -> Result:
    env = {"SAGALOOP_RUN_DIR": str(run_dir), "SAGALOOP_DATABASE_URL": "sqlite:////nonexistent/x"}
    return CliRunner().invoke(cli, ["health", "--live", *args], env=env, catch_exceptions=False)


def test_health_live_reads_the_files_only(tmp_path: Path) -> None:
    result = health(tmp_path, "--json")  # the database URL cannot be opened: not looked at
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["healthy"] is False and report["processes"] == []
    assert "no live service process" in report["reason"]

    liveness.write(beat(age=0.0).model_copy(update={"beat_at": datetime.now(UTC)}), tmp_path)
    result = health(tmp_path, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["healthy"] is True
    [p] = report["processes"]
    assert set(p) == {"name", "app", "role", "pid", "beat_age_s", "problems"}
    assert p["pid"] == os.getpid()
    text = health(tmp_path)
    assert text.exit_code == 0 and f"dev@box:{os.getpid()}" in text.output, text.output

    liveness.write(beat(problems=["thread 'timers' died: SystemExit: 2"]), tmp_path)
    text = health(tmp_path)
    assert text.exit_code == 1 and "thread 'timers' died" in text.output, text.output


@pytest.mark.parametrize("option", [["--local"], ["--max-outbox-age", "5"]])
def test_health_live_refuses_the_options_of_readiness(tmp_path: Path, option: list[str]) -> None:
    result = CliRunner().invoke(
        cli, ["health", "--live", *option], env={"SAGALOOP_RUN_DIR": str(tmp_path)}
    )
    assert result.exit_code == 2 and "readiness form" in result.output, result.output


# The Runtime that writes the file.


class RefusingRegistry:
    """A registry whose database refuses every write."""

    def process_started(
        self, name: str, app: str, role: str, now: datetime, identity: Identity | None = None
    ) -> None:
        raise OSError("database refuses connections")

    def process_seen(self, *args: Any, **kwargs: Any) -> bool:
        raise OSError("database refuses connections")

    def process_stopped(self, *args: Any) -> None:
        raise OSError("database refuses connections")

    def prune_processes(self, before: datetime) -> int:
        raise OSError("database refuses connections")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    store = SqlStore(f"sqlite:///{tmp_path / 'rt.db'}")
    store.upgrade()
    yield store
    store.close()


def test_the_runtime_writes_its_file_on_every_beat_while_the_database_refuses(
    store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(services, "SEEN_EVERY", 0.05)
    run_dir = tmp_path / "run"
    runtime = services.Runtime(
        App("shop"), store, DatabaseBroker(store), engine=False, queues=[], timers=False
    )
    runtime.name = f"dev@box:{os.getpid()}"
    runtime.start(registry=RefusingRegistry(), role="dev", run_dir=run_dir)
    try:
        [first] = liveness.read_all(run_dir)
        assert (first.name, first.app, first.role, first.pid) == (
            runtime.name,
            "shop",
            "dev",
            os.getpid(),
        )
        eventually(
            lambda: liveness.read_all(run_dir)[0].beat_at > first.beat_at,
            10,
            "the file to be refreshed although the database refuses every beat",
        )
        runtime.engine_problems.append(lambda: ["activation of run r stalled for 9 s"])
        eventually(
            lambda: (
                liveness.read_all(run_dir)[0].problems == ["activation of run r stalled for 9 s"]
            ),
            10,
            "the process's problems in its file",
        )
    finally:
        runtime.stop(timeout=10)
    assert not list(run_dir.iterdir()), "a clean stop removes the file"
