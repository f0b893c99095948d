"""Port of Inngest's debounce: the Python SDK's test case and the documentation's example.

Originals:

- github.com/inngest/inngest-py, commit 0bfb5eaeb8417dab7775dfb373028362cf9eedf7,
  ``tests/cases/debounce.py``: a function with ``debounce=inngest.Debounce(period=1 s)``; the
  test sends its event twice and asserts that one run completes (``run_count == 1``).
- github.com/inngest/website, ``snippets/ts/v3/debounce/basic.ts`` (the docs' "Debounce
  functions" page): ``debounce: {key: "event.data.account_id", period: "5m", timeout: "10m"}``
  on ``intercom/company.updated``. Its comments state the behaviour: the function is
  "scheduled 5 minutes after events are no longer received with the same
  ``event.data.account_id``", and "``event`` will be the last event in the series received";
  ``timeout`` is the most a run is delayed from the first event. Those are its assertions here.

What maps to what:

- ``inngest.Debounce(period=..., key=..., timeout=...)`` -> ``Debounce(period, key=...,
  max_wait=...)``; the key expression ``event.data.account_id`` -> ``lambda event:
  event["data"]["account_id"]`` (a function of the input);
- sending the triggering event (``client.send_sync(inngest.Event(name=...))``) -> ``Client.start``
  of the debounced saga with the event as its input (it returns the run id the window will
  start, which Inngest's ``send`` cannot);
- the function's body, which counts its runs in the test's state -> a step (a step's body runs
  once per run; saga code is replayed);
- ``state.wait_for_run_id`` and ``wait_for_run_status(COMPLETED)`` -> the harness's virtual
  clock (``run_until_idle`` skips to the window's due time) and ``Harness.result``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sagaloop import App, Debounce, SagaContext, StepContext
from sagaloop.testing import Harness

# --- inngest-py tests/cases/debounce.py ------------------------------------------------------

app = App("port-inngest-debounce")


class _State:
    run_count: int = 0
    run_id: str | None = None


state = _State()


@app.step()
def count_run(ctx: StepContext) -> None:
    state.run_count += 1
    state.run_id = ctx.run_id


@app.saga(name="debounce", debounce=Debounce(period=timedelta(seconds=1)))
async def fn(ctx: SagaContext, event: dict[str, Any]) -> None:
    await ctx.call(count_run)


def test_debounce() -> None:
    state.run_count, state.run_id = 0, None
    env = Harness(app)
    event_name = "harness/debounce"
    first = env.client.start(fn, {"name": event_name})
    second = env.client.start(fn, {"name": event_name})
    assert second == first  # one window: the run both sends will have
    env.run_until_idle()  # state.wait_for_run_id: the clock skips to the window's due time
    run_id = state.run_id
    assert run_id == first
    assert env.get(run_id).status == "completed"  # wait_for_run_status(COMPLETED)
    assert state.run_count == 1


# --- the docs' example: key, period and timeout ----------------------------------------------

webhooks = App("port-inngest-debounce-webhook")


@webhooks.step()
def sync_company(ctx: StepContext, event: dict[str, Any]) -> dict[str, Any]:
    return event["data"]


@webhooks.saga(
    name="handle-webhook",
    debounce=Debounce(
        period=timedelta(minutes=5),
        key=lambda event: event["data"]["account_id"],
        max_wait=timedelta(minutes=10),
    ),
)
async def handle_webhook(ctx: SagaContext, event: dict[str, Any]) -> dict[str, Any]:
    # `event` will be the last event in the series received.
    return await ctx.call(sync_company, event)


def company_updated(account_id: str, n: int) -> dict[str, Any]:
    return {"name": "intercom/company.updated", "data": {"account_id": account_id, "n": n}}


def test_handle_webhook() -> None:
    env = Harness(webhooks)
    t0 = env.clock.now()
    steady = env.start("handle-webhook", company_updated("acct-1", 0))
    env.advance(timedelta(minutes=1))
    quiet = env.start("handle-webhook", company_updated("acct-2", 0))
    for n in range(1, 5):  # acct-1 keeps sending, every 2 minutes: never 5 minutes of quiet
        env.advance(timedelta(minutes=1))
        assert env.start("handle-webhook", company_updated("acct-1", n)) == steady
        env.advance(timedelta(minutes=1))
    env.advance(timedelta(minutes=5))
    runs = {r.run_id: r for r in env.store.list_runs(saga="handle-webhook")}
    assert set(runs) == {steady, quiet}, "one run per account_id"
    # acct-2: scheduled 5 minutes after its events stopped
    assert runs[quiet].created_at - t0 == timedelta(minutes=6)
    assert env.result(quiet) == {"account_id": "acct-2", "n": 0}
    # acct-1: its events never stopped for 5 minutes; the timeout ran it 10 minutes after the
    # first, with the last event received by then
    assert runs[steady].created_at - t0 == timedelta(minutes=10)
    assert env.result(steady) == {"account_id": "acct-1", "n": 4}
