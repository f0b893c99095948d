"""Approvals inside the run (``await ctx.approval(...)``): a request recorded and published, an
answer bound to the hash of the exact arguments asked about and used once, a deadline that
denies or escalates, all on existing primitives, so it survives restarts and replays. The
harness replays saga code on every activation: each test checks determinism too."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import pytest

import sagaloop
from sagaloop import App, Approval, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.errors import ValidationError
from sagaloop.sagas.approvals import args_hash
from sagaloop.testing import Harness, replay

app = App("approvals")
refunds: list[dict[str, Any]] = []
ARGS = {"order": "A-1", "cents": 1299}
DAY = timedelta(days=1)


@app.step()
def issue_refund(ctx: StepContext, order: str, cents: int) -> str:
    refunds.append({"order": order, "cents": cents})
    return f"refunded {cents} on {order}"


@app.saga(name="refund")
async def refund(ctx: SagaContext, args: dict[str, Any]) -> dict[str, Any]:
    ok = await ctx.approval("issue_refund", args, reason="the parcel never arrived")
    done = await ctx.call(issue_refund, **ok.args) if ok.approved else None
    return {"approval": ok.model_dump(), "done": done}


@app.saga(name="then-go")
async def then_go(ctx: SagaContext) -> dict[str, Any]:
    ok = await ctx.approval("issue_refund", ARGS, call_id="c-1")
    await ctx.wait_for_event("go")
    return ok.model_dump()


@app.saga(name="deadline")
async def deadline(ctx: SagaContext, on_timeout: Literal["deny", "escalate"]) -> dict[str, Any]:
    ok = await ctx.approval("issue_refund", ARGS, timeout=DAY, on_timeout=on_timeout)
    return ok.model_dump()


@app.saga(name="two-at-once")
async def two_at_once(ctx: SagaContext) -> list[Any]:
    first, second = await ctx.gather(
        ctx.approval("issue_refund", {"order": "A-1", "cents": 1}),
        ctx.approval("issue_refund", {"order": "A-2", "cents": 2}),
    )
    return [first.approved, second.approved]


@app.saga(name="same-id-twice")
async def same_id_twice(ctx: SagaContext) -> None:
    await ctx.approval("a", 1, call_id="x")
    await ctx.approval("b", 2, call_id="x")


@pytest.fixture(autouse=True)
def _clear() -> None:
    refunds.clear()


def waiting(env: Harness, run_id: str) -> str:
    """The run's status once the harness has nothing left to do without skipping time."""
    env.run_until_idle(skip_time=False)
    return env.get(run_id).status


def published(env: Harness, run_id: str, call_id: str = "0") -> dict[str, Any]:
    value: dict[str, Any] = env.client.get_published(run_id, f"approval:{call_id}")
    return value


def test_an_approval_is_published_pending_shown_by_status_then_approved() -> None:
    env = Harness(app)
    run_id = env.start(refund, ARGS)
    assert waiting(env, run_id) == "waiting"
    record = published(env, run_id)
    assert record == {
        "status": "pending",
        "action": "issue_refund",
        "args": ARGS,
        "args_hash": args_hash(ARGS),
        "reason": "the parcel never arrived",
        "deadline": None,
        "requested_at": "2026-01-01T00:00:00Z",
    }
    [pending] = env.approvals()
    assert (pending.run_id, pending.call_id, pending.saga) == (run_id, "0", "refund")
    assert (pending.action, pending.args, pending.status) == ("issue_refund", ARGS, "pending")
    status = env.status(run_id)
    prompt = status.prompts["approval:0"]
    assert prompt["approve"] == "issue_refund" and prompt["args"] == ARGS
    assert prompt["args_hash"] == args_hash(ARGS)
    assert prompt["answer"] == (
        f"sagaloop approve {run_id} 0, or sagaloop deny {run_id} 0 --reason TEXT"
    )
    [why] = status.waiting_for
    assert why.startswith('waiting for event \'approval:0\', asking {"approve": "issue_refund"')
    assert refunds == []

    env.approve(run_id, "0", by="alice")
    env.run_until_idle()
    assert env.result(run_id) == {
        "approval": {
            "call_id": "0",
            "approved": True,
            "args": ARGS,
            "edited": False,
            "reason": None,
            "by": "alice",
            "args_hash": args_hash(ARGS),
        },
        "done": "refunded 1299 on A-1",
    }
    assert refunds == [ARGS]
    record = published(env, run_id)
    assert record["status"] == "approved" and record["by"] == "alice"
    assert record["answered_at"] == "2026-01-01T00:00:00Z"
    assert "edited" not in record
    assert env.approvals() == [] and env.status(run_id).prompts == {}


def test_a_denial_returns_its_reason_and_nothing_runs() -> None:
    env = Harness(app)
    run_id = env.start(refund, ARGS)
    env.run_until_idle()
    env.deny(run_id, "0", reason="over the limit", by="bob")
    env.run_until_idle()
    result = env.result(run_id)
    assert result["done"] is None and refunds == []
    assert Approval(**result["approval"]) == Approval(
        call_id="0",
        approved=False,
        args=ARGS,
        edited=False,
        reason="over the limit",
        by="bob",
        args_hash=args_hash(ARGS),
    )
    record = published(env, run_id)
    assert (record["status"], record["answer_reason"], record["by"]) == (
        "denied",
        "over the limit",
        "bob",
    )
    with pytest.raises(ValidationError, match="reason"):
        env.deny(run_id, "0", reason=" ")


def test_edited_arguments_are_used_and_both_are_recorded_with_their_hashes() -> None:
    env = Harness(app)
    run_id = env.start(refund, ARGS)
    env.run_until_idle()
    edited = {"order": "A-1", "cents": 999}
    env.approve(run_id, "0", args=edited, by="alice")
    env.run_until_idle()
    approval = Approval(**env.result(run_id)["approval"])
    assert approval.approved and approval.edited
    assert approval.args == edited and approval.args_hash == args_hash(edited)
    assert refunds == [edited]
    record = published(env, run_id)
    assert record["status"] == "approved" and record["edited"] is True
    assert (record["args"], record["args_hash"]) == (ARGS, args_hash(ARGS))
    assert (record["edited_args"], record["edited_args_hash"]) == (edited, args_hash(edited))
    [answer] = [e.data["data"] for e in env.history(run_id) if e.kind == h.EVENT_ARRIVED]
    assert answer == {
        "approved": True,
        "args_hash": args_hash(ARGS),  # of the arguments asked about
        "args": edited,
        "reason": None,
        "by": "alice",
        "request_id": answer["request_id"],  # the request it answers, as the engine named it
    }
    assert len(answer["request_id"]) == 32


def refusals(env: Harness, run_id: str) -> list[str]:
    """Why the engine refused the answers it recorded as refused."""
    return [e.data["reason"] for e in env.history(run_id) if e.kind == h.EVENT_REJECTED]


def test_an_answer_for_other_arguments_is_refused_and_the_run_keeps_waiting() -> None:
    env = Harness(app)
    run_id = env.start(refund, ARGS)
    env.run_until_idle()
    other = args_hash({"order": "A-1", "cents": 129900})
    [pending] = env.approvals(run_id)
    rid = pending.request_id
    with pytest.raises(ValidationError, match=f"hash '{other[:12]}'"):  # the client checks
        env.send_event(
            run_id, "approval:0", {"approved": True, "args_hash": other, "request_id": rid}
        )
    # Sent anyway, straight to the engine's queue: the engine refuses it as it records it.
    env.publish_event(
        run_id, "approval:0", {"approved": True, "args_hash": other, "request_id": rid}
    )
    assert waiting(env, run_id) == "waiting"
    assert other[:12] in refusals(env, run_id)[-1]
    answer = {"approved": "yes", "args_hash": args_hash(ARGS), "request_id": rid}
    env.publish_event(run_id, "approval:0", answer)
    assert waiting(env, run_id) == "waiting"
    assert "approved" in refusals(env, run_id)[-1]
    assert published(env, run_id)["status"] == "pending"
    assert [p.call_id for p in env.approvals(run_id)] == ["0"]
    assert refunds == []

    env.approve(run_id, "0")  # the client sends the hash the request published
    env.run_until_idle()
    assert env.result(run_id)["approval"]["approved"] is True
    assert refunds == [ARGS]


def test_an_approval_is_used_once_a_second_answer_is_refused_or_ignored() -> None:
    env = Harness(app)
    run_id = env.start(then_go)
    env.run_until_idle()
    env.approve(run_id, "c-1", by="alice")
    assert waiting(env, run_id) == "waiting"  # now on "go"
    with pytest.raises(ValidationError, match="already approved"):
        env.deny(run_id, "c-1", reason="changed my mind")
    with pytest.raises(ValidationError, match="already approved"):
        env.approve(run_id, "c-1")
    # Sent anyway, as a raw event: refused as it is recorded, never used.
    deny = {"approved": False, "args_hash": args_hash(ARGS), "reason": "changed my mind"}
    [rid] = {e.data["data"]["request_id"] for e in env.history(run_id) if e.data.get("claim")}
    with pytest.raises(ValidationError, match="already approved"):
        env.send_event(run_id, "approval:c-1", {**deny, "request_id": rid})
    env.publish_event(run_id, "approval:c-1", {**deny, "request_id": rid})
    env.send_event(run_id, "go")
    env.run_until_idle()
    assert env.result(run_id)["approved"] is True
    assert published(env, run_id, "c-1")["status"] == "approved"
    with pytest.raises(ValidationError, match="completed"):
        env.approve(run_id, "c-1")


def test_an_unknown_approval_is_refused_saying_where_to_look() -> None:
    env = Harness(app)
    run_id = env.start(refund, ARGS)
    env.run_until_idle()
    with pytest.raises(ValidationError, match=f"sagaloop approvals --run {run_id}"):
        env.approve(run_id, "7")
    with pytest.raises(ValidationError, match="call_id is 1 to 191 characters"):
        env.approve(run_id, "x" * 200)
    with pytest.raises(ValidationError, match="by"):
        env.approve(run_id, "0", by=7)  # type: ignore[arg-type]


def test_the_deadline_denies_after_two_days() -> None:
    env = Harness(app)
    run_id = env.start(deadline, "deny")
    assert waiting(env, run_id) == "waiting"
    assert published(env, run_id)["deadline"] == "2026-01-02T00:00:00Z"
    assert "until 2026-01-02 00:00:00 UTC" in env.status(run_id).waiting_for[0]
    env.advance(timedelta(hours=23))
    assert env.get(run_id).status == "waiting"
    env.advance(timedelta(days=2))
    assert env.result(run_id) == {
        "call_id": "0",
        "approved": False,
        "args": ARGS,
        "edited": False,
        "reason": "deadline passed",
        "by": None,
        "args_hash": args_hash(ARGS),
    }
    record = published(env, run_id)
    assert record["status"] == "expired" and record["answer_reason"] == "deadline passed"
    assert record["answered_at"] == "2026-01-02T00:00:00Z"
    assert env.approvals() == []
    with pytest.raises(ValidationError, match="completed"):
        env.approve(run_id, "0")


def test_an_answer_before_the_deadline_wins_and_the_deadline_does_nothing_after() -> None:
    env = Harness(app)
    run_id = env.start(deadline, "deny")
    env.run_until_idle(skip_time=False)
    env.advance(timedelta(hours=12))
    env.approve(run_id, "0")
    env.advance(timedelta(days=2))
    assert env.result(run_id)["approved"] is True
    assert published(env, run_id)["status"] == "approved"


def test_a_refused_answer_keeps_the_original_deadline() -> None:
    env = Harness(app)
    run_id = env.start(deadline, "deny")
    env.run_until_idle(skip_time=False)
    env.advance(timedelta(hours=20))
    env.publish_event(run_id, "approval:0", {"approved": True, "args_hash": "0" * 64})
    env.advance(timedelta(hours=3))
    assert env.get(run_id).status == "waiting"
    assert "until 2026-01-02 00:00:00 UTC" in env.status(run_id).waiting_for[0]
    env.advance(timedelta(hours=2))
    assert env.result(run_id)["reason"] == "deadline passed"


def test_escalate_keeps_waiting_without_a_deadline() -> None:
    env = Harness(app)
    run_id = env.start(deadline, "escalate")
    env.run_until_idle(skip_time=False)
    env.advance(timedelta(days=2))
    assert env.get(run_id).status == "waiting"
    assert published(env, run_id)["status"] == "escalated"
    [pending] = env.approvals()
    assert pending.status == "escalated"
    assert env.status(run_id).prompts["approval:0"]["status"] == "escalated"
    assert "until" not in env.status(run_id).waiting_for[0]
    env.advance(timedelta(days=60))
    assert env.get(run_id).status == "waiting"
    env.approve(run_id, "0", by="manager")
    env.run_until_idle()
    assert env.result(run_id)["by"] == "manager"
    assert published(env, run_id)["status"] == "approved"


def test_an_approval_survives_restarts_and_its_history_replays() -> None:
    env = Harness(app, cache=True)  # as production: the run stays in memory until a restart
    run_id = env.start(refund, ARGS)
    env.run_until_idle()
    env.restart()
    env.publish_event(run_id, "approval:0", {"approved": True, "args_hash": "f" * 64})
    env.run_until_idle()
    env.restart()
    assert [p.call_id for p in env.approvals()] == ["0"]
    env.approve(run_id, "0", args={"order": "A-1", "cents": 5})
    env.restart()
    env.run_until_idle()
    assert env.result(run_id)["done"] == "refunded 5 on A-1"
    assert refunds == [{"order": "A-1", "cents": 5}]

    history = env.history(run_id)
    replay(app, history, run_id=run_id)  # the same path, from the recorded history alone
    kinds = {e.kind for e in history}
    assert kinds <= {
        h.RUN_STARTED,
        h.PUBLISHED,
        h.EVENT_WAITING,
        h.EVENT_ARRIVED,
        h.EVENT_REJECTED,
        h.STEP_SCHEDULED,
        h.STEP_DISPATCHED,
        h.STEP_COMPLETED,
        h.SAGA_FINISHED,
        h.RUN_FINISHED,
    }, "an approval is made of existing primitives"
    commands = [(e.kind, e.name) for e in history if e.kind in h.COMMAND_KINDS]
    assert commands == [
        (h.PUBLISHED, "approval:0"),
        (h.EVENT_WAITING, "approval:0"),  # the refused answer never reached it
        (h.PUBLISHED, "approval:0"),  # approved
        (h.STEP_SCHEDULED, "issue_refund"),
    ]


def test_two_approvals_at_once_get_their_own_call_ids() -> None:
    env = Harness(app)
    run_id = env.start(two_at_once)
    env.run_until_idle()
    pending = env.approvals(run_id)
    assert [(p.call_id, p.args["order"]) for p in pending] == [("0", "A-1"), ("2", "A-2")]
    env.deny(run_id, "2", reason="no")
    env.approve(run_id, "0")
    env.run_until_idle()
    assert env.result(run_id) == [True, False]


def test_approvals_lists_the_pending_ones_of_every_unfinished_run() -> None:
    env = Harness(app)
    first, second, done = env.start(refund, ARGS), env.start(then_go), env.start(refund, ARGS)
    env.run_until_idle()
    env.deny(done, "0", reason="no")
    env.run_until_idle()
    listed = {(p.run_id, p.call_id) for p in env.approvals()}
    assert listed == {(first, "0"), (second, "c-1")}
    assert env.approvals(done) == []


def test_a_call_id_used_twice_in_a_run_fails_it_saying_what_to_do() -> None:
    env = Harness(app)
    run_id = env.start(same_id_twice)
    env.run_until_idle()
    env.approve(run_id, "x")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed" and run.error is not None
    assert "its own call_id" in run.error["message"]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"on_timeout": "ignore"}, "on_timeout"),
        ({"timeout": timedelta(0)}, "positive"),
        ({"call_id": ""}, "call_id"),
        ({"args": float("nan")}, "NaN"),
    ],
)
def test_bad_arguments_fail_the_saga_code(kwargs: dict[str, Any], words: str) -> None:
    bad = App("bad-approvals")

    @bad.saga(name="ask")
    async def ask(ctx: SagaContext) -> None:
        await ctx.approval("act", **kwargs)

    env = Harness(bad)
    run_id = env.start(ask)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed" and run.error is not None
    assert words in run.error["message"], run.error


# --- a step declared approval=True -----------------------------------------------------------


def _approval_step_app() -> tuple[sagaloop.App, list[int], Any]:
    app = sagaloop.App("stepapproval")
    paid: list[int] = []

    @app.step(approval=True, approval_timeout=timedelta(days=2))
    def pay(ctx: sagaloop.StepContext, cents: int) -> int:
        paid.append(cents)
        return cents

    @app.saga
    async def s(ctx: sagaloop.SagaContext) -> str:
        try:
            return f"paid {await ctx.call(pay, 500)}"
        except sagaloop.ApprovalDenied as e:
            return f"denied: {e.reason}"

    return app, paid, s


def test_a_step_declared_with_approval_asks_before_each_call() -> None:
    app, paid, saga = _approval_step_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle(skip_time=False)  # the deadline is two days away
    [pending] = env.approvals(run_id)
    assert (pending.action, pending.args) == ("pay", {"cents": 500})
    assert paid == []
    env.approve(run_id, pending.call_id, args={"cents": 300})
    env.run_until_idle()
    assert env.result(run_id) == "paid 300" and paid == [300]


def test_a_denied_step_raises_approval_denied_in_the_saga() -> None:
    app, paid, saga = _approval_step_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle(skip_time=False)  # the deadline is two days away
    [pending] = env.approvals(run_id)
    env.deny(run_id, pending.call_id, reason="not today")
    env.run_until_idle()
    assert env.result(run_id) == "denied: not today" and paid == []
