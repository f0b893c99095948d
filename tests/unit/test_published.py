"""State readable from outside a run: `ctx.publish` records values in the history, read back
by `Client.get_published`, `sagaloop status` and `status --json`; a wait's `prompt` (the
question asked of a person) shows while the run waits. Replayed, a publish is a command like
any other: it is checked, not recorded twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_env import cli_database, run

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness

app = App("published")


@app.step()
def draft(ctx: StepContext, topic: str) -> str:
    return f"a draft about {topic}"


@app.saga(name="review")
async def review(ctx: SagaContext, topic: str) -> str:
    ctx.publish("progress", {"stage": "drafting"})
    text = await ctx.call(draft, topic)
    ctx.publish("draft", text)
    ctx.publish("progress", {"stage": "awaiting approval"})
    verdict = await ctx.wait_for_event(
        "approval", prompt={"question": "Publish this?", "draft": text}
    )
    ctx.publish("progress", {"stage": "done"})
    return f"{verdict}: {text}"


def test_published_values_are_read_from_outside_and_the_prompt_shows_while_waiting() -> None:
    env = Harness(app)
    run_id = env.start(review, "refunds")
    env.run_until_idle()
    assert env.client.get_published(run_id, "draft") == "a draft about refunds"
    assert env.client.get_published(run_id, "progress") == {"stage": "awaiting approval"}
    assert env.client.get_published(run_id, "nothing", "default") == "default"
    status = env.status(run_id)
    assert status.published == {
        "progress": {"stage": "awaiting approval"},
        "draft": "a draft about refunds",
    }
    assert status.prompts == {
        "approval": {"question": "Publish this?", "draft": "a draft about refunds"}
    }
    assert any("asking" in why and "Publish this?" in why for why in status.waiting_for)
    as_json = status.to_json()
    assert as_json["published"]["draft"] == "a draft about refunds"

    env.restart()  # replayed from the history: each publish is checked, none recorded again
    env.send_event(run_id, "approval", "yes")
    env.run_until_idle()
    assert env.result(run_id) == "yes: a draft about refunds"
    published = [e for e in env.history(run_id) if e.kind == h.PUBLISHED]
    assert [e.name for e in published] == ["progress", "draft", "progress", "progress"]
    assert env.status(run_id).prompts == {}
    assert env.client.get_published(run_id, "progress") == {"stage": "done"}


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("", 1, "key"),
        ("k" * 201, 1, "key"),
        ("x", float("nan"), "NaN"),
        ("x", "\ud83d", "surrogate"),
    ],
)
def test_a_value_or_key_that_cannot_be_published_fails_the_saga_code(
    key: str, value: Any, words: str
) -> None:
    bad = App("bad-publish")

    @bad.saga(name="p")
    async def p(ctx: SagaContext) -> None:
        ctx.publish(key, value)

    env = Harness(bad)
    run_id = env.start(p)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed" and run.error is not None
    assert words.lower() in run.error["message"].lower(), run.error


def test_a_removed_publish_is_a_non_determinism() -> None:
    first, second = App("pub-v"), App("pub-v")

    @first.saga(name="s")
    async def v1(ctx: SagaContext) -> Any:
        ctx.publish("stage", 1)
        return await ctx.wait_for_event("go")

    @second.saga(name="s")
    async def v2(ctx: SagaContext) -> Any:
        return await ctx.wait_for_event("go")

    env = Harness(first)
    run_id = env.start(v1)
    env.run_until_idle()
    env.app = second
    env.restart()
    env.send_event(run_id, "go", 1)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "needs_attention" and "publish('stage')" in (run.reason or ""), run


CLI_APP = """
from sagaloop import App, SagaContext

app = App("published_cli")


@app.saga(name="ask")
async def ask(ctx: SagaContext) -> str:
    ctx.publish("progress", 50)
    return await ctx.wait_for_event("answer", prompt="Approve the refund of 25 EUR?")
"""


def test_status_shows_published_values_and_the_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = cli_database(tmp_path, monkeypatch, "published_cli", CLI_APP)
    import published_cli

    env = Harness(published_cli.app, url=f"sqlite:///{db}")
    run_id = env.start(published_cli.ask)
    env.run_until_idle()
    text = run("status", run_id).output
    assert "published:" in text and "progress = 50" in text, text
    assert "Approve the refund of 25 EUR?" in text, text
    data = json.loads(run("status", run_id, "--json").output)
    assert data["published"] == {"progress": 50}
    assert data["prompts"] == {"answer": "Approve the refund of 25 EUR?"}
