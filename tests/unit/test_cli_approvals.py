"""`sagaloop approvals`, `approve` and `deny`: list what runs wait for, answer it, and refuse
in one line an answer that would not count. The runs are driven by a harness on the CLI's
database."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cli_env import cli_database, run

from sagaloop.sagas.approvals import args_hash
from sagaloop.testing import Harness, VirtualClock

APP = """
from datetime import timedelta
from typing import Any

from sagaloop import App, SagaContext

app = App("approvals_cli")


@app.saga(name="refund")
async def refund(ctx: SagaContext, args: dict[str, Any]) -> dict[str, Any]:
    ok = await ctx.approval(
        "issue_refund", args, timeout=timedelta(days=1), reason="the parcel never arrived"
    )
    return ok.model_dump()
"""
ARGS = {"order": "A-1", "cents": 1299}
START = datetime(2100, 1, 1, tzinfo=UTC)
"""The harness's virtual time: after the real time at which the CLI writes its messages."""


def harness(module: Any, db: Path) -> Harness:
    return Harness(module.app, url=f"sqlite:///{db}", clock=VirtualClock(START))


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    db = cli_database(tmp_path, monkeypatch, "approvals_cli", APP)
    import approvals_cli

    env = harness(approvals_cli, db)
    yield env
    env.close()


def start(env: Harness, run_id: str, args: dict[str, Any] = ARGS) -> str:
    env.start("refund", args, run_id=run_id)
    env.run_until_idle(skip_time=False)
    return run_id


def error_line(output: str) -> str:
    [line] = [x for x in output.strip().splitlines() if x.startswith("Error")]
    return line


def test_approvals_lists_what_runs_wait_for(env: Harness) -> None:
    assert run("approvals").output.strip() == "no approval is pending"
    start(env, "dispute-1")
    start(env, "dispute-2", {"order": "B-2", "cents": 5})
    text = run("approvals").output
    lines = text.splitlines()
    assert lines[0].split() == [
        "run",
        "call",
        "action",
        "args",
        "hash",
        "deadline",
        "(UTC)",
        "status",
    ]
    row = lines[2].split("  ")
    row = [x.strip() for x in row if x.strip()]
    assert row == [
        "dispute-1",
        "0",
        "issue_refund",
        '{"order": "A-1", "cents": 1299}',
        args_hash(ARGS)[:12],
        "2100-01-02 00:00:00",
        "pending",
    ]
    assert "dispute-2" in lines[3]
    assert "sagaloop approve RUN CALL" in text

    only = run("approvals", "--run", "dispute-2", "--json")
    assert only.exit_code == 0
    [pending] = json.loads(only.output)
    assert pending["run_id"] == "dispute-2" and pending["call_id"] == "0"
    assert pending["args"] == {"order": "B-2", "cents": 5}
    assert pending["args_hash"] == args_hash({"order": "B-2", "cents": 5})
    assert pending["deadline"] == "2100-01-02T00:00:00Z" and pending["status"] == "pending"
    assert pending["reason"] == "the parcel never arrived"


def test_status_shows_the_pending_approval_and_how_to_answer(env: Harness) -> None:
    start(env, "dispute-1")
    text = run("status", "dispute-1").output
    assert "waiting for event 'approval:0' until 2100-01-02 00:00:00 UTC" in text, text
    asked = '0: issue_refund {"order": "A-1", "cents": 1299} (pending): the parcel never arrived'
    assert f"approvals asked:\n  {asked}\n" in text, text
    assert (
        "answer: sagaloop approve dispute-1 0, or sagaloop deny dispute-1 0 --reason TEXT" in text
    )
    assert "approval:0 =" not in text, "the request is shown once, under approvals asked"
    data = json.loads(run("status", "dispute-1", "--json").output)
    assert data["prompts"]["approval:0"]["args_hash"] == args_hash(ARGS)
    assert data["published"]["approval:0"]["status"] == "pending"


def test_approve_with_edited_arguments_and_by(env: Harness) -> None:
    start(env, "dispute-1")
    result = run(
        "approve", "dispute-1", "0", "--args", '{"order": "A-1", "cents": 999}', "--by", "ada"
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "approved with edited arguments: run dispute-1, call 0"
    env.run_until_idle()
    approval = env.result("dispute-1")
    assert approval["approved"] and approval["edited"] and approval["by"] == "ada"
    assert approval["args"] == {"order": "A-1", "cents": 999}
    assert run("approvals").output.strip() == "no approval is pending"

    again = run("deny", "dispute-1", "0", "--reason", "too late")
    assert again.exit_code != 0
    assert "is completed" in error_line(again.output)


def test_deny_sends_the_reason_to_the_run(env: Harness) -> None:
    start(env, "dispute-1")
    result = run("deny", "dispute-1", "0", "--reason", "over the limit")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "denied: run dispute-1, call 0"
    env.run_until_idle(skip_time=False)
    approval = env.result("dispute-1")
    assert not approval["approved"] and approval["reason"] == "over the limit"


def test_a_second_answer_before_the_run_finished_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = APP.replace(
        "return ok.model_dump()", 'await ctx.wait_for_event("go")\n    return ok.model_dump()'
    )
    db = cli_database(tmp_path, monkeypatch, "approvals_cli_go", app)
    import approvals_cli_go

    env = harness(approvals_cli_go, db)
    env.start("refund", ARGS, run_id="d-1")
    env.run_until_idle(skip_time=False)
    assert run("approve", "d-1", "0").exit_code == 0
    env.run_until_idle(skip_time=False)
    again = run("approve", "d-1", "0")
    assert again.exit_code != 0
    line = error_line(again.output)
    assert "is already approved" in line and "answered once" in line
    env.close()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["approve", "dispute-1", "7"],
            ["asked no approval '7'", "sagaloop approvals --run dispute-1"],
        ),
        (["approve", "nobody", "0"], ["no run with id 'nobody'"]),
        (["approve", "dispute-1", "0", "--args", "{nope"], ["--args", "not valid JSON"]),
        (["approve", "dispute-1", "0", "--args", "null"], ["leave --args out"]),
        (["deny", "dispute-1", "0"], ["--reason"]),
        (["deny", "dispute-1", "0", "--reason", ""], ["needs a reason"]),
    ],
)
def test_answers_that_would_not_count_are_refused_in_one_line(
    env: Harness, args: list[str], words: list[str]
) -> None:
    start(env, "dispute-1")
    result = run(*args)
    assert result.exit_code != 0
    line = error_line(result.output)
    for word in words:
        assert word in line, line
    assert env.approvals("dispute-1")[0].status == "pending"
    env.run_until_idle(skip_time=False)
    assert env.get("dispute-1").status == "waiting"
