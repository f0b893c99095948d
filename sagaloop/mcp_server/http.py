"""Who may reach the streamable HTTP endpoint: the loopback interface, or bearers of the token."""

from __future__ import annotations

import hmac
import ipaddress
from typing import TYPE_CHECKING

from sagaloop.errors import ValidationError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

MIN_TOKEN = 16
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse (ValidationError, one line) to listen on ``host`` beyond the loopback interface
    without a bearer token, or with a token shorter than MIN_TOKEN characters: whoever reaches
    the port could start runs and answer approvals."""
    if token is not None and len(token) < MIN_TOKEN:
        raise ValidationError(
            f"the MCP token is {len(token)} characters: use at least {MIN_TOKEN} (a random one: "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    if token is None and not is_loopback(host):
        raise ValidationError(
            f"refusing to serve MCP on {host} without a token (anyone reaching it could start "
            "runs and answer approvals): set SAGALOOP_MCP_TOKEN, or listen on 127.0.0.1"
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
