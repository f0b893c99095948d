"""The console's runs page through Starlette's test client, on a Harness's database: search by
run id prefix and by input, sorting by a column, pages by keyset cursor (Next / Previous, never
a run twice), what a waiting run waits for, bulk cancel / retry behind a confirmation and the
CSRF check, and a live poll of a page that did not move answered 204 / 304 without reading the
listing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from starlette.testclient import TestClient

from sagaloop.engine import history as h
from sagaloop.engine.history import NewEvent
from sagaloop.engine.ports import RunRecord
from sagaloop.errors import StoreError
from sagaloop.testing import Harness
from sagaloop.ui import create_app
from tests.ui import console_app

HERE = "http://127.0.0.1:8765"
REFUND = {"order": "B-2", "amount": 700}


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(console_app.app, url=f"sqlite:///{tmp_path / 'runs.db'}")
    yield harness
    harness.close()


def browser(env: Harness) -> TestClient:
    return TestClient(create_app(env.client, console_app.app), base_url=HERE)


def shown(html: str) -> list[str]:
    """The run ids of the page's rows, in order."""
    return re.findall(r"<code>([^<]+)</code></a></td>", html)


def link(html: str, rel: str) -> str | None:
    found = re.search(rf'<a href="([^"]+)" rel="{rel}">', html)
    return found.group(1).replace("&amp;", "&") if found else None


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no form"
    return found.group(1)


def post(client: TestClient, data: list[tuple[str, str]]) -> Any:
    """A form POST whose fields may repeat (``run_id``)."""
    headers = {"origin": HERE, "content-type": "application/x-www-form-urlencoded"}
    body = urlencode(data)
    return client.post("/runs/bulk", content=body, headers=headers, follow_redirects=False)


def many_runs(env: Harness, n: int) -> list[str]:
    """``n`` runs of the app written straight to the store, one second apart (oldest first)."""
    t0 = env.clock.now() - timedelta(days=1)
    ids = []
    with env.store.transaction() as tx:
        for i in range(n):
            at = t0 + timedelta(seconds=i)
            run_id = f"bulk-{i:03}"
            record = RunRecord(run_id, "console-shop", "charge", "completed", {"i": i}, at, at)
            assert env.store.create_run(tx, record)
            ids.append(run_id)
    return ids


def waiting_refund(env: Harness, run_id: str, order: str = "B-2") -> str:
    env.start("refund", {"order": order, "amount": 700}, run_id=run_id)
    env.run_until_idle()
    assert env.approvals(run_id)
    return run_id


def test_search_by_id_prefix_and_by_input_text(env: Harness) -> None:
    waiting_refund(env, "refund-alpha", order="ZX-81")
    waiting_refund(env, "refund-beta", order="Q-9")
    env.start("charge", 5, run_id="charge-alpha")
    env.run_until_idle()
    client = browser(env)
    assert sorted(shown(client.get("/runs?q=refund-").text)) == ["refund-alpha", "refund-beta"]
    assert shown(client.get("/runs?q=refund-a").text) == ["refund-alpha"]
    assert shown(client.get("/runs?q=refund-alpha").text) == ["refund-alpha"], "a whole id"
    assert shown(client.get("/runs?q=alpha").text) == [], "an id search is by prefix"
    assert shown(client.get("/runs?q=zx-81&field=input").text) == ["refund-alpha"]
    page = client.get("/runs?q=refund-&field=id&saga=refund&status=waiting").text
    assert sorted(shown(page)) == ["refund-alpha", "refund-beta"]
    assert 'value="refund-"' in page, "the search box keeps what was searched"


def test_columns_sort_the_page_and_show_duration_and_waits(env: Harness) -> None:
    waiting_refund(env, "refund-1")
    env.clock.advance(timedelta(minutes=5))
    env.start("charge", 5, run_id="charge-1")
    env.run_until_idle(skip_time=False)
    env.clock.advance(timedelta(minutes=2))
    env.send_event("refund-1", "nothing-awaited", {})
    env.run_until_idle(skip_time=False)
    client = browser(env)
    page = client.get("/runs").text
    assert shown(page) == ["refund-1", "charge-1"], "last updated first"
    assert shown(client.get("/runs?sort=created").text) == ["refund-1", "charge-1"]
    assert shown(client.get("/runs?sort=-created").text) == ["charge-1", "refund-1"]
    assert shown(client.get("/runs?sort=updated").text) == ["charge-1", "refund-1"]
    assert 'href="/runs?sort=updated"' in page, "the sorted column's header turns its order"
    assert 'href="/runs?sort=-created"' in page
    row = page[page.index("<code>refund-1</code>") :].split("</tr>")[0]
    assert "approval of refund(order=&#34;B-2&#34;, amount=700)" in row
    assert "7 min 0 s" in row, "a waiting run's duration runs to now"
    row = page[page.index("<code>charge-1</code>") :].split("</tr>")[0]
    assert '<td class="waits"></td>' in row and "2 min 0 s" in row, "created to failed"
    env.clock.advance(timedelta(minutes=10))
    page = client.get("/runs").text
    assert "2 min 0 s" in page and "17 min 0 s" in page, "only an unfinished run's grows"


def test_pages_walk_every_run_once_forward_and_back(env: Harness) -> None:
    ids = many_runs(env, 120)
    client = browser(env)
    first = client.get("/runs").text
    assert shown(first) == ids[::-1][:50] and link(first, "prev") is None
    second_url = link(first, "next")
    assert second_url and "after=" in second_url and "offset" not in second_url
    second = client.get(second_url).text
    assert shown(second) == ids[::-1][50:100]
    env.clock.advance(timedelta(seconds=1))
    with env.store.transaction() as tx:  # a run of a later page moves to the first meanwhile
        moved = env.store.get_run(ids[5])
        assert moved is not None
        moved.updated_at = env.clock.now()
        assert env.store.save_run(tx, moved)
    third = client.get(link(second, "next") or "").text
    assert shown(third) == [i for i in ids[::-1][100:] if i != ids[5]], "not shown twice"
    assert link(third, "next") is None
    back = client.get(link(third, "prev") or "").text
    assert shown(back) == shown(second), "Previous is the page before"
    before = client.get(link(back, "prev") or "").text
    assert shown(before) == ids[::-1][:50], "the 50 runs before"
    start = client.get(link(before, "prev") or "").text
    assert shown(start) == [ids[5], *ids[::-1][:49]], "fewer than 50 before: the first page"
    assert link(start, "prev") is None


def test_filters_and_the_page_stay_in_the_address_and_its_live_region(env: Harness) -> None:
    many_runs(env, 60)
    client = browser(env)
    page = client.get("/runs?saga=charge&status=completed&q=bulk&sort=created").text
    after = link(page, "next")
    assert after and all(k in after for k in ("saga=charge", "status=completed", "q=bulk"))
    assert "sort=created" in after
    page = client.get(after).text
    polled = re.search(r'hx-get="([^"]+)"', page)
    assert polled and "after=" in polled.group(1), "the live region polls the same page"


def test_bulk_cancel_asks_then_says_what_was_done_and_refused(env: Harness) -> None:
    for run_id in ("refund-1", "refund-2"):
        waiting_refund(env, run_id)
    env.start("charge", 5, run_id="charge-1")
    env.run_until_idle()
    client = browser(env)
    csrf = csrf_of(client.get("/runs").text)
    picked = [("run_id", "refund-1"), ("run_id", "refund-2"), ("run_id", "charge-1")]
    asked = post(client, [("csrf", csrf), ("action", "cancel"), *picked])
    assert asked.status_code == 200 and "Cancel these 3 runs?" in asked.text
    assert env.get("refund-1").status == "waiting", "nothing is done before the confirmation"
    confirm = re.findall(r'name="(\w+)" value="([^"]*)"', asked.text)
    assert ("confirmed", "1") in confirm and confirm.count(("run_id", "refund-2")) == 1
    done = post(client, confirm)
    assert done.status_code == 200
    assert "Cancel: 2 done, 1 refused" in done.text
    refused = done.text[done.text.index("Refused") :]
    assert "charge-1" in refused and "failed" in refused, "a finished run is refused, with why"
    env.run_until_idle()
    assert {env.get(r).status for r in ("refund-1", "refund-2")} == {"cancelled"}


def test_bulk_retry_refuses_a_run_that_does_not_need_attention(env: Harness) -> None:
    waiting_refund(env, "refund-1")
    client = browser(env)
    csrf = csrf_of(client.get("/runs").text)
    form = [("csrf", csrf), ("action", "retry"), ("run_id", "refund-1"), ("confirmed", "1")]
    done = post(client, form)
    assert "Retry: 0 done, 1 refused" in done.text and "not needs_attention" in done.text


def test_bulk_without_the_pages_csrf_token_is_refused(env: Harness) -> None:
    waiting_refund(env, "refund-1")
    client = browser(env)
    for csrf in ("forged", ""):
        form = [("csrf", csrf), ("action", "cancel"), ("run_id", "refund-1"), ("confirmed", "1")]
        refused = post(client, form)
        assert refused.status_code == 403 and "reload" in refused.text
    env.run_until_idle()
    assert env.get("refund-1").status == "waiting"
    csrf = csrf_of(client.get("/runs").text)
    assert post(client, [("csrf", csrf), ("action", "cancel")]).status_code == 400
    ticked = [("run_id", f"run-{n:06}") for n in range(201)]
    too_many = post(client, [("csrf", csrf), ("action", "cancel"), *ticked])
    assert too_many.status_code == 400 and "at most 200" in too_many.text
    huge = post(client, [("csrf", csrf), ("action", "cancel"), ("reason", "x" * 300_000)])
    assert huge.status_code == 413


def test_an_unchanged_poll_is_204_or_304_and_reads_no_listing(
    env: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = waiting_refund(env, "refund-1")
    client = browser(env)
    page = client.get("/runs").text
    polled = re.search(r'hx-get="([^"]+)"', page)
    assert polled
    url = polled.group(1).replace("&amp;", "&")
    listed: list[object] = []
    original = env.store.list_runs

    def counting(**kwargs: Any) -> list[RunRecord]:
        listed.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(env.store, "list_runs", counting)
    assert client.get(url).status_code == 204
    full = client.get("/runs/live")
    assert full.status_code == 200 and full.headers["etag"]
    assert len(listed) == 1
    again = client.get("/runs/live", headers={"if-none-match": full.headers["etag"]})
    assert again.status_code == 304
    assert len(listed) == 1, "an unchanged poll reads no listing"
    env.clock.advance(timedelta(seconds=1))
    env.approve(run_id, "refund")
    env.run_until_idle(skip_time=False)
    moved = client.get(url)
    assert moved.status_code == 200 and "parcel_returned" in moved.text
    assert (
        client.get("/runs/live", headers={"if-none-match": full.headers["etag"]}).status_code == 200
    )


def test_the_approvals_link_counts_the_open_approvals(env: Harness) -> None:
    client = browser(env)
    assert 'title="open approvals"' not in client.get("/runs").text
    waiting_refund(env, "refund-1")
    waiting_refund(env, "refund-2")
    nav = client.get("/runs").text
    badge = '<span class="badge" title="open approvals">2</span>'
    assert f'Approvals<span id="approvals-open"> {badge}</span>' in nav
    assert nav.count('id="approvals-open"') == 1
    live = client.get("/runs/live?v=moved").text
    assert f'<span id="approvals-open" hx-swap-oob="true"> {badge}</span>' in live, (
        "the live region brings the header's count along"
    )


def test_a_cursor_that_is_not_one_is_refused_with_what_to_do(env: Harness) -> None:
    many_runs(env, 3)
    client = browser(env)
    refused = client.get("/runs?after=garbage")
    assert refused.status_code == 409 and "not a cursor of the runs listing" in refused.text
    assert shown(client.get("/runs?sort=sideways").text) == ["bulk-002", "bulk-001", "bulk-000"]


def test_a_running_run_says_which_step_it_waits_on(env: Harness) -> None:
    at = env.clock.now()
    run = RunRecord("busy-1", "console-shop", "charge", "running", 5, at, at)
    events = [
        NewEvent(h.RUN_STARTED, None, "charge", {}),
        NewEvent(h.STEP_SCHEDULED, 0, "charge_card", {"queue": "payments"}),
    ]
    with env.store.transaction() as tx:
        assert env.store.create_run(tx, run)
        run.last_seq = run.processed_seq = env.store.append_events(tx, run.run_id, 0, events, at)[
            -1
        ].seq
        assert env.store.save_run(tx, run)
    page = browser(env).get("/runs").text
    row = page[page.index("<code>busy-1</code>") :].split("</tr>")[0]
    assert "step &#39;charge_card&#39; on payments" in row


def test_a_store_error_is_a_page_that_says_so(
    env: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = browser(env)

    def down(**kwargs: Any) -> Any:
        raise StoreError("the database is unreachable")

    monkeypatch.setattr(env.store, "open_approvals", down)
    monkeypatch.setattr(env.store, "list_runs", down)
    page = client.get("/runs")
    assert page.status_code == 409 and "the database is unreachable" in page.text
