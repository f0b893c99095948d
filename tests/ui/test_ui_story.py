"""A run's page tells its story (sagaloop.ui.story): the timeline's bars, steps with their
inputs and results cut with a visible marker, compensation rows in the order they ran, the wait
in words, the approvals' audit, the tree of child runs, the paged history and its download in
the format of ``sagaloop export``, fork from a step with a confirmation, and a page that stays
bounded for a 6,000-event run. Through the console's Starlette app on a Harness's database."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext
from sagaloop.cli.main import cli
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.ports import RunRecord
from sagaloop.testing import Harness
from sagaloop.ui import create_app
from sagaloop.ui.spans import bars_of
from sagaloop.ui.story import BARS_PAGE, HISTORY_PAGE, STEPS_PAGE, pager, shown

HERE = "http://127.0.0.1:8765"
app = App("story-shop")
BIG = {"lines": [f"line {i}: " + "x" * 40 for i in range(60)]}
"""A step result long enough to be cut (about 3 KB of JSON)."""
failures = {"undo": 0}


@app.step
def book_flight(ctx: StepContext, city: str) -> dict[str, Any]:
    return {"flight": f"FL-{city}", **BIG}


@book_flight.compensation
def cancel_flight(ctx: StepContext, city: str, result: dict[str, Any]) -> None:
    failures["undo"] += 1
    if failures["undo"] == 1:
        raise ApplicationError("the airline is busy")


@app.step
def book_hotel(ctx: StepContext, city: str) -> str:
    return f"HT-{city}"


@book_hotel.compensation
def cancel_hotel(ctx: StepContext, city: str, result: str) -> None:
    pass


@app.step(retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(milliseconds=50)))
def charge(ctx: StepContext, cents: int) -> str:
    raise ApplicationError(f"card declined for {cents}")


@app.saga(name="leg")
async def leg(ctx: SagaContext, city: str) -> str:
    return await ctx.call(book_hotel, city)


@app.saga(name="trip")
async def trip(ctx: SagaContext, city: str) -> str:
    """Books a flight, a hotel through a child run, asks for approval of a refund, then
    charges (which fails: the flight and hotel are compensated, the flight's undo retried)."""
    await ctx.call(book_flight, city)
    hotel = await ctx.call(leg, city, run_id=f"leg-{city}")
    decision = await ctx.approval("refund", {"cents": 1250}, call_id="8")
    if decision.approved:
        await ctx.call(charge, 1250)
    return str(hotel)


@app.saga(name="nap")
async def nap(ctx: SagaContext, city: str) -> str:
    await ctx.sleep(timedelta(minutes=5))
    return await ctx.call(book_hotel, city)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Harness]:
    failures["undo"] = 0
    harness = Harness(app, url=f"sqlite:///{tmp_path / 'story.db'}")
    yield harness
    harness.close()


def browser(env: Harness) -> TestClient:
    return TestClient(create_app(env.client, app), base_url=HERE)


def text_of(html: str) -> str:
    """The page's text, tags dropped and spaces squeezed (what a reader sees)."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def section(html: str, section_id: str) -> str:
    found = re.search(
        rf'<(section|details) class="card[^"]*" id="{section_id}".*?</\1>', html, re.S
    )
    assert found, f"the page has no #{section_id}"
    return found.group(0)


def test_a_value_is_cut_at_a_line_end_with_a_marker_of_what_is_left() -> None:
    small = shown({"a": 1})
    assert (small.more, small.full) == (0, None)
    cut = shown(BIG)
    whole = json.dumps(BIG, indent=2)
    assert whole.startswith(cut.preview) and len(cut.preview) <= 240
    assert cut.preview.endswith('",')  # a whole line: never mid-token
    assert cut.more == len(whole.encode()) - len(cut.preview.encode())
    assert cut.full is None  # too long for the page: a link to it instead
    assert shown(BIG, inline=10_000).full == whole  # else the page holds it in <details>


def test_the_wait_reads_as_words_and_the_approval_audit_says_who_answered(env: Harness) -> None:
    env.start("trip", "Oslo", run_id="t-1")
    env.run_until_idle()
    page = text_of(browser(env).get("/run?id=t-1").text)
    assert "waits for approval of refund(cents=1250)" in page
    assert "waiting for approval of refund(cents=1250) (the approval below)" in page
    assert "waiting for event 'approval:8'" not in page
    assert "Approval audit" not in page  # nothing settled yet

    env.client.approve("t-1", "8", by="ann")
    env.run_until_idle()
    html = browser(env).get("/run?id=t-1").text
    assert env.client.get("t-1").status == s.COMPENSATED
    audit = text_of(section(html, "audit"))
    assert "refund 8 approved ann" in audit
    assert "waits for" not in text_of(html)


def test_the_timeline_draws_attempts_waits_compensations_and_child_runs(env: Harness) -> None:
    env.start("trip", "Oslo", run_id="t-1")
    env.run_until_idle()
    env.client.approve("t-1", "8", by="ann")
    env.run_until_idle()
    html = browser(env).get("/run?id=t-1").text
    timeline = section(html, "timeline")
    rows = re.findall(r'<tr class="span-(\w+)">\s*<th scope="row">(.*?)</th>', timeline, re.S)
    labels = [(kind, text_of(label).strip()) for kind, label in rows]
    assert labels[:5] == [
        ("attempt", "#0 book_flight · attempt 1"),
        ("child", "#1 child leg"),
        ("wait", "#3 approval of refund(cents=1250)"),
        ("attempt", "#5 charge · attempt 1"),
        ("attempt", "#5 charge · attempt 2"),
    ]
    assert labels[5:] == [  # the child's undo, then the flight's, which failed once
        ("compensation", "#1 undo leg"),
        ("compensation", "#0 undo book_flight"),
        ("compensation", "#0 undo book_flight · attempt 2"),
    ]
    assert 'href="/run?id=leg-Oslo"' in timeline  # the child's bar links to it
    bars = re.findall(
        r'<rect class="bar k-(\w+) o-(\w+)" x="([\d.]+)%" y="2" width="([\d.]+)%"', timeline
    )
    assert len(bars) == len(labels)
    assert [o for k, o, _, _ in bars if k == "attempt"] == ["ok", "failed", "failed"]
    assert [o for k, o, _, _ in bars if k == "compensation"] == ["ok", "failed", "ok"]
    assert [o for k, o, _, _ in bars if k in ("child", "wait")] == ["ok", "ok"]
    for _, _, x, width in bars:
        assert float(x) >= 0 and float(x) + float(width) <= 100.01
    assert "<script" not in timeline and "style=" not in timeline  # the CSP allows neither


def test_steps_show_their_input_and_result_and_compensations_have_rows(env: Harness) -> None:
    env.start("trip", "Oslo", run_id="t-1")
    env.run_until_idle()
    env.client.approve("t-1", "8", by="ann")
    env.run_until_idle()
    html = browser(env).get("/run?id=t-1").text
    steps = section(html, "steps")
    flight = re.search(r'<tr id="step-0">.*?</tr>', steps, re.S)
    assert flight
    row = flight.group(0)
    assert '"city": "Oslo"' in row.replace("&#34;", '"')
    assert '"flight": "FL-Oslo"' in row.replace("&#34;", '"')
    more = re.search(r"… \((\d+) more bytes\)", row)
    assert more and int(more.group(1)) > 2000
    assert '<a class="whole" href="/run/value?id=t-1&amp;seq=' in row  # too long to inline
    seq = re.search(r"/run/value\?id=t-1&amp;seq=(\d+)", row)
    assert seq
    value = browser(env).get(f"/run/value?id=t-1&seq={seq.group(1)}").text
    assert "line 59: " in value  # the whole of it
    assert 'id="step-1"' in steps and "leg-Oslo" not in steps.split('id="step-1"')[0]

    compensations = text_of(section(html, "compensations"))
    # the saga undoes in reverse: the child's hotel first, then the flight (retried once)
    assert re.search(r"1 1 leg compensated 1 .*? 2 0 book_flight compensated 2 ", compensations)
    assert "the airline is busy" in compensations

    children = section(html, "children")
    assert 'href="/run?id=leg-Oslo"' in children
    assert "compensated" in text_of(children)
    child_page = text_of(browser(env).get("/run?id=leg-Oslo").text)
    assert "child of t-1 at #1" in child_page


def test_the_history_downloads_as_sagaloop_export_writes_it(env: Harness, tmp_path: Path) -> None:
    env.start("trip", "Oslo", run_id="t-1")
    env.run_until_idle()
    response = browser(env).get("/run/history.json?id=t-1")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert 'filename="t-1.history.json"' in response.headers["content-disposition"]
    exported = CliRunner().invoke(
        cli, ["export", "t-1"], env={"SAGALOOP_DATABASE_URL": f"sqlite:///{tmp_path / 'story.db'}"}
    )
    assert exported.exit_code == 0, exported.output
    assert response.json() == json.loads(exported.output)
    assert browser(env).get("/run/history.json?id=nope").status_code == 404
    assert browser(env).get("/run/value?id=t-1&seq=999").status_code == 404


def test_fork_from_a_step_asks_first_then_shows_the_new_run(env: Harness) -> None:
    env.start("trip", "Oslo", run_id="t-1")
    env.run_until_idle()
    client = browser(env)
    html = client.get("/run?id=t-1").text
    forms = re.findall(r'<form method="post" action="/run/fork".*?</form>', html, re.S)
    assert len(forms) == 2  # book_flight (#0) and the child run (#1) completed; nothing else
    csrf = re.search(r'name="csrf" value="([^"]+)"', forms[1])
    assert csrf
    fields = {"csrf": csrf.group(1), "run_id": "t-1", "at": "1", "step": "leg"}
    post = {"headers": {"origin": HERE}, "follow_redirects": False}
    asked = client.post("/run/fork", data=fields, **post)  # type: ignore[arg-type]
    assert asked.status_code == 200
    assert "Fork this run at position #1 (step leg)? A new run keeps" in asked.text
    assert len(env.client.list(saga="trip")) == 1  # nothing forked before the answer

    stale = client.post("/run/fork", data={**fields, "csrf": "x", "confirmed": "1"}, **post)  # type: ignore[arg-type]
    assert stale.status_code == 403

    done = client.post("/run/fork", data={**fields, "confirmed": "1"}, **post)  # type: ignore[arg-type]
    assert done.status_code == 303
    new_id = re.search(r"/run\?id=([^&]+)&done=forked", done.headers["location"])
    assert new_id and new_id.group(1) != "t-1"
    fork = env.client.history(new_id.group(1))
    assert fork[0].data["forked_from"] == {"run_id": "t-1", "position": 1}
    shown_fork = text_of(client.get(done.headers["location"]).text)
    assert "Forked: this new run keeps" in shown_fork
    assert "forked from t-1 at #1" in shown_fork


def write_long_run(env: Harness, run_id: str, steps: int, note: int = 60) -> None:
    """A finished run of ``steps`` steps (``2 * steps + 2`` events) written to the store as
    the engine records one: ``run_started``, then each step scheduled and completed (its
    input holding a note of ``note`` characters)."""
    now = env.client.clock.now()
    events = [NewEvent(h.RUN_STARTED, None, "trip", {"input": "Oslo"})]
    for pos in range(steps):
        args = {"city": "Oslo", "note": "\n".join(["n" * 60] * (note // 61 + 1))[:note]}
        events.append(
            NewEvent(h.STEP_SCHEDULED, pos, "book_hotel", {"args": args, "queue": "default"})
        )
        result = {"result": f"HT-{pos}-" + "r" * 80, "reconciled": False, "worker": "w1"}
        events.append(NewEvent(h.STEP_COMPLETED, pos, "book_hotel", result))
    events.append(NewEvent(h.RUN_FINISHED, None, None, {"status": s.COMPLETED}))
    record = RunRecord(run_id, app.name, "trip", s.COMPLETED, "Oslo", now, now)
    record.last_seq = record.processed_seq = len(events)
    record.output = "done"
    store = env.client.store
    with store.transaction() as tx:
        assert store.create_run(tx, record)
        store.append_events(tx, run_id, 0, events, now)


def test_a_6000_event_run_page_is_bounded_paged_and_not_sent_again_unchanged(
    env: Harness,
) -> None:
    write_long_run(env, "long-1", 3000)
    assert len(env.client.history("long-1")) == 6002
    client = browser(env)
    first = client.get("/run?id=long-1")
    assert first.status_code == 200
    size = len(first.content)
    assert size < 300_000, f"the page of a 6,000-event run is {size} bytes"
    html = first.text
    assert html.count('<rect class="bar') == BARS_PAGE
    assert html.count('<tr id="step-') == STEPS_PAGE
    assert "page 1 of 15 (1 to 200 of 3000)" in html  # the timeline's pages
    assert "page 1 of 60 (1 to 50 of 3000)" in html  # the steps'
    assert "page 1 of 61 (1 to 100 of 6002)" in html  # the history's

    last = client.get("/run?id=long-1&tp=last&sp=2&hp=3").text
    assert len(last.encode()) < 300_000
    assert "#2999 book_hotel · attempt 1" in section(last, "timeline")
    assert 'id="step-50"' in last and 'id="step-49"' not in last
    history = section(last, "history")
    seqs = [int(x) for x in re.findall(r"<tr><td>(\d+)</td>", history)]
    assert seqs == list(range(2 * HISTORY_PAGE + 1, 3 * HISTORY_PAGE + 1))
    # the live region keeps the pages shown, and is sent again only when the run moved
    live = re.search(r'hx-get="(/run/live\?[^"]+)"', last)
    assert live
    url = live.group(1).replace("&amp;", "&")
    assert "tp=last" in url and "hp=3" in url
    assert client.get(url).status_code == 204
    moved = client.get(re.sub(r"v=[^&]+", "v=old", url))
    assert moved.status_code == 200 and len(moved.content) < 300_000


def test_a_page_of_long_values_stays_bounded_whole_values_become_links(env: Harness) -> None:
    write_long_run(env, "wide-1", 300, note=1_900)  # each input just under the inline limit
    html = browser(env).get("/run?id=wide-1&hp=2").text
    size = len(html.encode())
    assert size < 300_000, f"a page of long values is {size} bytes"
    steps = section(html, "steps")
    inline = steps.count('<details class="whole">')
    links = steps.count('<a class="whole" href="/run/value?')
    assert inline > 0 and links > 0 and inline + links == STEPS_PAGE  # past the budget: links


def test_the_audit_names_the_arguments_an_approver_edited(env: Harness) -> None:
    env.start("trip", "Oslo", run_id="t-1")
    env.run_until_idle()
    env.client.approve("t-1", "8", by="cy", args={"cents": 900})
    env.run_until_idle()
    audit = text_of(section(browser(env).get("/run?id=t-1").text, "audit"))
    assert "refund 8 approved cy" in audit
    assert "cents {" in audit and '"cents": 900' in audit.replace("&#34;", '"')


def test_a_sleep_is_a_timer_bar_as_long_as_it_slept(env: Harness) -> None:
    env.start("nap", "Rome", run_id="n-1")
    env.run_until_idle()
    assert env.client.get("n-1").status == s.COMPLETED
    timeline = section(browser(env).get("/run?id=n-1").text, "timeline")
    rows = re.findall(r'<tr class="span-(\w+)">.*?<td class="took">(.*?)</td>', timeline, re.S)
    assert rows[0] == ("timer", "5.0 min")
    assert rows[1][0] == "attempt"
    assert '<rect class="bar k-timer o-ok" x="0.0%" y="2" width="' in timeline


def test_a_wait_whose_event_was_refused_stays_open_until_one_fits() -> None:
    """As the engine records an event sent around the client's check (by another process
    over the broker): it arrives, the wait refuses its data, and the wait goes on."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def at(seconds: int) -> datetime:
        return t0 + timedelta(seconds=seconds)

    events = [
        Event(1, h.RUN_STARTED, at(0), None, "ask", {"input": "Rome"}),
        Event(2, h.EVENT_WAITING, at(0), 0, "reply", {"timeout_at": at(86400).isoformat()}),
        Event(3, h.EVENT_ARRIVED, at(10), None, "reply", {"data": {"text": "typo"}}),
        Event(4, h.EVENT_REJECTED, at(10), 0, "reply", {"reason": "accepted: Field required"}),
    ]
    (wait,) = bars_of(events)
    assert (wait.kind, wait.outcome, wait.end) == ("wait", "open", None)
    assert wait.detail == "refused: accepted: Field required"
    events.append(Event(5, h.EVENT_ARRIVED, at(30), None, "reply", {"data": {"accepted": 1}}))
    (wait,) = bars_of(events)
    assert (wait.outcome, wait.end, wait.took) == ("ok", at(30), "30.0 s")
    events[-1:] = [Event(5, h.TIMER_FIRED, at(86400), 0, "reply", {})]
    (wait,) = bars_of(events)
    assert (wait.outcome, wait.detail, wait.took) == ("failed", "timed out", "24.0 h")


def test_a_timer_the_code_cancelled_ends_its_bar_where_it_was_cancelled() -> None:
    """``asyncio.wait_for`` whose event came first: its timer is recorded ``timer_cancelled``
    and never fires; its bar ends there instead of staying open for ever."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    events = [
        Event(1, h.RUN_STARTED, t0, None, "ask", {"input": None}),
        Event(
            2, h.TIMER_STARTED, t0, 0, "sleep", {"fire_at": (t0 + timedelta(hours=1)).isoformat()}
        ),
        Event(3, h.EVENT_WAITING, t0, 1, "reply", {}),
        Event(4, h.EVENT_ARRIVED, t0 + timedelta(seconds=9), None, "reply", {"data": 1}),
        Event(5, h.TIMER_CANCELLED, t0 + timedelta(seconds=9), 0, "sleep", {}),
    ]
    timer, wait = bars_of(events)
    assert (timer.kind, timer.outcome, timer.took) == ("timer", "ok", "9.0 s")
    assert (wait.outcome, wait.end) == ("ok", t0 + timedelta(seconds=9))


def test_a_page_asked_out_of_range_or_not_a_number_is_the_nearest_page() -> None:
    assert (pager("tp", 450, 200, None).page, pager("tp", 450, 200, "last").page) == (1, 3)
    assert [pager("tp", 450, 200, x).page for x in ("0", "-2", "abc", "9" * 5000)] == [1, 1, 1, 3]
    last = pager("hp", 450, 200, "3")
    assert (last.first, last.last_index, last.rows(list(range(450)))[0]) == (400, 450, 400)
    assert pager("sp", 0, 50, "2").pages == 1  # an empty list has its one page
