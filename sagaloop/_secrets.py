"""Masking secrets: the one place that hides passwords from logs, errors and command output.

Every message that quotes a URL or a driver's error text goes through :func:`mask_url` or
:func:`scrub`. Drivers parse a URL whose password holds ``/``, ``#``, ``?``, ``@`` or ``:``
their own way and may quote a piece of the password (pika: ``Port could not be cast to integer
value as 'MqS3cr'``), so a text derived from a URL is scrubbed of that URL's password *and of
every piece of it*, not only of the ``user:password@`` part that a pattern can find.

Standard library only: the store, the brokers and the command line all import it.
"""

from __future__ import annotations

import re
import urllib.parse

MASK = "***"
MIN_FRAGMENT = 3
"""Pieces of a known password shorter than this are not masked on their own: they give away
little, and masking every ``a`` or ``1`` of a message would make it unreadable."""

_SEPARATORS = re.compile(r"[/#?:@%&=;\s]+")
"""Where a URL parser may cut a password that was not percent-encoded."""
_URL_USERINFO = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s'\"]*:)\S*@")
"""``scheme://user:`` and everything up to the last ``@`` of the same word: a password may hold
``/``, ``#``, ``?``, ``@`` and ``:``, so the password ends at the last ``@``, not the first."""
_URL_LIST = re.compile(r"\s*[,;]\s*(?=[a-zA-Z][a-zA-Z0-9+.-]*://)")
"""Between the URLs of a list (``amqp://...,amqp://...``, the nodes of a cluster): a comma or
semicolon followed by the next URL's scheme, so a password holding ``,`` or ``;`` is not cut."""
_QUOTED = re.compile(r"(?P<q>['\"])(?P<piece>[^'\"\s]{1,200})(?P=q)")
"""A quoted word of a driver's error (``as 'Qz'``): masked whole when it is a piece of a known
password, however short, since a driver quotes exactly the piece of a URL it could not parse."""
_PASSWORD_NAME = r"(?:[a-z_]*password|passwd|pwd)"
"""The names of a parameter that holds a password: ``password``, libpq's ``sslpassword``,
``passwd``, ``pwd`` (any case)."""
_QUERY_PASSWORD = re.compile(
    rf"(?P<head>[?&;]{_PASSWORD_NAME}=)(?P<value>[^&#\s'\",]*)", re.IGNORECASE
)
_CONNINFO_PASSWORD = re.compile(
    rf"(?P<head>(?<![?&;])\b{_PASSWORD_NAME}\s*=\s*)(?:'(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE
)


def password_of(url: str | None) -> str | None:
    """The password in ``url``'s ``user:password@`` part, as written (percent-encoded or not),
    or None. The password runs to the *last* ``@`` of the URL, so one holding ``/``, ``#``,
    ``?``, ``@`` or ``:`` is found whole."""
    if not url:
        return None
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme or "@" not in rest:
        return None
    userinfo = rest[: rest.rfind("@")]
    _user, colon, password = userinfo.partition(":")
    return password if colon and password else None


def split_urls(text: str) -> list[str]:
    """The URLs of a list, in order (one for a single URL); empty for blank ``text``."""
    return [u for u in _URL_LIST.split(text.strip()) if u]


def passwords_of(url: str | None) -> list[str]:
    """The passwords of each URL of ``url`` (a single URL or a list, see :func:`split_urls`):
    of its ``user:password@`` part and of its password parameters (``?password=``...)."""
    found: list[str] = []
    for one in split_urls(url or ""):
        found += [p for p in (password_of(one),) if p is not None]
        found += [m.group("value") for m in _QUERY_PASSWORD.finditer(one) if m.group("value")]
    return found


def mask_url(url: object) -> str:
    """``url`` fit for logs and errors: the password of its ``user:password@`` part (however it
    is written) and of its password parameters (``password=``, ``sslpassword=``...) replaced
    by ``***``. Takes a string or a
    SQLAlchemy URL (whose ``str`` would hide the password but not a ``password=`` parameter),
    or a list of URLs (:func:`split_urls`), each masked on its own."""
    render = getattr(url, "render_as_string", None)
    text = render(hide_password=False) if callable(render) else str(url)
    urls = split_urls(text)
    if len(urls) > 1:  # the nodes of a cluster: each masked, the hosts kept
        return ",".join(mask_url(u) for u in urls)
    password, known = password_of(text), passwords_of(text)
    if password is not None:
        scheme, _, rest = text.partition("://")
        at = rest.rfind("@")
        user = rest[:at].partition(":")[0]
        text = f"{scheme}://{user}:{MASK}@{rest[at + 1 :]}"
    return scrub(text, *known)


def scrub(text: str, *passwords: str | None) -> str:
    """``text`` fit for logs and errors: the password of every URL in it, every ``password=``
    value, and each known password of ``passwords`` masked, the latter also percent-decoded and
    cut into the pieces a parser may have quoted (split at ``/ # ? : @ %``), and a quoted word
    that is any piece of one, however short."""
    wholes = _wholes(passwords)
    if wholes:  # a driver quotes the piece it choked on, however short ('Qz', '%41')

        def quoted(found: re.Match[str]) -> str:
            piece = found.group("piece")
            secret = any(piece in whole for whole in wholes)
            return f"{found.group('q')}{MASK}{found.group('q')}" if secret else found.group()

        text = _QUOTED.sub(quoted, text)
    for secret in _known(passwords):
        text = text.replace(secret, MASK)
    text = _URL_USERINFO.sub(rf"\g<head>{MASK}@", text)
    text = _QUERY_PASSWORD.sub(rf"\g<head>{MASK}", text)
    return _CONNINFO_PASSWORD.sub(rf"\g<head>{MASK}", text)


def _wholes(passwords: tuple[str | None, ...]) -> list[str]:
    """Each password as written, percent-decoded and percent-encoded."""
    return [
        form
        for password in passwords
        if password
        for form in (
            password,
            urllib.parse.unquote(password),
            urllib.parse.quote(password, safe=""),
        )
    ]


def _known(passwords: tuple[str | None, ...]) -> list[str]:
    """Every form of the passwords worth masking, longest first (so a whole password is masked
    before its pieces)."""
    forms: set[str] = set()
    for password in passwords:
        if not password:
            continue
        whole = {password, urllib.parse.unquote(password), urllib.parse.quote(password, safe="")}
        forms.update(whole)
        for form in whole:
            forms.update(_SEPARATORS.split(form))
    return sorted((f for f in forms if len(f) >= MIN_FRAGMENT), key=len, reverse=True)
