"""`sagaloop mcp`: the sagas of tests/unit/mcp_sagas_app.py served as MCP tools, driven by the
`mcp` package's own client against the server as a real process (stdio, and streamable HTTP),
while a real `sagaloop dev` on the same SQLite file runs what the tools start.

Each MCP server process costs about a second and a half to start: the tests keep them few."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp.client.client import Client as MCPClient
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

import sagaloop
from sagaloop import App, SagaContext
from sagaloop.engine import history as h
from sagaloop.extras import install_command
from sagaloop.mcp_server import FIXED_NAMES, META_KEY, saga_tools, tool_name
from sagaloop.store.sql import SqlStore
from tests.unit.cli_env import run

HERE = Path(__file__).parent
SAGALOOP = str(Path(sys.executable).with_name("sagaloop"))
APP = "mcp_sagas_app"
TOKEN = "a-token-of-32-characters-at-most"


@dataclass
class Shop:
    store: SqlStore
    env: dict[str, str]
    dev_log: Path

    def runs(self, saga: str) -> list[Any]:
        return self.store.list_runs(saga=saga, limit=1000)

    def stdio(self) -> MCPClient:
        command = [SAGALOOP, "mcp", "--app", APP]
        params = StdioServerParameters(command=command[0], args=command[1:], env=self.env)
        return MCPClient(params)


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    """A database, and `sagaloop dev` running the app on it (starting while the tests go)."""
    tmp = tmp_path_factory.mktemp("mcp")
    url = f"sqlite:///{tmp / 'shop.db'}"
    store = SqlStore(url)
    store.upgrade()
    env = {"SAGALOOP_DATABASE_URL": url, "PYTHONPATH": str(HERE)}
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    log = tmp / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen(
            [SAGALOOP, "dev", "--app", APP, "--poll", "0.05"],
            env={**base, **env},
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        yield Shop(store, env, log)
    finally:
        dev.terminate()
        dev.wait(timeout=30)
        store.close()


# --- helpers ---------------------------------------------------------------------------------


async def call(client: MCPClient, tool: str, args: dict[str, Any], **kw: Any) -> Any:
    result = await client.call_tool(tool, args, **kw)
    assert not result.is_error, result.content
    return result.structured_content


async def refused(client: MCPClient, tool: str, args: dict[str, Any]) -> str:
    result = await client.call_tool(tool, args)
    assert result.is_error, result.structured_content
    [content] = result.content
    text: str = getattr(content, "text", "")
    assert "Traceback" not in text
    return text


async def until(
    check: Callable[[], Awaitable[Any]], what: str, shop: Shop, timeout: float = 20
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = shop.dev_log.read_text(errors="replace")[-2000:]
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tail}")
        await anyio.sleep(0.05)


async def status_when(
    client: MCPClient, run_id: str, shop: Shop, ready: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        status = await call(client, "run_status", {"run_id": run_id})
        return status if ready(status) else None

    result: dict[str, Any] = await until(check, what, shop)
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- tools and schemas -----------------------------------------------------------------------


def test_tools_are_listed_with_schemas_from_the_signatures_and_bad_input_is_refused(
    shop: Shop,
) -> None:
    async def main() -> None:
        async with shop.stdio() as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert sorted(tools) == [
                "approve",
                "billing_greet",
                "deny",
                "list_approvals",
                "refund",
                "run_status",
                "send_event",
                "tick",
            ]

            refund = tools["refund"]
            assert refund.description is not None
            assert refund.description.startswith("Refund an order: a person approves it")
            schema = refund.input_schema
            assert schema["type"] == "object" and schema["required"] == ["order", "amount"]
            assert schema["properties"]["amount"] == {
                "description": "How many cents to refund.",
                "exclusiveMinimum": 0,
                "type": "integer",
            }
            assert schema["properties"]["idempotency_key"]["type"] == "string"
            greet = tools["billing_greet"].input_schema  # a str input is the argument `input`
            assert greet["properties"]["input"] == {"type": "string"}
            assert greet["required"] == ["input"] and greet["additionalProperties"] is False
            tick = tools["tick"].input_schema  # no input: only the optional key
            assert tick["type"] == "object" and set(tick["properties"]) == {"idempotency_key"}
            assert "required" not in tick
            assert tools["run_status"].input_schema["required"] == ["run_id"]

            text = await refused(client, "refund", {"order": "o-0", "amount": "lots"})
            assert "argument 'amount'" in text and "integer" in text, text
            text = await refused(client, "refund", {"amount": 5})
            assert "missing argument 'order'" in text, text
            text = await refused(client, "refund", {"order": "o-0", "amount": -5})
            assert "argument 'amount'" in text and "greater than 0" in text, text
            text = await refused(client, "billing_greet", {"input": 7})
            assert "argument 'input'" in text, text
            text = await refused(client, "tick", {"ticks": 3})
            assert "unexpected argument 'ticks'" in text, text
            text = await refused(
                client, "refund", {"order": "o-0", "amount": 1, "idempotency_key": ""}
            )
            assert "argument 'idempotency_key'" in text, text
            text = await refused(client, "run_status", {"run_id": "no-such-run"})
            assert "no-such-run" in text, text

    anyio.run(main)
    assert not [r for r in shop.runs("refund") if r.input.get("order") == "o-0"]
    assert not shop.runs("billing.greet") and not shop.runs("tick")


def test_tool_names_follow_the_rules_and_never_collide() -> None:
    app = App("names")

    async def body(ctx: SagaContext) -> None:
        return None

    for name in ("approve", "a.b", "a:b", "x" * 80):
        app.saga(name=name)(body)
    names = {t.saga.name: t.name for t in saga_tools(app, FIXED_NAMES)}
    assert names["a.b"] == "a_b"
    assert names["a:b"] == f"a_b_{tool_name('a:b', {'a_b'})[-8:]}" != "a_b"
    assert names["approve"].startswith("approve_") and len(names["approve"]) == 16
    assert names["x" * 80] == "x" * 64
    assert len(set(names.values())) == 4
    assert names == {t.saga.name: t.name for t in saga_tools(app, FIXED_NAMES)}, "stable"


# --- a run started over MCP, answered and resumed ---------------------------------------------


def test_a_refund_started_over_stdio_is_retried_approved_resumed_and_completes(
    shop: Shop,
) -> None:
    request = {"order": "o-1", "amount": 250}

    async def main() -> str:
        async with shop.stdio() as client:
            began = time.monotonic()
            first = await call(client, "refund", request)
            assert time.monotonic() - began < 5, "the start returns at once"
            run_id = first["run_id"]
            assert first["started"] is True and first["status"] == "running"
            assert first["saga"] == "refund" and "run_status" in first["next"]

            again = await call(client, "refund", dict(request))  # the retried call
            assert again["run_id"] == run_id and again["started"] is False
            assert [r.run_id for r in shop.runs("refund") if r.input == request] == [run_id]

            async def pending() -> list[dict[str, Any]]:
                listed = await call(client, "list_approvals", {"run_id": run_id})
                return list(listed["approvals"])

            [approval] = await until(pending, "the approval request", shop)
            assert approval["action"] == "refund" and approval["args"] == request
            answer = await call(
                client, "approve", {"run_id": run_id, "call_id": approval["call_id"]}
            )
            assert answer["answer"] == "approved" and answer["by"].startswith("mcp")

            waiting = await status_when(
                client,
                run_id,
                shop,
                lambda st: st["published"].get("stage") == "waiting for the parcel",
                "the wait for the parcel",
            )
            assert not waiting["finished"] and waiting["asks"] == {
                "parcel_returned": "parcel back?"
            }
            assert any("parcel_returned" in w for w in waiting["waiting_for"]), waiting

            sent = {"run_id": run_id, "name": "parcel_returned", "data": {"tracking": "T1"}}
            assert (await call(client, "send_event", sent))["sent"] is True
            await call(client, "send_event", dict(sent))  # a retried send delivers nothing new

            done = await status_when(
                client, run_id, shop, lambda st: st["finished"], "the run to finish"
            )
            assert done["status"] == "completed", done
            assert done["result"] == {"refunded": True, "refund_id": "rf-o-1-250"}
            assert [x["step"] for x in done["steps"]] == ["pay_back"]
            assert "next" not in done
            return str(run_id)

    run_id = anyio.run(main)
    events = shop.store.load_history(None, run_id)
    arrived = [e for e in events if e.kind == h.EVENT_ARRIVED and e.name == "parcel_returned"]
    assert len(arrived) == 1, "the retried send_event delivered nothing new"


def test_a_start_retried_with_a_key_from_another_session_starts_nothing_new(shop: Shop) -> None:
    request = {"order": "o-9", "amount": 100, "idempotency_key": "ticket-9"}

    async def first_session() -> str:
        async with shop.stdio() as client:
            started = await call(client, "refund", request)
            assert started["started"] is True and started["run_id"].endswith(":key:ticket-9")
            tick = await call(client, "tick", {}, meta={META_KEY: "tick-1"})
            assert tick["run_id"].endswith(":key:tick-1")
            return str(started["run_id"])

    async def second_session(run_id: str) -> None:
        async with shop.stdio() as client:  # as after a lost reply and a reconnection
            again = await call(client, "refund", dict(request))
            assert again == {**again, "run_id": run_id, "started": False}
            tick = await call(client, "tick", {}, meta={META_KEY: "tick-1"})
            assert tick["started"] is False

            other = {**request, "amount": 999}
            text = await refused(client, "refund", other)
            assert "idempotency_key 'ticket-9'" in text and "other input" in text, text

            async def pending() -> list[dict[str, Any]]:
                return list((await call(client, "list_approvals", {}))["approvals"])

            approvals = await until(pending, "the approval request", shop)
            [mine] = [a for a in approvals if a["run_id"] == run_id]
            denial = {"run_id": run_id, "call_id": mine["call_id"], "reason": "already refunded"}
            assert (await call(client, "deny", denial))["answer"] == "denied"
            done = await status_when(
                client, run_id, shop, lambda st: st["finished"], "the denied run to finish"
            )
            assert done["result"] == {"refunded": False, "reason": "already refunded"}
            text = await refused(client, "deny", denial)
            assert "nothing was sent" in text, text

    run_id = anyio.run(first_session)
    anyio.run(second_session, run_id)
    assert [r.run_id for r in shop.runs("refund") if r.input.get("order") == "o-9"] == [run_id]
    assert len(shop.runs("tick")) == 1


# --- streamable HTTP ---------------------------------------------------------------------------


def test_streamable_http_with_a_token_starts_a_run_that_completes(
    shop: Shop, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env = {**base, **shop.env, "SAGALOOP_MCP_TOKEN": TOKEN}
    log = tmp_path / "mcp.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [SAGALOOP, "mcp", "--app", APP, "--http", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def answers() -> bool:
        assert server.poll() is None, log.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return False
        return True

    async def main() -> None:
        await until(lambda: anyio.to_thread.run_sync(answers), "the HTTP server", shop)
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        async with httpx2.AsyncClient() as plain:
            response = await plain.post(url, json=body)
        assert response.status_code == 401

        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with (
            create_mcp_http_client(headers=headers) as http,
            MCPClient(streamable_http_client(url, http_client=http)) as client,
        ):
            started = await call(client, "billing_greet", {"input": "ada"})
            assert started["saga"] == "billing.greet" and started["started"] is True
            done = await status_when(
                client, started["run_id"], shop, lambda st: st["finished"], "the greeting"
            )
            assert done["status"] == "completed" and done["result"] == "hello ada"

    try:
        anyio.run(main)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_http_beyond_the_loopback_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SAGALOOP_MCP_TOKEN", raising=False)
    monkeypatch.syspath_prepend(str(HERE))
    result = run("mcp", "--app", APP, "--http", "--host", "0.0.0.0")
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: refusing to serve MCP on 0.0.0.0 without a token"), line
    assert "SAGALOOP_MCP_TOKEN" in line

    result = run("mcp", "--app", APP, "--http", "--host", "0.0.0.0", "--token", "short")
    assert result.exit_code == 1 and "at least 16" in result.output

    result = run("mcp", "--app", APP, "--port", "9000")
    assert result.exit_code == 2 and "--port go with --http" in result.output


def test_without_the_mcp_package_the_command_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in sys.modules if n == "mcp" or n.startswith("mcp.")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [n for n in sys.modules if n.startswith("sagaloop.mcp_server")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(sagaloop, "mcp_server")
    result = run("mcp", "--app", APP)
    assert result.exit_code == 1
    assert install_command("mcp") in result.output, result.output


def test_importing_sagaloop_and_its_cli_does_not_import_mcp() -> None:
    code = "import sys, sagaloop, sagaloop.cli.main; print('mcp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
