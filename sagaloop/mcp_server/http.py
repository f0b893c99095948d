"""Who may reach the streamable HTTP endpoint: the loopback interface, or bearers of the token.

Without a token, the loopback interface is not enough: a web page whose domain resolves to the
bound loopback address (DNS rebinding) reaches it from the browser. :class:`HostCheck` refuses
every request whose ``Host`` is not the bound address and port (or ``localhost`` and the port)
with 421, and one whose ``Origin`` is another's with 403, before anything else runs: on every
loopback address, where the mcp package checks only 127.0.0.1, localhost and ::1."""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING

from sagaloop import _serving

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send


def check_bind(host: str, token: str | None) -> None:
    """Refuse (ValidationError, one line) to listen on ``host`` beyond the loopback interface
    without a bearer token, or with a short one: whoever reaches the port could start runs and
    answer approvals."""
    _serving.check_bind(
        host,
        token,
        what="MCP",
        env="SAGALOOP_MCP_TOKEN",
        risk="start runs and answer approvals",
    )


class BearerToken:
    """ASGI middleware: an HTTP request without ``Authorization: Bearer <token>`` gets 401."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = b'{"error": "send the token: Authorization: Bearer <SAGALOOP_MCP_TOKEN>"}'
                headers = [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class HostCheck:
    """ASGI middleware of an endpoint without a token, bound to ``host`` and ``port``: an HTTP
    request is let in only when its ``Host`` names the bound address and port (``localhost``
    and the port too, for a loopback address), and its ``Origin``, when it has one, is the
    ``http://`` of such a host. Else 421 (the host) or 403 (the origin), and nothing runs."""

    def __init__(self, app: ASGIApp, *, host: str, port: int) -> None:
        self.app = app
        bound = host.strip("[]").lower()
        names = {bound}
        if _serving.is_loopback(bound):
            names.add("localhost")
        if bound == "localhost":  # it binds the loopback addresses that localhost names
            names.update({"127.0.0.1", "::1"})
        shown = {f"[{n}]" if ":" in n else n for n in names}
        self.hosts = {f"{n}:{port}" for n in shown} | (shown if port == 80 else set())
        self.origins = {f"http://{h}" for h in self.hosts}

    def refusal(self, host: str | None, origin: str | None) -> tuple[int, str] | None:
        """None to let a request with these headers in, else its (status, error)."""
        if host is None or host.lower() not in self.hosts:
            return 421, f"this server answers only requests to {' or '.join(sorted(self.hosts))}"
        if origin is not None and origin.lower() not in self.origins:
            return 403, "refused: a request from another origin"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.lower(): v for k, v in scope["headers"]}
            host = headers.get(b"host")
            origin = headers.get(b"origin")
            refusal = self.refusal(
                None if host is None else host.decode("latin-1"),
                None if origin is None else origin.decode("latin-1"),
            )
            if refusal is not None:
                status, error = refusal
                body = json.dumps({"error": error}).encode()
                start = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send({"type": "http.response.start", "status": status, "headers": start})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
