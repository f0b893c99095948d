"""``wait_for_event(..., early="refuse")``: an event sent before the wait began is refused
(recorded as rejected, never returned), so an answer counts only if it was sent to that wait:
a budget raised before the budget was reached does not raise it in advance."""

from __future__ import annotations

from sagaloop import App, SagaContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness, replay

app = App("early")


@app.saga(name="two-waits")
async def two_waits(ctx: SagaContext) -> list[object]:
    await ctx.wait_for_event("go")
    first = await ctx.wait_for_event("raise", early="refuse")
    second = await ctx.wait_for_any(["raise", "other"], early="refuse")
    return [first, second.data]


def test_events_sent_before_a_refusing_wait_began_are_refused_and_later_ones_count() -> None:
    env = Harness(app)
    run_id = env.start(two_waits)
    env.send_event(run_id, "raise", 9)  # early: before the wait for it began
    env.send_event(run_id, "raise", 10)
    env.run_until_idle()
    env.send_event(run_id, "go")
    env.run_until_idle()
    assert env.get(run_id).status == "waiting", "the early raises were not taken"
    history = env.history(run_id)
    refused = [e for e in history if e.kind == h.EVENT_REJECTED]
    assert [(e.name, "before the wait began" in e.data["reason"]) for e in refused] == [
        ("raise", True),
        ("raise", True),
    ]
    env.send_event(run_id, "raise", 3)
    env.run_until_idle()
    env.send_event(run_id, "raise", 4)
    env.run_until_idle()
    assert env.result(run_id) == [3, 4]
    replay(app, env.history(run_id), run_id=run_id)  # the same path on replay
    status = env.status(run_id)
    assert status.status == "completed"
