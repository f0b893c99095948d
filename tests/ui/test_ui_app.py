"""The console's Starlette app through its test client (httpx), on a Harness's database: who
is let in (host, token), which POSTs are refused (CSRF), the filters, the live regions, the
actions, the transcript; and the ``sagaloop ui`` command."""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import httpx2
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from sagaloop.cli import ui as cli_ui
from sagaloop.cli.main import cli
from sagaloop.cli.ui import with_ui_port
from sagaloop.engine.messages import engine_queue
from sagaloop.errors import ValidationError
from sagaloop.sagas.approvals import args_hash
from sagaloop.testing import Harness
from sagaloop.ui import check_bind, create_app
from sagaloop.ui.security import is_loopback
from sagaloop.ui.transcript import message_parts, response_parts
from tests.ui import console_app

HERE = "http://127.0.0.1:8765"
TOKEN = "a-console-token-of-some-length"
REFUND = {"order": "B-2", "amount": 700}
UI = Path(__file__).resolve().parents[2] / "sagaloop" / "ui"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(console_app.app, url=f"sqlite:///{tmp_path / 'ui.db'}")
    yield harness
    harness.close()


def browser(env: Harness, *, token: str | None = None, base: str = HERE) -> TestClient:
    return TestClient(create_app(env.client, console_app.app, token), base_url=base)


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no form"
    return found.group(1)


def post(client: TestClient, path: str, data: dict[str, str], **headers: str) -> Any:
    return client.post(path, data=data, headers={"origin": HERE, **headers}, follow_redirects=False)


def waiting_refund(env: Harness, run_id: str = "refund-1") -> str:
    env.start("refund", REFUND, run_id=run_id)
    env.run_until_idle()
    assert env.approvals(run_id)
    return run_id


# --- where it listens and who is let in --------------------------------------------------------


def test_beyond_the_loopback_interface_a_token_is_required() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert is_loopback(host)
        check_bind(host, None)
    for host in ("0.0.0.0", "192.0.2.7", "example.com", "::"):
        assert not is_loopback(host)
        with pytest.raises(ValidationError, match="without a token"):
            check_bind(host, None)
        check_bind(host, TOKEN)
    with pytest.raises(ValidationError, match="at least 16"):
        check_bind("127.0.0.1", "short")


def test_the_command_refuses_a_public_address_without_a_token_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SAGALOOP_UI_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["ui", "--host", "0.0.0.0"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: refusing to serve the console on 0.0.0.0 without")
    assert len(result.output.strip().splitlines()) == 1


def test_without_a_token_only_loopback_host_names_are_served(env: Harness) -> None:
    for base in (HERE, "http://localhost:8765", "http://[::1]:8765"):
        assert browser(env, base=base).get("/runs").status_code == 200
    refused = browser(env, base="http://rebound.example:8765").get("/runs")
    assert refused.status_code == 400
    assert "loopback" in refused.text


def test_with_a_token_every_request_carries_it(env: Harness) -> None:
    client = browser(env, token=TOKEN, base="http://console.example")
    for path in ("/runs", "/static/htmx.min.js", "/run/live?id=x"):
        response = client.get(path)
        assert response.status_code == 401, path
        assert "?token=" in response.text
    assert client.get("/runs", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert client.get("/runs", headers={"authorization": "Bearer nope"}).status_code == 401
    assert client.get("/runs?token=wrong").status_code == 401

    login = client.get("/runs?status=failed&token=" + TOKEN, follow_redirects=False)
    assert login.status_code == 303
    assert login.headers["location"] == "/runs?status=failed"  # the token leaves the address
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    assert client.get("/runs").status_code == 200  # the cookie now
    assert client.get("/static/htmx.min.js").status_code == 200


def test_every_response_forbids_framing_sniffing_caching_and_foreign_scripts(
    env: Harness,
) -> None:
    for response in (browser(env).get("/runs"), browser(env, token=TOKEN).get("/runs")):
        headers = response.headers
        assert "script-src 'self'" in headers["content-security-policy"]
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-frame-options"] == "DENY"
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["cache-control"] == "no-store"


# --- actions: CSRF, confirmation, the approval's hash -----------------------------------------


def test_a_post_without_the_pages_token_or_from_another_site_changes_nothing(
    env: Harness,
) -> None:
    run_id = waiting_refund(env)
    client = browser(env)
    csrf = csrf_of(client.get(f"/run?id={run_id}").text)
    form = {"run_id": run_id, "confirmed": "1"}
    refusals = [
        post(client, "/run/cancel", form),
        post(client, "/run/cancel", {**form, "csrf": "forged"}),
        post(client, "/run/cancel", {**form, "csrf": csrf}, origin="http://evil.example"),
        post(client, "/run/cancel", {**form, "csrf": csrf}, **{"sec-fetch-site": "cross-site"}),
    ]
    assert [r.status_code for r in refusals] == [403, 403, 403, 403]
    assert "reload the page" in refusals[0].text
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"
    assert client.get("/run/cancel").status_code == 405  # changes are POSTs only


def test_cancel_asks_for_confirmation_then_cancels(env: Harness) -> None:
    run_id = waiting_refund(env)
    client = browser(env)
    csrf = csrf_of(client.get(f"/run?id={run_id}").text)
    asked = post(client, "/run/cancel", {"run_id": run_id, "csrf": csrf})
    assert asked.status_code == 200 and "Cancel this run?" in asked.text
    assert 'name="confirmed" value="1"' in asked.text
    env.run_until_idle()
    assert env.get(run_id).status == "waiting"

    done = post(client, "/run/cancel", {"run_id": run_id, "csrf": csrf, "confirmed": "1"})
    assert done.status_code == 303
    assert done.headers["location"] == f"/run?id={run_id}&done=cancelled"
    env.run_until_idle()
    assert env.get(run_id).status == "cancelled"
    page = client.get(done.headers["location"]).text
    assert "Cancellation requested" in page and "compensated" in page
    again = post(client, "/run/cancel", {"run_id": run_id, "csrf": csrf, "confirmed": "1"})
    assert again.status_code == 409 and "cancelled" in again.text


def test_an_answer_names_the_hash_of_the_arguments_shown(env: Harness) -> None:
    run_id = waiting_refund(env)
    client = browser(env)
    page = client.get(f"/run?id={run_id}").text
    assert args_hash(REFUND) in page and "&#34;order&#34;: &#34;B-2&#34;" in page
    csrf = csrf_of(page)
    form = {"run_id": run_id, "call_id": "refund", "csrf": csrf}

    stale = post(client, "/approve", {**form, "args_hash": "0" * 64})
    assert stale.status_code == 409 and "reload the page" in stale.text
    no_reason = post(client, "/deny", {**form, "args_hash": args_hash(REFUND), "reason": " "})
    assert no_reason.status_code == 400
    env.run_until_idle()
    assert env.approvals(run_id)

    approved = post(client, "/approve", {**form, "args_hash": args_hash(REFUND), "by": "ann"})
    assert approved.status_code == 303
    env.run_until_idle()
    answer = env.client.get_published(run_id, "approval:refund")
    assert answer["status"] == "approved" and answer["by"] == "ann"
    late = post(client, "/approve", {**form, "args_hash": args_hash(REFUND)})
    assert late.status_code == 409 and "waits for no approval" in late.text


def test_of_two_consoles_answering_at_once_the_second_is_told_it_lost(env: Harness) -> None:
    """Two people, two tabs, no engine activity in between: one answer wins, the other sees
    that the approval was already answered, by whom, and nothing of theirs is sent."""
    run_id = waiting_refund(env)
    ann, bob = browser(env), browser(env)
    form = {"run_id": run_id, "call_id": "refund", "args_hash": args_hash(REFUND)}
    page_ann, page_bob = ann.get(f"/run?id={run_id}").text, bob.get(f"/run?id={run_id}").text
    denied = post(ann, "/deny", {**form, "reason": "fraud", "by": "ann", "csrf": csrf_of(page_ann)})
    assert denied.status_code == 303
    approved = post(bob, "/approve", {**form, "by": "bob", "csrf": csrf_of(page_bob)})
    assert approved.status_code == 409 and "already answered (denied by &#39;ann&#39;" in (
        approved.text
    )
    env.run_until_idle()
    assert env.result(run_id) == {"refunded": False, "reason": "fraud"}


def test_the_approvals_page_lists_and_answers_every_pending_approval(env: Harness) -> None:
    waiting_refund(env, "refund-1")
    waiting_refund(env, "refund-2")
    client = browser(env)
    page = client.get("/approvals").text
    assert "refund-1" in page and "refund-2" in page
    denied = post(
        client,
        "/deny",
        {
            "run_id": "refund-2",
            "call_id": "refund",
            "args_hash": args_hash(REFUND),
            "reason": "no parcel",
            "next": "approvals",
            "csrf": csrf_of(page),
        },
    )
    assert denied.headers["location"] == "/approvals?done=denied"
    env.run_until_idle()
    assert env.result("refund-2") == {"refunded": False, "reason": "no parcel"}
    assert "refund-2" not in client.get("/approvals").text


def test_send_event_and_retry(env: Harness) -> None:
    run_id = waiting_refund(env)
    env.approve(run_id, "refund")
    env.run_until_idle(skip_time=False)
    client = browser(env)
    csrf = csrf_of(client.get(f"/run?id={run_id}").text)
    bad = post(client, "/run/event", {"run_id": run_id, "name": "x", "data": "{", "csrf": csrf})
    assert bad.status_code == 400 and "not valid JSON" in bad.text
    nan = post(client, "/run/event", {"run_id": run_id, "name": "x", "data": "NaN", "csrf": csrf})
    assert nan.status_code == 400
    sent = post(client, "/run/event", {"run_id": run_id, "name": "parcel_returned", "csrf": csrf})
    assert sent.headers["location"].endswith("done=event")
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "completed"
    retry = post(client, "/run/retry", {"run_id": run_id, "csrf": csrf, "confirmed": "1"})
    assert retry.status_code == 409 and "not needs_attention" in retry.text


def polled_of(html: str) -> str:
    found = re.search(r'hx-get="([^"]+)"', html)
    assert found, "the page has no live region"
    return found.group(1).replace("&amp;", "&")


def answer_forms(html: str) -> list[str]:
    """The Approve and Deny buttons' forms (not the "edit arguments" one)."""
    return re.findall(r'<form method="post" action="/(approve|deny)"', html)


def test_an_answered_approval_shows_at_once_then_its_outcome(env: Harness) -> None:
    """After Approve, the card says the answer is awaiting the engine and offers no buttons
    (a second click led to a "Not done" page); once the engine recorded it, the outcome."""
    client = browser(env)
    for run_id in ("refund-1", "refund-2"):
        waiting_refund(env, run_id)
    page = client.get("/run?id=refund-1").text
    assert len(answer_forms(page)) == 2
    polls = [polled_of(page), polled_of(client.get("/approvals").text)]
    assert [client.get(url).status_code for url in polls] == [204, 204]
    form = {"call_id": "refund", "args_hash": args_hash(REFUND), "csrf": csrf_of(page)}
    approved = post(client, "/approve", {**form, "run_id": "refund-1", "by": "ann"})
    for url in polls:  # another tab open on the run, or on the approvals: they move too
        moved = client.get(url)
        assert moved.status_code == 200 and "answered: approved by ann" in moved.text, url
    denied = post(
        client,
        "/deny",
        {**form, "run_id": "refund-2", "by": "bob", "reason": "no parcel", "next": "approvals"},
    )
    page = client.get(approved.headers["location"]).text
    assert "Approved: the run goes on" in page
    assert "answered: approved by ann" in page and "awaiting the engine" in page
    assert answer_forms(page) == [], "no button to click twice"
    listing = client.get(denied.headers["location"]).text
    assert "answered: denied by bob" in listing and "awaiting the engine" in listing
    assert answer_forms(listing) == []

    env.run_until_idle()
    page = client.get("/run?id=refund-1").text
    assert "awaiting the engine" not in page and answer_forms(page) == []
    assert re.search(r'status st-approved">approved<', page) and "by ann" in page
    page = client.get("/run?id=refund-2").text  # finished: the outcome stays on its page
    assert env.get("refund-2").status == "completed"
    assert re.search(r'status st-denied">denied<', page) and "no parcel" in page
    assert "by bob" in page and answer_forms(page) == []


def test_a_refused_answer_says_why_and_the_buttons_come_back(env: Harness) -> None:
    run_id = waiting_refund(env)
    env.send_event(run_id, "approval:refund", {"approved": True, "args_hash": "0" * 64})
    env.run_until_idle()
    page = browser(env).get(f"/run?id={run_id}").text
    assert "last answer refused" in page and "awaiting the engine" not in page
    assert len(answer_forms(page)) == 2


def test_a_needs_attention_run_shows_its_answered_approval_as_answered(env: Harness) -> None:
    env.start("charge_and_ask", 30, run_id="ask-1")
    env.run_until_idle()
    assert env.get("ask-1").status == "needs_attention"
    client = browser(env)
    page = client.get("/run?id=ask-1").text
    assert len(answer_forms(page)) == 2
    form = {"run_id": "ask-1", "call_id": "charge", "args_hash": args_hash({"amount": 30})}
    assert post(client, "/approve", {**form, "by": "ann", "csrf": csrf_of(page)}).status_code == 303
    env.run_until_idle(skip_time=False)
    assert env.get("ask-1").status == "needs_attention"
    page = client.get("/run?id=ask-1").text
    assert "answered: approved by ann" in page and answer_forms(page) == []


# --- reading -----------------------------------------------------------------------------------


def test_runs_are_filtered_by_saga_status_and_age_with_counts(env: Harness) -> None:
    env.start("charge", 5, run_id="charge-old")
    env.run_until_idle()
    env.clock.advance(timedelta(hours=3))
    waiting_refund(env, "refund-new")
    client = browser(env)

    def shown(query: str) -> set[str]:
        return set(re.findall(r"<code>([\w-]+)</code></a></td>", client.get(query).text))

    assert shown("/runs") == {"charge-old", "refund-new"}
    assert shown("/runs?saga=charge") == {"charge-old"}
    assert shown("/runs?status=waiting") == {"refund-new"}
    assert shown("/runs?age=1h") == {"refund-new"}
    assert shown("/runs?age=24h&saga=charge") == {"charge-old"}
    assert shown("/runs?status=bogus&age=bogus") == {"charge-old", "refund-new"}
    page = client.get("/runs?saga=charge").text
    assert re.search(r"failed <b>1</b>", page) and re.search(r"waiting <b>0</b>", page)
    assert "/runs?saga=charge&amp;status=failed" in page  # a count filters by its status


def test_a_live_region_is_sent_again_only_when_it_moved(env: Harness) -> None:
    run_id = waiting_refund(env)
    client = browser(env)
    for page_path, live_path in (
        ("/runs", "/runs/live?"),
        (f"/run?id={run_id}", f"/run/live?id={run_id}&"),
        ("/approvals", "/approvals/live?"),
        (f"/run/transcript?id={run_id}", f"/run/transcript/live?id={run_id}&"),
    ):
        page = client.get(page_path).text
        found = re.search(r'hx-get="([^"]+)"', page)
        assert found, page_path
        polled = found.group(1).replace("&amp;", "&")
        assert polled.startswith(live_path)
        assert client.get(polled).status_code == 204  # nothing moved
    env.approve(run_id, "refund")
    env.run_until_idle(skip_time=False)
    moved = client.get(f"/run/live?id={run_id}&v=old")
    assert moved.status_code == 200 and "parcel_returned" in moved.text


def test_a_failed_step_shows_each_attempts_error_and_traceback(env: Harness) -> None:
    env.start("charge", 30, run_id="charge-1")
    env.run_until_idle()
    page = browser(env).get("/run?id=charge-1").text
    assert "attempt 1" in page and "attempt 2" in page
    assert page.count("card 4242 declined: insufficient funds for 30") >= 2
    assert "Traceback (most recent call last)" in page and "in charge_card" in page


def test_an_agent_runs_transcript_shows_messages_tool_calls_results_and_tokens(
    env: Harness,
) -> None:
    run_id = env.start("support", "Where is my order A-17?")
    env.run_until_idle()
    client = browser(env)
    assert "Transcript (2 model requests)" in client.get(f"/run?id={run_id}").text
    page = client.get(f"/run/transcript?id={run_id}").text
    for text in (
        "Where is my order A-17?",
        "Answer about orders.",
        "tool call <code>order_status</code>",
        "tool result <code>order_status</code>",
        "A-17: shipped on Monday",
        "Your order A-17: shipped on Monday.",
        "55 in / 12 out tokens",
    ):
        assert text in page, text
    assert page.count("Answer about orders.") == 1  # instructions sent again are not repeated


def test_transcripts_read_openai_and_chat_shapes_and_show_anything_else_as_json() -> None:
    call = {"type": "function_call", "name": "refund", "arguments": '{"a": 1}', "call_id": "c1"}
    assert [(p.kind, p.label) for p in message_parts(call)] == [("tool call", "refund")]
    output = {"type": "function_call_output", "call_id": "c1", "output": "done"}
    assert message_parts(output)[0].text == "done"
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}
    assert [(p.kind, p.text) for p in message_parts(said)] == [("assistant", "hi")]
    chat = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "t1", "function": {"name": "lookup", "arguments": "{}"}}],
    }
    assert [(p.kind, p.label) for p in message_parts(chat)] == [("tool call", "lookup")]
    tool = {"role": "tool", "tool_call_id": "t1", "content": "42"}
    assert [(p.kind, p.label, p.text) for p in message_parts(tool)] == [("tool result", "t1", "42")]
    assert response_parts({"message": {"role": "assistant", "content": "ok"}})[0].text == "ok"
    for odd in ({"what": "ever"}, 12, ["a"], {"parts": ["x"]}):
        parts = message_parts(odd)
        assert parts and all(p.kind == "other" for p in parts)


def test_dead_letters_are_listed_with_their_reason(env: Harness) -> None:
    queue = engine_queue("console-shop")
    env.store.enqueue_raw([(queue, b"not json"), (queue, b'{"run_id": "r-9"}')], env.clock.now())
    env.run_until_idle()
    page = browser(env).get("/dead-letters").text
    assert "message is not JSON" in page and "not json" in page
    assert "<code>r-9</code>" in page and "sagaloop dead-letters resend ID" in page


def test_an_unknown_run_is_a_page_that_says_so(env: Harness) -> None:
    client = browser(env)
    missing = client.get("/run?id=nope")
    assert missing.status_code == 404 and "nope" in missing.text
    assert client.get("/run").status_code == 400


# --- the package ---------------------------------------------------------------------------------


def test_htmx_is_the_pinned_file_of_the_npm_package_with_its_license() -> None:
    body = (UI / "static" / "htmx.min.js").read_bytes()
    # htmx.org 2.0.11, dist/htmx.min.js (npm integrity sha512-Thx/WtpeOQqSrqBCw/A1cwGJGg4U...)
    assert hashlib.sha256(body).hexdigest() == (
        "d6fdc75f204e6bdefa99b69bf1e6d4ac69b8a364f77929f45c13476b4000f717"
    )
    assert "Zero-Clause BSD" in (UI / "static" / "htmx.LICENSE").read_text()


def test_the_console_is_a_leaf_that_the_cli_imports_only_when_asked() -> None:
    for path in sorted(UI.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                parts = name.split(".")
                assert not (parts[0] == "sagaloop" and parts[1:2] in (["cli"], ["store"])), path
                assert parts[0] not in ("sqlalchemy", "psycopg", "kombu", "pika"), path
    # the command imports the console (its optional extra) only when it runs
    command = Path(cli_ui.__file__).read_text()
    top = [n for n in ast.parse(command).body if isinstance(n, ast.Import | ast.ImportFrom)]
    for node in top:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        assert not any(
            str(n).startswith(("sagaloop.ui", "starlette", "jinja2", "uvicorn")) for n in names
        ), ast.dump(node)


def test_with_ui_port_serves_the_console_beside_a_command(
    env: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    seen: list[int] = []

    @click.command()
    @with_ui_port
    def service() -> None:
        seen.append(httpx2.get(f"http://127.0.0.1:{port}/runs").status_code)

    @click.group()
    @click.pass_context
    def group(ctx: click.Context) -> None:
        from sagaloop.cli.common import Obj

        ctx.obj = Obj(f"sqlite:///{tmp_path / 'ui.db'}")

    group.add_command(service)
    monkeypatch.delenv("SAGALOOP_APP", raising=False)
    result = CliRunner().invoke(group, ["service", "--ui-port", str(port)])
    assert result.exit_code == 0, result.output
    assert seen == [200]
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"http://127.0.0.1:{port}/runs")
    assert "--ui-port" in CliRunner().invoke(group, ["service", "--help"]).output
