"""Port of Inngest's ``step.waitForEvent`` with ``match`` (and its CEL ``if`` twin).

Originals:

- the docs' example "send-onboarding-nudge-email"
  (inngest.com/docs/features/inngest-functions/steps-workflows/wait-for-event): a function
  triggered by ``app/account.created`` waits up to 3 days for ``app/onboarding.completed``
  with ``match: "data.userId"``; "if no event is received within 3 days, onboardingCompleted
  will be null", else "the event payload";
- github.com/inngest/inngest-py, ``tests/cases/wait_for_event_timeout_if_exp_not_match.py``
  (commit 93028f4549f61683327739ff0608c1624ab42289): triggered with ``{"id": 123}``, waits 1 s
  for ``<name>.fulfill`` with ``if_exp="event.data.id == async.data.id"``; a fulfill event with
  ``{"id": 456}`` is sent; the run completes and ``assert state.result is None``.

What maps to what:

- ``inngest.createFunction({event: "app/account.created"})`` -> ``@app.saga(on_event=...)``:
  publishing the event (``Client.publish_event``) starts the run, the event's data its input;
- ``step.waitForEvent(..., match: "data.userId")`` -> ``ctx.wait_for_event(name,
  match=lambda d: d["userId"] == event["userId"])`` (the trigger's field equals the awaited
  event's); ``if_exp="event.data.id == async.data.id"`` is the same predicate on ``id``;
- ``null`` on timeout -> ``EventTimeoutError``, caught and turned into ``None``;
- Inngest's ``step.run("send-onboarding-nudge-email")`` -> a step; the sleeps that let the wait
  register -> ``Harness.run_until_idle``; ``wait_for_run_status(COMPLETED)`` -> the run's
  status ``completed``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sagaloop import App, EventTimeoutError, SagaContext, StepContext
from sagaloop.testing import Harness

app = App("port-inngest-wait-for-event")
nudged: list[str] = []


@app.step(name="send-onboarding-nudge-email")
def send_nudge(ctx: StepContext, user_id: str) -> str:
    nudged.append(user_id)
    return f"nudged {user_id}"


@app.saga(name="send-onboarding-nudge-email", on_event="app/account.created")
async def onboarding(ctx: SagaContext, event: dict[str, Any]) -> Any:
    try:
        onboarding_completed = await ctx.wait_for_event(
            "app/onboarding.completed",
            timeout=timedelta(days=3),
            match=lambda other: other["userId"] == event["userId"],
        )
    except EventTimeoutError:
        onboarding_completed = None
    if not onboarding_completed:  # no event within 3 days: null
        return await ctx.call(send_nudge, event["userId"])
    return onboarding_completed  # the event's payload


@app.saga(name="wait_for_event_timeout_if_exp_not_match", on_event="if_exp_not_match")
async def if_exp_not_match(ctx: SagaContext, event: dict[str, Any]) -> Any:
    try:
        return await ctx.wait_for_event(
            "if_exp_not_match.fulfill",
            match=lambda other: event["id"] == other["id"],  # event.data.id == async.data.id
            timeout=timedelta(seconds=1),
        )
    except EventTimeoutError:
        return None


def _runs(env: Harness, saga: str) -> list[str]:
    return [r.run_id for r in env.client.list(saga=saga)]


def test_onboarding_completed_by_the_same_user_is_the_event_payload() -> None:
    env = Harness(app)
    env.client.publish_event("app/account.created", {"userId": "u-1"})
    env.client.publish_event("app/account.created", {"userId": "u-2"})
    env.run_until_idle(skip_time=False)
    runs = {env.client.get(r).input["userId"]: r for r in _runs(env, onboarding.name)}
    assert sorted(runs) == ["u-1", "u-2"]

    env.client.publish_event("app/onboarding.completed", {"userId": "u-2", "plan": "pro"})
    env.run_until_idle(skip_time=False)
    assert env.result(runs["u-2"]) == {"userId": "u-2", "plan": "pro"}
    assert env.get(runs["u-1"]).status == "waiting"  # another user's completion: not its

    env.advance(timedelta(days=3))  # "if no event is received within 3 days ... null"
    env.run_until_idle()
    assert env.result(runs["u-1"]) == "nudged u-1"
    assert nudged == ["u-1"]


def test_wait_for_event_timeout_if_exp_not_match() -> None:
    env = Harness(app)
    env.client.publish_event("if_exp_not_match", {"id": 123})
    env.run_until_idle(skip_time=False)
    [run_id] = _runs(env, if_exp_not_match.name)

    env.client.publish_event("if_exp_not_match.fulfill", {"id": 456})
    env.run_until_idle()  # the 1 s timeout fires: nothing matched

    assert env.get(run_id).status == "completed"
    assert env.result(run_id) is None
