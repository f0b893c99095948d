"""Who may reach an HTTP endpoint that sagaloop serves (the MCP server, the web console): the
loopback interface, or, beyond it, only the bearers of a token."""

from __future__ import annotations

import ipaddress

from sagaloop.errors import ValidationError

MIN_TOKEN = 16
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 in brackets or not) is this machine's
    loopback interface."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, *, what: str, env: str, risk: str) -> None:
    """Refuse (ValidationError, one line) to serve ``what`` on ``host`` beyond the loopback
    interface without a token (``risk``: what anyone reaching it could do; ``env``: where the
    token is set), or with a token shorter than MIN_TOKEN characters."""
    if token is not None and len(token) < MIN_TOKEN:
        raise ValidationError(
            f"the {what} token is {len(token)} characters: use at least {MIN_TOKEN} (a random "
            "one: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    if token is None and not is_loopback(host):
        raise ValidationError(
            f"refusing to serve {what} on {host} without a token (anyone reaching it could "
            f"{risk}): set {env}, or listen on 127.0.0.1"
        )
