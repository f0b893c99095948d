"""The runs page end to end in headless Chromium (the `sagaloop dev` + `sagaloop ui` pair of
tests/ui/test_console.py, on a database of this module's own): search, sort by a header, what a
waiting run waits for, ticked runs that stay ticked while the live region is sent again, and a
bulk cancel through its confirmation page.

With ``SAGALOOP_UI_SCREENSHOTS=docs/ui`` it writes docs/ui/runs-bulk.png."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from sagaloop.testing.wait import eventually
from tests.ui.test_console import Console, shots
from tests.ui.test_console import browser as browser  # the fixtures
from tests.ui.test_console import console as console
from tests.ui.test_console import expected_errors as expected_errors
from tests.ui.test_console import page as page

pytestmark = pytest.mark.browser


def test_an_operator_finds_runs_and_cancels_a_selection(
    console: Console, page: Page, tmp_path: Path
) -> None:
    client = console.client
    for n in (1, 2, 3):
        client.start("refund", {"order": f"Z-{n}", "amount": 100 * n}, run_id=f"refund-z{n}")
    client.start("charge", 30, run_id="charge-z")
    console.ready()
    for n in (1, 2, 3):
        eventually(
            lambda n=n: client.get(f"refund-z{n}").status == "waiting", what="refunds waiting"
        )

    page.goto(f"{console.url}/runs")
    row = page.locator("tr", has_text="refund-z2")
    expect(row.locator("td.waits")).to_have_text('approval of refund(order="Z-2", amount=200)')
    expect(page.locator("header nav .badge")).to_have_text("3")

    # search: a run id prefix, then the input's text; both stay in the address
    page.get_by_role("searchbox", name="Search").fill("refund-z")
    page.get_by_role("searchbox", name="Search").press("Enter")
    expect(page.locator("table.runs tbody tr")).to_have_count(3)
    expect(page).to_have_url(re.compile(r"q=refund-z"))
    page.get_by_role("searchbox", name="Search").fill("Z-3")
    page.locator("select[name=field]").select_option("input")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("table.runs tbody tr")).to_have_count(1)
    expect(page.locator("table.runs tbody")).to_contain_text("refund-z3")

    # sort by a header: oldest start first, then newest
    page.goto(f"{console.url}/runs?q=refund-z")
    page.get_by_role("link", name="started (UTC)").click()
    expect(page).to_have_url(re.compile(r"sort=-created"))
    expect(page.locator("table.runs tbody tr").first).to_contain_text("refund-z3")
    page.get_by_role("link", name="started (UTC) ▼").click()
    expect(page).to_have_url(re.compile(r"sort=created"))
    expect(page.locator("table.runs tbody tr").first).to_contain_text("refund-z1")

    # tick two runs; a run that moves sends the region again, the ticks stay
    page.get_by_label("select run refund-z1").check()
    page.get_by_label("select run refund-z3").check()
    live = page.locator("#runs-live")
    before = live.get_attribute("hx-get")
    client.start("refund", {"order": "Z-4", "amount": 400}, run_id="refund-z4")
    expect(page.locator("table.runs tbody tr")).to_have_count(4)
    expect(page.locator("header nav .badge")).to_have_text("4")  # the header's count too
    assert live.get_attribute("hx-get") != before, "the region was sent again"
    expect(page.get_by_label("select run refund-z1")).to_be_checked()
    expect(page.get_by_label("select run refund-z3")).to_be_checked()
    page.screenshot(path=shots(tmp_path) / "runs-bulk.png")

    # cancel them: a confirmation page names them, then the result
    page.get_by_role("button", name="Cancel selected").click()
    expect(page.locator("h1")).to_have_text("Confirm")
    expect(page.locator("ul.picked")).to_contain_text("refund-z1")
    expect(page.locator("ul.picked")).to_contain_text("refund-z3")
    page.get_by_role("button", name="Yes, cancel 2 runs").click()
    expect(page.locator("h1")).to_have_text("Cancel: 2 done, 0 refused")
    for run_id in ("refund-z1", "refund-z3"):
        eventually(lambda r=run_id: client.get(r).status == "cancelled", what="cancelled")
    assert client.get("refund-z2").status == "waiting", "an unticked run is left alone"
    page.get_by_role("link", name="Back to the runs").click()
    expect(page.locator("tr", has_text="refund-z1").locator(".status")).to_have_text("cancelled")
