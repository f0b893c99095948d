"""Who may reach the streamable HTTP endpoint: the loopback interface, or bearers of the token."""

from __future__ import annotations

import hmac
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
