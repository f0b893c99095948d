"""Approvals against hostile and careless answers (issue 22, section 1): an answer counts only
if its request was recorded before it, one answer wins and every other caller is told it lost
(with no engine running), edited arguments are checked where they are given and a bad one
never fails the run, an app's console and MCP server know only its runs, and the pending
approvals are listed page by page from an index."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.errors import ApprovalTakenError, RunNotFoundError, RunStateError, ValidationError
from sagaloop.sagas.approvals import args_hash
from sagaloop.testing import Harness

app = App("gates")
paid: list[dict[str, Any]] = []
ARGS = {"customer": "ann", "cents": 1299}


class Refund(BaseModel):
    model_config = ConfigDict(extra="forbid")
    customer: str
    cents: int


@app.step(approval=True, approval_timeout=timedelta(days=2))
def pay(ctx: StepContext, customer: str, cents: int) -> int:
    paid.append({"customer": customer, "cents": cents})
    return cents


@app.step()
def refund_step(ctx: StepContext, customer: str, cents: int) -> int:
    paid.append({"customer": customer, "cents": cents})
    return cents


@app.step()
def reverse(ctx: StepContext, customer: str, cents: int, result: int) -> None:
    paid.append({"customer": customer, "cents": -cents})


@app.saga(name="pay")
async def pay_saga(ctx: SagaContext, args: dict[str, Any]) -> int:
    return int(await ctx.call(pay, **args))


@app.saga(name="typed")
async def typed(ctx: SagaContext, args: dict[str, Any]) -> dict[str, Any]:
    ok = await ctx.approval("refund", args, args_type=Refund)
    if not ok.approved:
        return {"approved": False}
    await ctx.call(refund_step, **ok.args)
    return {"approved": True, "args": ok.args}


@app.saga(name="then-go")
async def then_go(ctx: SagaContext) -> bool:
    ok = await ctx.approval("refund", ARGS)
    await ctx.wait_for_event("go")  # the run lives on: later answers reach the engine
    return ok.approved


@pytest.fixture(autouse=True)
def _clear() -> None:
    paid.clear()


def refusals(env: Harness, run_id: str) -> list[str]:
    return [e.data["reason"] for e in env.history(run_id) if e.kind == h.EVENT_REJECTED]


def early_answer(cents: int) -> dict[str, Any]:
    """An answer an attacker writes without seeing the request: the arguments are known, so
    their hash is too."""
    return {
        "approved": True,
        "args_hash": args_hash(ARGS),
        "args": {"customer": "ann", "cents": cents},
        "by": "CFO",
    }


def test_an_answer_sent_right_after_start_is_recorded_as_refused_and_never_used() -> None:
    env = Harness(app)
    run_id = env.start(typed, ARGS)
    env.send_event(run_id, "approval:0", early_answer(999_999))  # before the request exists
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting", "the early answer did not settle it"
    assert paid == []
    assert "written before its request" in refusals(env, run_id)[0]
    [pending] = env.approvals(run_id)
    assert pending.status == "pending"
    env.approve(run_id, "0", by="alice")
    env.run_until_idle()
    assert env.result(run_id) == {"approved": True, "args": ARGS}
    assert paid == [ARGS]


def test_a_blind_answer_sent_once_the_request_exists_is_refused_too() -> None:
    """send_event fills nothing in: an answer that does not name the request (it was not
    written from it) is refused, even if the request was already recorded when it was sent."""
    env = Harness(app)
    run_id = env.start(typed, ARGS)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "approval:0", early_answer(999_999))
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting" and paid == []
    assert "names no request_id" in refusals(env, run_id)[0]


def test_an_answer_delivered_with_the_start_is_refused_too() -> None:
    env = Harness(app)
    run_id = env.client.start(typed, ARGS, event=("approval:0", early_answer(999_999)))
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting" and paid == []
    assert refusals(env, run_id), "the answer was recorded as refused"


def test_a_raw_answer_that_does_not_name_the_request_is_refused() -> None:
    """Even once the request exists, an answer from a publisher that never read it (it does
    not know the request_id) is refused: so a start and an answer published together fail."""
    env = Harness(app)
    run_id = env.start(typed, ARGS)
    env.run_until_idle(skip_time=False)
    env.publish_event(run_id, "approval:0", early_answer(999_999))
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting" and paid == []
    assert "request_id" in refusals(env, run_id)[0]


def test_approve_and_deny_racing_with_no_engine_running_one_wins_the_other_is_told() -> None:
    env = Harness(app)
    run_id = env.start(typed, ARGS)
    env.run_until_idle(skip_time=False)
    # The engine is down from here (the harness runs nothing until run_until_idle).
    env.deny(run_id, "0", reason="fraud", by="bob")
    with pytest.raises(ApprovalTakenError, match="denied by 'bob'"):
        env.approve(run_id, "0", by="alice")
    [pending] = env.approvals(run_id)
    answer = {"approved": True, "args_hash": args_hash(ARGS), "request_id": pending.request_id}
    with pytest.raises(ApprovalTakenError):
        env.send_event(run_id, "approval:0", answer)
    env.run_until_idle()
    assert env.result(run_id) == {"approved": False}
    assert paid == []


def test_a_raw_answer_that_loses_to_a_claimed_one_is_refused_by_the_engine() -> None:
    env = Harness(app)
    run_id = env.start(then_go)
    env.run_until_idle(skip_time=False)
    [pending] = env.approvals(run_id)
    answer = {"approved": True, "args_hash": args_hash(ARGS), "request_id": pending.request_id}
    env.publish_event(run_id, "approval:0", answer)  # queued first...
    env.deny(run_id, "0", reason="fraud")  # ...but this one claimed the request first
    env.send_event(run_id, "go")
    env.run_until_idle()
    assert env.result(run_id) is False
    assert refusals(env, run_id) == [
        "another answer won this approval first (one answer per request)"
    ]


def test_the_first_of_two_raw_answers_wins_and_the_second_is_refused() -> None:
    env = Harness(app)
    run_id = env.start(then_go)
    env.run_until_idle(skip_time=False)
    [pending] = env.approvals(run_id)
    yes = {"approved": True, "args_hash": args_hash(ARGS), "request_id": pending.request_id}
    no = {**yes, "approved": False, "reason": "no"}
    env.publish_event(run_id, "approval:0", no)
    env.publish_event(run_id, "approval:0", yes)
    env.send_event(run_id, "go")
    env.run_until_idle()
    assert env.result(run_id) is False
    [refused] = refusals(env, run_id)
    assert "already denied" in refused


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"customer": "ann"}, "cents"),  # a required field missing
        ({"customer": "ann", "cents": 5, "iban": "x"}, "iban"),  # an extra field
        (["ann", 5], "arguments"),  # not an object
        ({"customer": "ann", "cents": "lots"}, "cents"),
    ],
)
def test_an_edit_that_does_not_fit_the_step_is_refused_by_the_client(edit: Any, words: str) -> None:
    env = Harness(app)
    run_id = env.start(pay_saga, ARGS)
    env.run_until_idle(skip_time=False)
    [pending] = env.approvals(run_id)
    with pytest.raises(ValidationError, match="edited arguments") as e:
        env.approve(run_id, pending.call_id, args=edit)
    assert words in str(e.value)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting" and paid == []
    env.approve(run_id, pending.call_id, args={"customer": "ann", "cents": 5})
    env.run_until_idle()
    assert env.result(run_id) == 5


def test_an_invalid_edit_sent_raw_is_refused_and_the_approval_keeps_waiting() -> None:
    """The client's check skipped: the run checks the edit itself, refuses it as an answer,
    and lets another answer win (a bad answer never fails the run nor compensates)."""
    env = Harness(app)
    for saga, call in ((pay_saga, None), (typed, "0")):
        run_id = env.start(saga, ARGS)
        env.run_until_idle(skip_time=False)
        [pending] = env.approvals(run_id)
        bad = {
            "approved": True,
            "args_hash": pending.args_hash,
            "request_id": pending.request_id,
            "args": {"customer": "ann"},
        }
        env.publish_event(run_id, f"approval:{call or pending.call_id}", bad)
        env.run_until_idle(skip_time=False)
        assert env.get(run_id).status == "waiting"
        record = env.client.get_published(run_id, f"approval:{pending.call_id}")
        assert "edited arguments" in record["last_refused"]
        env.approve(run_id, pending.call_id, by="alice")  # the claim was given back
        env.run_until_idle()
        assert env.get(run_id).status == "completed"
    assert paid == [ARGS, ARGS]


def test_a_typed_approval_publishes_its_schema_and_the_client_checks_edits_with_it() -> None:
    env = Harness(app)
    run_id = env.start(typed, ARGS)
    env.run_until_idle(skip_time=False)
    record = env.client.get_published(run_id, "approval:0")
    assert record["args_schema"]["required"] == ["customer", "cents"]
    with pytest.raises(ValidationError, match="edited arguments"):
        env.approve(run_id, "0", args={"customer": "ann", "cents": 1, "extra": 1})


# --- apps that share a database ---------------------------------------------------------------

other = App("payroll")


@other.saga(name="payroll")
async def payroll(ctx: SagaContext, cents: int) -> bool:
    return (await ctx.approval("pay salary", {"cents": cents})).approved


def test_a_scoped_client_knows_only_its_apps_runs() -> None:
    env = Harness(other)
    run_id = env.start(payroll, 500_000)
    env.run_until_idle(skip_time=False)
    from sagaloop.client import Client

    shop = Client(env.store, app).scoped()
    for call in (
        lambda: shop.get(run_id),
        lambda: shop.status(run_id),
        lambda: shop.approve(run_id, "0"),
        lambda: shop.send_event(run_id, "approval:0", {"approved": True}),
        lambda: shop.approvals(run_id),
        lambda: shop.cancel(run_id),
        lambda: shop.get_published(run_id, "approval:0"),
    ):
        with pytest.raises(RunNotFoundError):
            call()
    assert shop.approvals() == [] and shop.list() == [] and shop.count() == {}
    assert [p.run_id for p in env.approvals()] == [run_id]


def test_a_start_never_returns_a_run_whose_input_differs() -> None:
    env = Harness(app)
    env.start(typed, ARGS, run_id="r-1")
    assert env.start(typed, ARGS, run_id="r-1") == "r-1"  # the same start again: idempotent
    with pytest.raises(RunStateError, match="another input"):
        env.start(typed, {"customer": "eve", "cents": 1}, run_id="r-1")


# --- listing -----------------------------------------------------------------------------------


def test_pending_approvals_are_listed_page_by_page_and_leave_the_index_when_settled() -> None:
    env = Harness(app)
    runs = [env.start(typed, {"customer": f"c{i}", "cents": i}) for i in range(120)]
    env.run_until_idle(skip_time=False)
    seen: list[str] = []
    after = None
    while True:
        page = env.client.approvals(after=after, limit=50)
        if not page:
            break
        assert len(page) <= 50
        seen.extend(p.run_id for p in page)
        after = page[-1].cursor
    assert sorted(seen) == sorted(runs) and len(set(seen)) == 120
    env.approve(runs[0], "0")
    env.deny(runs[1], "0", reason="no")
    env.run_until_idle()
    left = {p.run_id for p in env.client.approvals(limit=1000)}
    assert runs[0] not in left and runs[1] not in left and len(left) == 118
    assert env.client.store.approval(None, runs[0], "0") is None, "a finished run's are gone"
    with pytest.raises(ValidationError, match="cursor"):
        env.client.approvals(after="nonsense")
    with pytest.raises(ValidationError, match="1 to 1000"):
        env.client.approvals(limit=0)


def test_a_database_upgraded_to_v4_indexes_the_approvals_runs_already_wait_for(
    tmp_path: Any,
) -> None:
    import sqlalchemy as sa

    from sagaloop.store import migrations

    url = f"sqlite:///{tmp_path / 'v3.db'}"
    env = Harness(app, url=url)
    run_id = env.start(typed, ARGS)
    env.run_until_idle(skip_time=False)
    with env.store.engine.begin() as conn:  # as version 3 left it: no index
        conn.execute(sa.text("DROP TABLE sagaloop_approvals"))
        for column in ("abandoned", "queues", "app_queues", "token", "host"):  # v4's too
            conn.execute(sa.text(f"ALTER TABLE sagaloop_processes DROP COLUMN {column}"))
        for index in ("sagaloop_runs_app",):  # and v5's
            conn.execute(sa.text(f"DROP INDEX {index}"))
        conn.execute(sa.text("UPDATE sagaloop_schema SET version = 3"))
    assert env.store.upgrade() == (3, migrations.LATEST)
    [pending] = env.approvals()
    assert (pending.run_id, pending.call_id, pending.status) == (run_id, "0", "pending")
    env.approve(run_id, "0")
    env.run_until_idle()
    assert env.result(run_id) == {"approved": True, "args": ARGS}


def test_the_console_and_the_mcp_server_of_one_app_do_not_touch_another_apps_runs(
    tmp_path: Any,
) -> None:
    """On a shared database: the shop's MCP server and console cannot read, signal or
    approve the payroll app's 500,000-cent payment."""
    from starlette.testclient import TestClient

    from sagaloop.client import Client
    from sagaloop.mcp_server.server import SagaMCPServer
    from sagaloop.ui import create_app

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    payroll_env = Harness(other, url=url)
    run_id = payroll_env.start(payroll, 500_000)
    payroll_env.run_until_idle(skip_time=False)
    shop = Client(payroll_env.store, app)

    server = SagaMCPServer(shop, app)
    for tool, args in (
        ("run_status", {"run_id": run_id}),
        ("send_event", {"run_id": run_id, "name": "approval:0", "data": {"approved": True}}),
        ("approve", {"run_id": run_id, "call_id": "0"}),
        ("deny", {"run_id": run_id, "call_id": "0", "reason": "no"}),
        ("list_approvals", {"run_id": run_id}),
    ):
        with pytest.raises(RunNotFoundError):
            server.answer(tool, dict(args), "assistant")
    assert server.answer("list_approvals", {}, "assistant") == {"approvals": [], "next": None}

    console = TestClient(create_app(shop, app), base_url="http://127.0.0.1:8765")
    assert console.get("/run", params={"id": run_id}).status_code == 404
    assert run_id not in console.get("/approvals").text
    assert run_id not in console.get("/runs").text
    [pending] = payroll_env.approvals()
    assert pending.status == "pending", "nothing reached the payroll run"


def test_the_cli_lists_approvals_a_page_at_a_time(tmp_path: Any, monkeypatch: Any) -> None:
    import json

    from click.testing import CliRunner

    from sagaloop.cli.main import cli

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = Harness(app, url=url)
    runs = {env.start(typed, {"customer": f"c{i}", "cents": i}) for i in range(5)}
    env.run_until_idle(skip_time=False)
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)
    first = CliRunner().invoke(cli, ["approvals", "--limit", "3", "--json"])
    assert first.exit_code == 0, first.output
    page = json.loads(first.output)
    assert len(page) == 3 and all(len(p["request_id"]) == 32 for p in page)
    text = CliRunner().invoke(cli, ["approvals", "--limit", "3"]).output
    assert "next page: sagaloop approvals --after" in text
    rest = CliRunner().invoke(cli, ["approvals", "--after", page[-1]["cursor"], "--json"])
    assert {p["run_id"] for p in page + json.loads(rest.output)} == runs


def test_a_fork_that_keeps_an_open_request_can_be_answered() -> None:
    env = Harness(app)
    run_id = env.start(typed, ARGS)
    env.run_until_idle(skip_time=False)
    [waiting] = [e.pos for e in env.history(run_id) if e.kind == h.EVENT_WAITING]
    fork = env.client.fork(run_id, at=waiting, run_id="forked")
    env.run_until_idle(skip_time=False)
    [pending] = env.approvals("forked")
    assert pending.request_id != env.approvals(run_id)[0].request_id, "its own request"
    env.approve(fork, "0", by="alice")
    env.run_until_idle()
    assert env.result(fork) == {"approved": True, "args": ARGS}
    assert env.get(run_id).status == "waiting", "the source still waits for its own answer"


def test_status_says_why_an_answer_was_refused() -> None:
    env = Harness(app)
    run_id = env.start(typed, ARGS)
    env.send_event(run_id, "approval:0", early_answer(999_999))
    env.run_until_idle(skip_time=False)
    [line] = env.status(run_id).waiting_for
    assert "'approval:0'" in line and "1 refused, the last: it names no request_id" in line
