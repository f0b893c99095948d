"""Run data never reaches the terminal raw: an error text, a model's approval reason, a run or
call id or a streamed text that holds ESC/OSC sequences, C1 controls or bidi overrides is shown
with those characters escaped (``\\x1b``, ``\\u202e``) in ``status``, ``approvals``, ``list``,
``tail`` and the errors of the CLI, so no run can rewrite what an operator reads."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cli_env import cli_database, run

from sagaloop.cli import render
from sagaloop.cli.render import printable
from sagaloop.testing import Harness, VirtualClock

APP = """
from datetime import timedelta
from typing import Any

from sagaloop import App, SagaContext

app = App("escapes_cli")


@app.saga(name="pay")
async def pay(ctx: SagaContext, args: dict[str, Any]) -> Any:
    ok = await ctx.approval(
        "transfer",
        {"cents": 999999},
        call_id=args["call"],
        timeout=timedelta(days=1),
        reason=args["reason"],
    )
    return ok.model_dump()


@app.saga(name="boom")
async def boom(ctx: SagaContext, args: dict[str, Any]) -> Any:
    raise ValueError(args["reason"])
"""
FAKE = '\x1b[1A\x1b[2K\r  {"cents": 1} approved\x1b]0;owned\x07\x9b2J\u202eevil\u2066\x7f'
"""Moves up, erases the line that shows {"cents": 999999} and writes a fake one; sets the
window title (OSC); a C1 CSI; a bidi override and isolate; DEL."""
RUN = "run\x1b[31m-1"
CALL = "call\x1b]8;;http://x\x07-1"
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""What must never reach the terminal from run data (newlines aside)."""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    db = cli_database(tmp_path, monkeypatch, "escapes_cli", APP)
    import escapes_cli

    harness = Harness(
        escapes_cli.app,
        url=f"sqlite:///{db}",
        clock=VirtualClock(datetime(2100, 1, 1, tzinfo=UTC)),
    )
    harness.start("pay", {"call": CALL, "reason": FAKE}, run_id=RUN)
    harness.start("boom", {"reason": FAKE}, run_id="boom-1")
    harness.run_until_idle(skip_time=False)
    yield harness
    harness.close()


def clean(output: str) -> str:
    assert not RAW.search(output), repr(output)
    return output


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("a\x1bb", "a\\x1bb"),
        ("\x07\x00\t\r", "\\x07\\x00\\t\\r"),
        ("\x7f\x9b\x80", "\\x7f\\x9b\\x80"),
        ("\u202ax\u202e\u2066\u2069", "\\u202ax\\u202e\\u2066\\u2069"),
        ("line\nnext", "line\\nnext"),
        ("ünïcode, 日本 and emoji 🙂 stay", "ünïcode, 日本 and emoji 🙂 stay"),
    ],
)
def test_printable_shows_every_control_character(raw: str, shown: str) -> None:
    assert printable(raw) == shown


def test_printable_keeps_newlines_where_the_layout_needs_them() -> None:
    assert printable("a\x1b\nb", newlines=True) == "a\\x1b\nb"


def test_status_escapes_the_reason_ids_and_error(env: Harness) -> None:
    result = run("status", RUN)
    assert result.exit_code == 0, result.output
    out = clean(result.output)
    assert "run\\x1b[31m-1" in out
    assert "call\\x1b]8;;http://x\\x07-1" in out
    assert '\\x1b[1A\\x1b[2K\\r  {"cents": 1} approved\\x1b]0;owned\\x07\\x9b2J\\u202eevil' in out
    assert '{"cents": 999999}' in out
    failed = clean(run("status", "boom-1").output)
    assert "ValueError: \\x1b[1A" in failed


def test_approvals_list_and_tail_escape_run_data(env: Harness) -> None:
    clean(run("approvals").output)
    assert "run\\x1b[31m-1" in run("approvals").output
    listed = clean(run("list").output)
    assert "run\\x1b[31m-1" in listed
    tailed = clean(run("tail", RUN, "--no-follow").output)
    assert "\\u001b[1A" in tailed  # JSON's escape of the history's data
    clean(run("tail", "boom-1", "--no-follow").output)


def test_stream_lines_escape_streamed_text() -> None:
    line = render.stream_line({"source": "live", "step": "s\x1b", "data": {"text": FAKE}})
    assert not RAW.search(line) and line.startswith("~ s\\x1b: \\x1b[1A")


def test_in_colour_the_data_is_escaped_before_rich_draws_it(
    env: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "in_colour", lambda: True)
    for args in (("status", RUN), ("approvals",), ("list",)):
        out = run(*args).output
        # rich's own colours are ESC [ ... m; nothing else of the data's is raw
        assert "\x1b]" not in out and "\x1b[2K" not in out and "\x1b[1A" not in out, args
        assert "\u202e" not in out and "\x9b" not in out and "\x07" not in out, args


def test_an_error_naming_run_data_is_escaped(env: Harness) -> None:
    result = run("cancel", "no\x1b]0;such\x07-run")
    assert result.exit_code != 0
    clean(result.output)
    result = run("send-event", "boom-1", "x", "--data", '"\x1b]0;t\x07"')
    clean(result.output)


def test_dead_letters_show_escapes_what_a_publisher_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone allowed to publish can make a dead letter: its run id, reason and body are shown
    escaped (the envelope's JSON escapes C0 controls itself, not C1 nor bidi controls)."""
    from datetime import timedelta

    from sagaloop.engine.messages import Envelope
    from sagaloop.store.sql import SqlStore

    cli_database(tmp_path, monkeypatch, "dead_escapes", "")
    store = SqlStore(f"sqlite:///{tmp_path / 'cli.db'}")
    now = datetime(2026, 11, 29, tzinfo=UTC)
    body = Envelope(
        type="event",
        run_id=RUN + "\u202e\x9b",
        message_id="m-1",
        payload={"name": "go", "data": FAKE},
        created_at=now,
    ).to_bytes()
    store.enqueue_raw([("x.engine", body), ("x.engine", b"\x1b]0;raw\x07 body")], now)
    for row in store.claim(None, 10, now, timedelta(seconds=60)):
        store.dead_letter(row.id, row.claim_token, FAKE, now)
    store.close()
    for id in ("1", "2"):
        result = run("dead-letters", "show", id)
        assert result.exit_code == 0, result.output
        clean(result.output)
    clean(run("dead-letters", "list").output)


def test_log_lines_escape_run_data_and_keep_tracebacks_readable() -> None:
    import logging

    from sagaloop.cli.main import _ScrubbingFormatter

    formatter = _ScrubbingFormatter(lambda text: text)
    try:
        raise ValueError(FAKE)
    except ValueError:
        import sys

        record = logging.LogRecord(
            "sagaloop.engine", logging.ERROR, __file__, 1, "step %s failed", (FAKE,), sys.exc_info()
        )
    line = formatter.format(record)
    assert not RAW.search(line), repr(line)
    assert "Traceback (most recent call last):\n" in line


def test_an_answer_echoes_the_ids_escaped(env: Harness) -> None:
    result = run("approve", RUN, CALL)
    assert result.exit_code == 0, result.output
    assert (
        clean(result.output) == "approved: run run\\x1b[31m-1, call call\\x1b]8;;http://x\\x07-1\n"
    )
