"""`ctx.wait_for_any`: the first event of several names by arrival order, as a human-in-the-loop
graph needs (approve, reject or edit); events of other names keep their order; timeouts, models
and replay behave as for `wait_for_event`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from sagaloop import App, EventTimeoutError, Received, SagaContext
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope, engine_queue
from sagaloop.testing import Harness

app = App("wait-for-any")
DAY = timedelta(days=1)


class Edit(BaseModel):
    text: str


@app.saga(name="review")
async def review(ctx: SagaContext, draft: str) -> dict[str, Any]:
    """Approve, reject or edit (any number of times) a draft, within a day of each question."""
    edits = 0
    while True:
        try:
            got = await ctx.wait_for_any(
                ["approve", "reject", "edit"],
                timeout=DAY,
                models={"edit": Edit},
                prompt={"draft": draft},
            )
        except EventTimeoutError:
            return {"outcome": "timeout", "draft": draft, "edits": edits}
        assert isinstance(got, Received)
        if got.name == "edit":
            draft, edits = got.data.text, edits + 1
            continue
        return {"outcome": got.name, "draft": draft, "edits": edits, "by": got.data}


@app.saga(name="ordered")
async def ordered(ctx: SagaContext) -> list[Any]:
    first = await ctx.wait_for_any(["approve", "reject"])
    notes = [await ctx.wait_for_event("note"), await ctx.wait_for_event("note")]
    return [first.name, first.data, *notes]


def test_edits_then_an_approval_as_a_human_in_the_loop_graph_needs() -> None:
    env = Harness(app)
    run_id = env.start(review, "v1")
    env.run_until_idle(skip_time=False)
    assert env.status(run_id).prompts == {"approve|reject|edit": {"draft": "v1"}}
    assert any("'approve' or 'reject' or 'edit'" in w for w in env.status(run_id).waiting_for)
    env.send_event(run_id, "edit", {"text": "v2"})
    env.run_until_idle(skip_time=False)
    env.restart()  # replayed from the history alone
    env.send_event(run_id, "edit", {"text": "v3"})
    env.send_event(run_id, "approve", "ana")
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == {"outcome": "approve", "draft": "v3", "edits": 2, "by": "ana"}


def test_the_first_to_arrive_wins_and_other_names_keep_their_order() -> None:
    env = Harness(app)
    run_id = env.start(ordered)
    env.send_event(run_id, "note", 1)  # all before the saga waits: kept in arrival order
    env.send_event(run_id, "reject", "too late")
    env.send_event(run_id, "approve", "first?")
    env.send_event(run_id, "note", 2)
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) == ["reject", "too late", 1, 2]


def test_a_timeout_raises_and_an_event_that_does_not_fit_is_rejected() -> None:
    env = Harness(app)
    run_id = env.start(review, "v1")
    env.run_until_idle(skip_time=False)
    body = Envelope(type="event", run_id=run_id, payload={"name": "edit", "data": {"txt": "?"}})
    env.broker.publish([(engine_queue(app.name), body.to_bytes())])  # a plain publisher
    env.run_until_idle()  # the misfit is rejected; a day later the wait times out
    assert env.result(run_id) == {"outcome": "timeout", "draft": "v1", "edits": 0}
    [rejected] = [e for e in env.history(run_id) if e.kind == h.EVENT_REJECTED]
    assert rejected.name == "edit" and "text" in rejected.data["reason"]


def test_a_client_refuses_an_event_that_does_not_fit_the_any_wait() -> None:
    env = Harness(app)
    run_id = env.start(review, "v1")
    env.run_until_idle(skip_time=False)
    with pytest.raises(Exception, match="nothing was sent"):
        env.send_event(run_id, "edit", {"txt": "?"})
    env.send_event(run_id, "reject", None)
    env.run_until_idle(skip_time=False)
    assert env.result(run_id)["outcome"] == "reject"


def test_names_that_cannot_be_waited_for_fail_the_saga() -> None:
    bad = App("bad-any")

    @bad.saga(name="s")
    async def s(ctx: SagaContext) -> Any:
        return await ctx.wait_for_any([])

    env = Harness(bad)
    run_id = env.start(s)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed" and "wait_for_any" in (run.error or {}).get("message", "")
