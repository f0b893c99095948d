"""`sagaloop export`, `replay` and `fork`: the documents export writes, the deploy gate's lines
and exit statuses (0 all replay, 1 one diverged, 2 a file is not a history), and forks from
the command line. Runs are driven by a harness on the CLI's database."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cli_env import cli_database, run

from sagaloop.cli.deploys import file_name
from sagaloop.testing import Harness, VirtualClock, replay

V1 = """
from sagaloop import App, SagaContext, StepContext

app = App("deploys_cli")


@app.step()
def reserve(ctx: StepContext, order: str) -> str:
    return f"reserved {order}"


@app.step()
def check(ctx: StepContext, order: str) -> str:
    return f"checked {order}"


@app.step()
def ship(ctx: StepContext, order: str) -> str:
    return f"shipped {order}"


@app.saga(name="order")
async def order(ctx: SagaContext, order: str) -> list[str]:
    done = [await ctx.call(reserve, order)]
    CHANGE
    await ctx.wait_for_event("paid")
    done.append(await ctx.call(ship, order))
    return done
"""
MODULES = {
    "deploys_cli": V1.replace("CHANGE", "pass"),
    "deploys_cli_v2": V1.replace(
        "CHANGE",
        'if ctx.patched("check-orders"):\n        done.append(await ctx.call(check, order))',
    ),
    "deploys_cli_bad": V1.replace("CHANGE", "done.append(await ctx.call(check, order))"),
}
START = datetime(2100, 1, 1, tzinfo=UTC)
"""The harness's virtual time: after the real time at which the CLI writes its messages."""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    db = cli_database(tmp_path, monkeypatch, "deploys_cli", MODULES["deploys_cli"])
    for name, source in MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    import deploys_cli

    env = Harness(deploys_cli.app, url=f"sqlite:///{db}", clock=VirtualClock(START))
    yield env
    env.close()


def waiting(env: Harness, run_id: str) -> str:
    env.start("order", run_id, run_id=run_id)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    return run_id


def error_line(output: str) -> str:
    [line] = [x for x in output.strip().splitlines() if x.startswith("Error")]
    return line


def test_export_writes_the_run_its_commands_and_events(env: Harness, tmp_path: Path) -> None:
    waiting(env, "o-1")
    result = run("export", "o-1")
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.output)
    assert {k: doc[k] for k in ("format", "version", "app", "saga", "run_id", "status")} == {
        "format": "sagaloop-history",
        "version": 1,
        "app": "deploys_cli",
        "saga": "order",
        "run_id": "o-1",
        "status": "waiting",
    }
    assert doc["commands"] == [
        {"position": 0, "command": "call", "name": "reserve", "done": True},
        {"position": 1, "command": "wait_for_event", "name": "paid", "done": False},
    ]
    assert [(e["kind"], e["pos"]) for e in doc["events"]] == [
        ("run_started", None),
        ("step_scheduled", 0),
        ("step_completed", 0),
        ("event_waiting", 1),
    ]
    out = tmp_path / "o-1.json"
    assert run("export", "o-1", "-o", str(out), "--format", "json").output == ""
    assert json.loads(out.read_text()) == doc
    replay(env.app, out.read_text())  # sagaloop.testing.replay takes the document too


def test_export_refuses_in_one_line_and_writes_nothing(env: Harness, tmp_path: Path) -> None:
    out = tmp_path / "nope.json"
    result = run("export", "nope", "-o", str(out))
    assert result.exit_code == 1
    assert error_line(result.output) == "Error: no run with id 'nope'"
    assert not out.exists()
    assert "name a RUN_ID, or give --all" in run("export").output
    assert "--saga and --status go with --all" in run("export", "x", "--saga", "order").output
    assert "-o DIR" in run("export", "--all").output


def test_export_all_writes_a_file_per_run_in_flight(env: Harness, tmp_path: Path) -> None:
    waiting(env, "o-1")
    waiting(env, "shop/o-2")  # not a plain file name
    env.start("order", "done", run_id="o-3")
    env.run_until_idle(skip_time=False)
    env.send_event("o-3", "paid")
    env.run_until_idle(skip_time=False)
    folder = tmp_path / "histories"
    result = run("export", "--all", "-o", str(folder))
    assert result.output.strip() == f"exported 2 runs to {folder}"
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(["o-1.json", file_name("shop/o-2")])
    assert file_name("shop/o-2").startswith("shop_o-2-")
    assert json.loads((folder / file_name("shop/o-2")).read_text())["run_id"] == "shop/o-2"
    done = tmp_path / "done"
    run("export", "--all", "--status", "completed", "--saga", "order", "-o", str(done))
    assert [p.name for p in done.iterdir()] == ["o-3.json"]


def test_replay_is_the_deploy_gate(env: Harness, tmp_path: Path) -> None:
    for run_id in ("o-1", "o-2"):
        waiting(env, run_id)
        run("export", run_id, "-o", str(tmp_path / f"{run_id}.json"))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(json.loads((tmp_path / "o-2.json").read_text())["events"]))
    files = [str(tmp_path / "o-1.json"), str(bare)]
    for app in ("deploys_cli", "deploys_cli_v2"):
        result = run("replay", *files, "--app", app)
        assert result.exit_code == 0, result.output
        assert result.output.splitlines() == [
            f"{files[0]}: ok (run 'o-1', 4 events)",
            f"{files[1]}: ok (run 'replay', 4 events)",
        ]
    result = run("replay", str(tmp_path), "--app", "deploys_cli_bad")  # a folder: its files
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert len(lines) == 4
    assert lines[1] == (
        f"{tmp_path / 'o-1.json'}: diverged: run 'o-1': non-deterministic saga code: the "
        "history has wait_for_event('paid') at position 1, the code now issues "
        "call('check') at position 1"
    )
    assert lines[3].startswith("to fix: the code about to be deployed must issue the recorded")
    assert "ctx.patched('change-id')" in lines[3], "once, after the histories, what to do"


def test_replay_refuses_what_is_not_a_history_with_status_2(env: Harness, tmp_path: Path) -> None:
    cases = {
        "missing.json": None,
        "text.json": "not json",
        "object.json": '{"hello": 1}',
        "newer.json": '{"format": "sagaloop-history", "version": 99, "events": []}',
        "start.json": "[]",
    }
    expected = {
        "missing.json": "cannot read it: No such file or directory",
        "text.json": "not JSON: Expecting value: line 1 column 1 (char 0)",
        "object.json": "not a history: an object must be the document `sagaloop export` writes",
        "newer.json": "history format version 99: this sagaloop reads versions up to 1",
        "start.json": "the history has no run_started event",
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        result = run("replay", str(path), "--app", "deploys_cli")
        assert result.exit_code == 2, result.output
        assert error_line(result.output).startswith(f"Error: {path}: {expected[name]}")
    (tmp_path / "empty").mkdir()
    result = run("replay", str(tmp_path / "empty"), "--app", "deploys_cli")
    assert result.exit_code == 2 and "no .json file in this folder" in result.output


def test_fork_from_the_command_line(env: Harness) -> None:
    waiting(env, "o-1")
    env.send_event("o-1", "paid")
    env.run_until_idle(skip_time=False)
    result = run("fork", "o-1", "--at", "1", "--run-id", "o-1-again", "--app", "deploys_cli")
    assert (result.exit_code, result.output) == (0, "o-1-again\n")
    env.run_until_idle(skip_time=False)
    assert env.get("o-1-again").status == "waiting", "the wait at the cut is issued again"
    doc = json.loads(run("export", "o-1-again").output)
    assert doc["forked_from"] == {"run_id": "o-1", "position": 1}
    result = run("fork", "o-1", "--at", "9", "--app", "deploys_cli")
    assert result.exit_code == 1
    assert error_line(result.output) == (
        "Error: position 9 is outside the history of run 'o-1', which holds positions 0 to 2: "
        "fork at 0 to 3 (`sagaloop export` lists its commands)"
    )
    result = run("fork", "o-1", "--at", "2", "--app", "deploys_cli_bad")
    assert result.exit_code == 1
    assert "cannot fork run 'o-1' at position 2" in error_line(result.output)
