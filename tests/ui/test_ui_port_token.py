"""`sagaloop dev --ui-port` honours SAGALOOP_UI_TOKEN as `sagaloop ui` does: with it set, the
console beside the command lets in only the bearers of the token (nor reads nor answers
anything without it), and a short one is refused before anything starts."""

from __future__ import annotations

import socket
from pathlib import Path

import click
import httpx2
import pytest
from click.testing import CliRunner

from sagaloop.cli.ui import with_ui_port

TOKEN = "a-console-token-of-some-length"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def group_with(service: click.Command, tmp_path: Path) -> click.Group:
    @click.group()
    @click.pass_context
    def group(ctx: click.Context) -> None:
        from sagaloop.cli.common import Obj

        ctx.obj = Obj(f"sqlite:///{tmp_path / 'ui.db'}")

    group.add_command(service)
    return group


def test_ui_port_needs_the_token_of_sagaloop_ui_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    seen: list[int] = []

    @click.command()
    @with_ui_port
    def service() -> None:
        base = f"http://127.0.0.1:{port}"
        seen.append(httpx2.get(f"{base}/runs").status_code)
        seen.append(httpx2.post(f"{base}/runs/x/cancel", data={}).status_code)
        bearer = {"authorization": f"Bearer {TOKEN}"}
        seen.append(httpx2.get(f"{base}/runs", headers=bearer).status_code)

    monkeypatch.delenv("SAGALOOP_APP", raising=False)
    monkeypatch.setenv("SAGALOOP_UI_TOKEN", TOKEN)
    result = CliRunner().invoke(group_with(service, tmp_path), ["service", "--ui-port", str(port)])
    assert result.exit_code == 0, result.output
    assert seen == [401, 401, 200]
    assert TOKEN not in result.output


def test_ui_port_refuses_a_short_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[bool] = []

    @click.command()
    @with_ui_port
    def service() -> None:
        ran.append(True)

    monkeypatch.delenv("SAGALOOP_APP", raising=False)
    monkeypatch.setenv("SAGALOOP_UI_TOKEN", "short")
    result = CliRunner().invoke(
        group_with(service, tmp_path), ["service", "--ui-port", str(free_port())]
    )
    assert result.exit_code == 1 and "at least 16" in result.output, result.output
    assert ran == []
