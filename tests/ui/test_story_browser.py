"""A run's story in headless Chromium (Debian's, driven as tests/ui/test_console.py does it,
with its fixtures): a real `sagaloop dev` and `sagaloop ui` on a SQLite file; the operator
reads the timeline, the audit, a step's result and a whole history value, then forks the run
from a step after confirming, and the fork runs to its end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from sagaloop.testing.wait import eventually
from tests.ui.test_console import REFUND, Console, browser, console, expected_errors, page, shots

pytestmark = pytest.mark.browser

__all__ = ["browser", "console", "expected_errors", "page"]  # the fixtures, from test_console


def forks_of(console: Console, run_id: str) -> list[str]:
    """The runs forked from ``run_id``."""
    client = console.client
    return [
        r.run_id
        for r in client.list(saga="refund")
        if (client.history(r.run_id)[0].data.get("forked_from") or {}).get("run_id") == run_id
    ]


def test_an_operator_reads_a_runs_story_and_forks_it_from_a_step_after_confirming(
    console: Console, page: Page, tmp_path: Path
) -> None:
    client = console.client
    client.start("refund", REFUND, run_id="story-1")
    console.ready()
    eventually(lambda: client.approvals("story-1"), timeout=30, what="the approval asked")
    client.approve("story-1", "refund", by="bob")
    eventually(
        lambda: client.get("story-1").status == "waiting", timeout=30, what="the parcel wait"
    )
    client.send_event("story-1", "parcel_returned")
    eventually(lambda: client.get("story-1").status == "completed", timeout=30, what="the end")

    page.goto(f"{console.url}/run?id=story-1")
    timeline = page.locator("#timeline")
    expect(timeline.locator("svg rect.bar")).to_have_count(4)  # 2 steps, 2 waits
    expect(timeline).to_contain_text('approval of refund(order="A-17", amount=2500)')
    expect(page.locator("#audit")).to_contain_text("bob")
    pay_back = page.locator("#steps tr", has_text="pay_back")
    expect(pay_back.locator("td.result")).to_contain_text("rf-A-17-2500")
    page.screenshot(path=shots(tmp_path) / "run-story.png", full_page=True)
    page.locator("#history > summary").click()
    expect(page.locator("#history")).to_contain_text("run finished")
    cut = page.locator("#history tr", has_text="published").first
    expect(cut.locator(".more")).to_contain_text("more bytes")
    cut.get_by_text("whole value").click()
    expect(cut.locator("details pre.value")).to_contain_text('"args_hash"')

    pay_back.get_by_role("button", name=re.compile(r"^Fork at #\d+ pay_back$")).click()
    expect(page.locator("main")).to_contain_text("Fork this run at position #6 (step pay_back)?")
    assert forks_of(console, "story-1") == []  # nothing forked before the answer
    page.get_by_role("button", name="Yes").click()
    expect(page.locator(".flash.ok")).to_contain_text("Forked")
    expect(page.locator("#run-live")).to_contain_text(re.compile(r"forked from\s*story-1 at #6"))
    forked = forks_of(console, "story-1")
    assert len(forked) == 1
    expect(page.locator("h1")).to_contain_text(forked[0])
    # the new run pays back again with the code as it is now, and completes
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator("pre.output")).to_contain_text("rf-A-17-2500")
