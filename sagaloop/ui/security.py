"""Who may reach the console, and which requests may change anything.

- **Where it listens.** 127.0.0.1 unless ``--host`` names another address, which needs a token
  (:func:`check_bind`): whoever reaches the port could answer approvals and cancel runs.
- **Who is let in.** Without a token, only requests whose ``Host`` is a loopback name or
  address (a web page whose domain resolves to 127.0.0.1, DNS rebinding, gets 400). With a
  token, every request carries it: ``Authorization: Bearer <token>``, or the session cookie
  that ``?token=<token>`` on any page sets (then the address is shown again without it).
- **What may change anything.** Only ``POST`` requests; each must come from the console's own
  pages: refused when the browser says it comes from another site (``Origin`` other than the
  ``Host``, ``Sec-Fetch-Site`` other than ``same-origin``) and unless its form holds the
  console's CSRF token, which only its own pages carry.
- Every response forbids framing, sniffing, caching and scripts from elsewhere
  (Content-Security-Policy ``script-src 'self'``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from http.cookies import SimpleCookie
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit

from sagaloop import _serving
from sagaloop._serving import is_loopback

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "sagaloop_ui"
HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


def check_bind(host: str, token: str | None) -> None:
    """Refuse (ValidationError, one line) to serve the console on ``host`` beyond the loopback
    interface without a token, or with a short one."""
    _serving.check_bind(
        host,
        token,
        what="the console",
        env="SAGALOOP_UI_TOKEN",
        risk="answer approvals and cancel runs",
    )


def new_csrf() -> str:
    """A CSRF token for the console's forms: made per process, known only to its pages."""
    return secrets.token_urlsafe(32)


def csrf_ok(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def _host_name(host_header: str) -> str:
    """The name or address of a ``Host`` header, without its port."""
    return urlsplit(f"//{host_header}").hostname or ""


class Guard:
    """ASGI middleware: the host check (no token), the token check (a token), the refusal of
    cross-site POSTs, and the security headers of every response. The CSRF token of forms is
    checked by the handlers (:func:`csrf_ok`), which read the form."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token
        self.session = (
            hmac.new(token.encode(), b"sagaloop ui session", hashlib.sha256).hexdigest()
            if token is not None
            else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *HEADERS]}
            await send(message)

        if refusal is None:
            await self.app(scope, receive, send_secured)
        else:
            await _respond(send_secured, *refusal)

    def _refusal(
        self, scope: Scope, headers: dict[str, str]
    ) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        """None to let the request in, else (status, text, extra headers) of the answer."""
        host = headers.get("host", "")
        if self.token is None and not is_loopback(_host_name(host)):
            return (
                400,
                (
                    f"This console serves its loopback address only, not {host!r}: open it as "
                    "http://127.0.0.1:PORT/ (or give it a token to serve other addresses)."
                ),
                [],
            )
        if self.token is not None:
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            given = query.pop("token", None)
            if given is not None and scope["method"] == "GET":
                if not hmac.compare_digest(given.encode(), self.token.encode()):
                    return 401, "Wrong token.", []
                assert self.session is not None
                path = scope.get("path", "/") + (f"?{urlencode(query)}" if query else "")
                cookie = f"{COOKIE}={self.session}; HttpOnly; SameSite=Strict; Path=/"
                return (
                    303,
                    "Signed in.",
                    [
                        (b"location", path.encode()),
                        (b"set-cookie", cookie.encode()),
                    ],
                )
            if not self._authorized(headers):
                return (
                    401,
                    (
                        "This console needs its token: open it once as "
                        "http://HOST:PORT/?token=TOKEN (the value of SAGALOOP_UI_TOKEN), or send "
                        "Authorization: Bearer TOKEN."
                    ),
                    [(b"www-authenticate", b"Bearer")],
                )
        if scope["method"] not in ("GET", "HEAD"):
            site = headers.get("sec-fetch-site")
            origin = headers.get("origin")
            if site is not None and site != "same-origin":
                return 403, f"Refused: a request from another site ({site}).", []
            if origin is not None and urlsplit(origin).netloc != host:
                return 403, "Refused: a request from another origin.", []
        return None

    def _authorized(self, headers: dict[str, str]) -> bool:
        assert self.token is not None and self.session is not None
        bearer = headers.get("authorization", "")
        if hmac.compare_digest(bearer.encode(), f"Bearer {self.token}".encode()):
            return True
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(headers.get("cookie", ""))
        except Exception:  # a cookie header this parser refuses: no session
            return False
        morsel = jar.get(COOKIE)
        return morsel is not None and hmac.compare_digest(
            morsel.value.encode(), self.session.encode()
        )


async def _respond(send: Send, status: int, text: str, headers: list[tuple[bytes, bytes]]) -> None:
    body = text.encode()
    start_headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})
