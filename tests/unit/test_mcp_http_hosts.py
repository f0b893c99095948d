"""`sagaloop mcp --http` without a token serves the loopback interface only, and only to requests
that name it: a DNS-rebinding page (whose domain resolves to the bound loopback address) sends
its own ``Host`` and ``Origin``, and is refused (421, 403) before any tool runs, on every
loopback address (127.0.0.2 too, which the mcp package's own check does not cover)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from sagaloop.mcp_server.http import HostCheck
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

HERE = Path(__file__).parent
SAGALOOP = str(Path(sys.executable).with_name("sagaloop"))
ACCEPT = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"},
    },
}
CALL = {
    "jsonrpc": "2.0",
    "id": 2,
    "method": "tools/call",
    "params": {"name": "billing_greet", "arguments": {"input": "mallory"}},
}


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, int, SqlStore]]:
    """`sagaloop mcp --http` on 127.0.0.2 without a token, on a new database."""
    host = "127.0.0.2"
    port = free_port(host)
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    store = SqlStore(url)
    store.upgrade()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env = {**base, "SAGALOOP_DATABASE_URL": url, "PYTHONPATH": str(HERE)}
    log = tmp_path / "mcp.log"
    command = [SAGALOOP, "mcp", "--app", "mcp_sagas_app", "--http"]
    with log.open("wb") as out:
        server = subprocess.Popen(
            [*command, "--host", host, "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def listens() -> bool:
        assert server.poll() is None, log.read_text()
        try:
            socket.create_connection((host, port), timeout=0.2).close()
        except OSError:
            return False
        return True

    try:
        eventually(listens, what="the MCP server")
        yield host, port, store
    finally:
        server.terminate()
        server.wait(timeout=30)
        store.close()


def post(host: str, port: int, body: dict[str, Any], headers: dict[str, str]) -> httpx2.Response:
    return httpx2.post(
        f"http://{host}:{port}/mcp", json=body, headers={**ACCEPT, **headers}, timeout=30
    )


def test_a_rebinding_page_is_refused_before_any_tool_runs(
    served: tuple[str, int, SqlStore],
) -> None:
    host, port, store = served
    evil = {"host": f"evil.example:{port}"}
    assert post(host, port, INIT, evil).status_code == 421
    # The page's own origin, with the right Host (a browser sends both for a rebound name).
    origin = {"host": f"{host}:{port}", "origin": f"http://evil.example:{port}"}
    assert post(host, port, INIT, origin).status_code == 403

    # A session opened properly, then used by the page: refused before the tool runs.
    opened = post(host, port, INIT, {"host": f"{host}:{port}"})
    assert opened.status_code == 200, opened.text
    session = {"mcp-session-id": opened.headers["mcp-session-id"]}
    assert post(host, port, CALL, {**session, **evil}).status_code == 421
    assert post(host, port, CALL, {**session, **origin}).status_code == 403
    assert store.list_runs(saga="billing.greet", limit=10) == []

    # What a local client sends is let in: the bound address, localhost, a matching origin.
    for allowed in (
        {"host": f"{host}:{port}"},
        {"host": f"localhost:{port}"},
        {"host": f"{host}:{port}", "origin": f"http://{host}:{port}"},
    ):
        response = post(host, port, CALL, {**session, **allowed})
        assert response.status_code == 200, (allowed, response.text)
    assert len(store.list_runs(saga="billing.greet", limit=10)) == 1  # one input, one run


@pytest.mark.parametrize(
    ("bound", "port", "host", "origin", "allowed"),
    [
        ("127.0.0.1", 8000, "127.0.0.1:8000", None, True),
        ("127.0.0.1", 8000, "localhost:8000", "http://localhost:8000", True),
        ("127.0.0.1", 8000, "LOCALHOST:8000", None, True),
        ("127.0.0.1", 8000, "127.0.0.1:8001", None, False),
        ("127.0.0.1", 8000, "127.0.0.2:8000", None, False),
        ("127.0.0.1", 8000, "attacker.test:8000", None, False),
        ("127.0.0.1", 8000, None, None, False),
        ("127.0.0.1", 8000, "127.0.0.1:8000", "http://attacker.test:8000", False),
        ("127.0.0.1", 8000, "127.0.0.1:8000", "null", False),
        ("127.0.0.1", 8000, "127.0.0.1:8000", "https://127.0.0.1:8000", False),
        ("::1", 8000, "[::1]:8000", "http://[::1]:8000", True),
        ("::1", 8000, "::1:8000", None, False),
        ("127.0.0.1", 80, "127.0.0.1", "http://127.0.0.1", True),
    ],
)
def test_the_host_check_lets_in_only_the_bound_address(
    bound: str, port: int, host: str | None, origin: str | None, allowed: bool
) -> None:
    check = HostCheck(None, host=bound, port=port)  # type: ignore[arg-type]
    assert (check.refusal(host, origin) is None) is allowed
