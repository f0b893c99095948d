"""``Client.send_event(..., event_id=...)`` is safe to retry, also when the event ended its
run: a caller whose first send timed out (an MCP client, a webhook retried by its sender)
must not be told "too late" for the event its run took. A send its run did not take is still
refused once the run has ended."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from sagaloop import App, SagaContext
from sagaloop.errors import RunFinishedError
from sagaloop.testing import Harness

app = App("retried")


@app.saga(name="wait-for-go")
async def wait_for_go(ctx: SagaContext, _: Any) -> Any:
    return await ctx.wait_for_event("go", timeout=timedelta(days=1))


@pytest.fixture
def h() -> Any:
    harness = Harness(app)
    yield harness
    harness.close()


def test_a_retried_send_that_ended_the_run_is_not_refused(h: Harness) -> None:
    run = h.start(wait_for_go, None)
    h.run_until_idle(skip_time=False)  # waiting (time skipped, its timeout would end it)
    h.client.send_event(run, "go", "once", event_id="webhook-1")
    h.run_until_idle()
    assert h.get(run).status == "completed" and h.result(run) == "once"
    h.client.send_event(run, "go", "once", event_id="webhook-1")  # the retry: accepted
    h.run_until_idle()
    assert h.result(run) == "once"


def test_a_send_the_ended_run_did_not_take_is_refused(h: Harness) -> None:
    run = h.start(wait_for_go, None)
    h.run_until_idle(skip_time=False)  # waiting (time skipped, its timeout would end it)
    h.client.send_event(run, "go", "once", event_id="webhook-1")
    h.run_until_idle()
    with pytest.raises(RunFinishedError):
        h.client.send_event(run, "go", "again", event_id="webhook-2")
    with pytest.raises(RunFinishedError):
        h.client.send_event(run, "go", "again")  # no event_id: never a retry
