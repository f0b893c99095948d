"""The console with events sent before the wait begins (issue 23, item 5): the send form
refuses a declared event that does not fit, with nothing sent; a run's page shows the events
received and not yet taken, and those refused with the reason, and "why it waits" stays true
after a refusal (the History row used to be the only trace)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient

from sagaloop import App, SagaContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness
from sagaloop.ui import create_app

HERE = "http://127.0.0.1:8765"


class Reply(BaseModel):
    text: str
    accepted: bool


app = App("console_events")


@app.saga(name="declared", events={"go": None, "reply": Reply})
async def declared(ctx: SagaContext) -> str:
    await ctx.wait_for_event("go")
    reply: Reply = await ctx.wait_for_event("reply")
    return reply.text


@app.saga(name="undeclared")
async def undeclared(ctx: SagaContext) -> str:
    await ctx.wait_for_event("go")
    reply = await ctx.wait_for_event("reply", model=Reply, timeout=timedelta(days=1))
    return reply.text


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(app, url=f"sqlite:///{tmp_path / 'ui.db'}")
    yield harness
    harness.close()


def browser(env: Harness) -> TestClient:
    return TestClient(create_app(env.client, app, None), base_url=HERE)


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no form"
    return found.group(1)


def send(client: TestClient, run_id: str, name: str, data: str) -> Any:
    csrf = csrf_of(client.get(f"/run?id={run_id}").text)
    form = {"run_id": run_id, "name": name, "data": data, "csrf": csrf}
    return client.post("/run/event", data=form, headers={"origin": HERE}, follow_redirects=False)


def test_the_send_form_refuses_a_declared_event_that_does_not_fit_before_the_wait(
    env: Harness,
) -> None:
    run_id = env.start(declared)
    env.run_until_idle(skip_time=False)
    client = browser(env)
    note = client.get(f"/run?id={run_id}").text
    assert '<option value="reply">' in note and "This saga accepts" in note
    typo = send(client, run_id, "reply", '{"text": "typo"}')
    assert typo.status_code >= 400 and "nothing was sent" in typo.text, typo.status_code
    assert "accepted" in typo.text
    unknown = send(client, run_id, "replied", '{"text": "yes", "accepted": true}')
    assert unknown.status_code >= 400 and "does not accept" in unknown.text, unknown.status_code
    env.run_until_idle(skip_time=False)
    assert not [e for e in env.history(run_id) if e.kind == h.EVENT_ARRIVED]
    sent = send(client, run_id, "reply", '{"text": "yes", "accepted": true}')
    assert sent.headers["location"].endswith("done=event")


def test_the_run_page_shows_events_kept_and_refused_and_why_it_still_waits(
    env: Harness,
) -> None:
    run_id = env.start(undeclared)
    env.run_until_idle(skip_time=False)
    client = browser(env)
    assert send(client, run_id, "reply", '{"text": "typo"}').status_code == 303  # no wait yet
    env.run_until_idle(skip_time=False)
    page = client.get(f"/run?id={run_id}").text
    events = page[page.index('id="events"') :]
    assert "Received, not yet taken" in events and "typo" in events, events

    assert send(client, run_id, "go", "").status_code == 303
    env.run_until_idle(skip_time=False)
    page = client.get(f"/run?id={run_id}").text
    why = page[page.index("Why it waits") :]
    assert "waiting for event &#39;reply&#39;" in why and "1 refused" in why, why
    events = page[page.index('id="events"') :]
    assert "Received, not yet taken" not in events
    assert "Refused" in events and "accepted: Field required" in events, events
