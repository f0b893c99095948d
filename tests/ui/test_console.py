"""The console end to end: a real `sagaloop dev` and `sagaloop ui` on a SQLite file, driven in
headless Chromium (Debian's ``chromium``, through Playwright's client) by clicking what an
operator clicks.

With ``SAGALOOP_UI_SCREENSHOTS=docs/ui`` the test also writes the screenshots of docs/ui.md."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from sagaloop import Client
from sagaloop.sagas.approvals import args_hash
from sagaloop.store.sql import SqlStore
from sagaloop.testing.wait import eventually

pytestmark = pytest.mark.browser

HERE = Path(__file__).parent
SAGALOOP = str(Path(sys.executable).with_name("sagaloop"))
APP = "console_app"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
REFUND = {"order": "A-17", "amount": 2500}


@dataclass
class Console:
    url: str
    client: Client
    logs: list[Path]
    port: int

    def tail(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-1500:] for p in self.logs)

    def ready(self) -> None:
        try:
            eventually(lambda: answers(self.port), timeout=20, what="sagaloop ui to listen")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.tail()}") from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """`sagaloop dev` running the app on a new database, and `sagaloop ui` showing it (once
    :meth:`Console.ready` returns: they start while the browser does)."""
    tmp = tmp_path_factory.mktemp("console")
    url = f"sqlite:///{tmp / 'console.db'}"
    store = SqlStore(url)
    store.upgrade()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    # this checkout's sagaloop, whichever the interpreter has installed
    path = os.pathsep.join([str(HERE), str(HERE.parents[1])])
    env = {**base, "SAGALOOP_DATABASE_URL": url, "PYTHONPATH": path}
    port = free_port()
    logs = [tmp / "dev.log", tmp / "ui.log"]
    commands = [
        [SAGALOOP, "dev", "--app", APP, "--poll", "0.05"],
        [SAGALOOP, "ui", "--app", APP, "--port", str(port), "--refresh", "0.3"],
    ]
    processes = []
    for command, log in zip(commands, logs, strict=True):
        with log.open("wb") as out:
            processes.append(
                subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=out)
            )
    console = Console(f"http://127.0.0.1:{port}", Client(store, "console-shop"), logs, port)
    try:
        yield console  # starting while the browser starts: see Console.ready
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
        store.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        message = "the browser tests need Debian's chromium: apt-get install -y chromium"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page that fails the test on any error the browser reports (a script error, a
    resource or an inline style the Content-Security-Policy refuses)."""
    context = browser.new_context(viewport={"width": 1240, "height": 860})
    page = context.new_page()
    page.set_default_timeout(15_000)
    expect.set_options(timeout=15_000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, errors


def shots(tmp_path: Path) -> Path:
    """Where the screenshots go: docs/ui with SAGALOOP_UI_SCREENSHOTS=docs/ui, else tmp."""
    where = os.environ.get("SAGALOOP_UI_SCREENSHOTS")
    return Path(where) if where else tmp_path


def test_an_operator_approves_cancels_and_reads_errors_and_transcripts_by_clicking(
    console: Console, page: Page, tmp_path: Path
) -> None:
    client = console.client
    client.start("charge", 30, run_id="charge-1")
    client.start("support", "Where is my order A-17?", run_id="support-1")
    client.start("refund", REFUND, run_id="refund-1")
    to = shots(tmp_path)
    console.ready()

    # the runs page, with its counts, updates as runs move
    page.goto(f"{console.url}/runs")
    expect(page.locator("tr", has_text="charge-1").locator(".status")).to_have_text("failed")
    expect(page.locator("tr", has_text="support-1").locator(".status")).to_have_text("completed")
    expect(page.locator("tr", has_text="refund-1").locator(".status")).to_have_text("waiting")
    expect(page.locator(".count.st-failed")).to_have_text("failed 1")
    page.screenshot(path=to / "runs.png")

    # the refund waits for approval: the page shows the arguments and their hash
    page.get_by_role("link", name="refund-1").click()
    expect(page.locator("#run-status")).to_have_text("waiting")
    approval = page.locator(".approval")
    expect(approval.locator("pre.args")).to_contain_text('"order": "A-17"')
    expect(approval.locator("pre.args")).to_contain_text('"amount": 2500')
    expect(approval.locator("code.hash")).to_have_text(args_hash(REFUND))
    expect(page.locator("ul.why")).to_contain_text("waiting for event 'approval:refund'")
    page.screenshot(path=to / "approval.png")

    page.evaluate("window.notReloaded = true")
    approval.locator("input[name=by]").fill("ann")
    approval.get_by_role("button", name="Approve").click()
    expect(page.locator(".flash.ok")).to_contain_text("Approved")
    # the run goes on to wait for the parcel, and says what it asks
    expect(page.locator("ul.why")).to_contain_text("waiting for event 'parcel_returned'")
    expect(page.locator("#run-live")).to_contain_text("has the parcel come back?")
    # the card stays as the approval's audit: its outcome, who gave it, no buttons
    expect(page.locator(".approval")).to_contain_text("by ann")
    expect(page.locator(".approval").get_by_role("button", name="Approve")).to_have_count(0)

    # what happens elsewhere shows without a reload
    client.send_event("refund-1", "parcel_returned")
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator("pre.output")).to_contain_text("rf-A-17-2500")
    assert page.evaluate("window.notReloaded") is True
    answer = client.get_published("refund-1", "approval:refund")
    assert answer["status"] == "approved" and answer["by"] == "ann"

    # another refund, cancelled after confirming: its held stock is released
    client.start("refund", REFUND, run_id="refund-2")
    page.goto(f"{console.url}/run?id=refund-2")
    expect(page.locator(".approval")).to_have_count(1)
    questions: list[str] = []

    def confirm(dialog: object) -> None:
        questions.append(dialog.message)  # type: ignore[attr-defined]
        dialog.accept()  # type: ignore[attr-defined]

    page.once("dialog", confirm)
    page.get_by_role("button", name="Cancel run").click()
    expect(page.locator("#run-status")).to_have_text("cancelled")
    assert questions and "Cancel run refund-2?" in questions[0]
    hold = page.locator("table.steps tr", has_text="hold_stock")
    expect(hold).to_contain_text("compensated")
    eventually(lambda: client.get("refund-2").status == "cancelled", what="the cancellation")

    # a failed step: its error, each attempt's, with the traceback
    page.goto(f"{console.url}/run?id=charge-1")
    expect(page.locator("#run-status")).to_have_text("failed")
    errors = page.locator("section.errors").first
    expect(errors).to_contain_text("attempt 1")
    expect(errors).to_contain_text("attempt 2")
    expect(errors).to_contain_text("card 4242 declined: insufficient funds for 30")
    errors.locator("summary", has_text="Traceback").first.click()
    expect(errors.locator("pre.traceback").first).to_contain_text("in charge_card")

    # an agent run's transcript: messages, the tool call and its result, tokens
    page.goto(f"{console.url}/run?id=support-1")
    page.get_by_role("link", name="Transcript (2 model requests)").click()
    requests = page.locator("section.request")
    expect(requests).to_have_count(2)
    expect(requests.nth(0).locator(".part-user")).to_contain_text("Where is my order A-17?")
    expect(requests.nth(0).locator(".part-tool-call")).to_contain_text('"order": "A-17"')
    expect(requests.nth(1).locator(".part-tool-result")).to_contain_text("shipped on Monday")
    expect(requests.nth(1).locator(".part-assistant")).to_contain_text("Your order A-17")
    expect(page.locator("table.usage")).to_contain_text("requests")
    page.screenshot(path=to / "transcript.png")
