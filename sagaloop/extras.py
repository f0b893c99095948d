"""The command that installs one of sagaloop's extras (``ui``, ``metrics``, ``mcp``, ``redis``,
``pydantic-ai``...) into *this* installation, for the error a missing extra raises.

sagaloop is not on a package index yet, so ``pip install 'sagaloop[ui]'`` finds nothing; the
command is derived from where the running copy comes from, so that it works as written:

- a checkout (the package's folder sits beside a ``pyproject.toml``: an editable install, or
  the checkout on ``PYTHONPATH``): ``pip install -e '<checkout>[ui]'``;
- a wheel, an sdist or a git URL (pip's record of it, PEP 610's ``direct_url.json``): the same
  file or commit with the extra, ``pip install 'sagaloop[ui] @ file:///.../sagaloop-...whl'``;
- a folder installed without ``-e``: ``pip install '<folder>[ui]'``;
- an index (no such record): ``pip install 'sagaloop[ui]'``.

Nothing here runs at import; :func:`install_command` reads the metadata when an error needs it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["command_for", "install_command", "missing_extra"]

DISTRIBUTION = "sagaloop"


def command_for(extra: str, *, checkout: Path | None, direct_url: dict[str, Any] | None) -> str:
    """The pip command installing ``extra`` for a copy found in ``checkout`` (a source tree, or
    None) and installed as ``direct_url`` says (the parsed ``direct_url.json``, or None)."""
    if checkout is not None:
        return f"pip install -e {shlex.quote(f'{checkout}[{extra}]')}"
    if direct_url is None:
        return f"pip install {shlex.quote(f'{DISTRIBUTION}[{extra}]')}"
    url = str(direct_url.get("url", ""))
    if "dir_info" in direct_url:
        folder = unquote(urlparse(url).path) if url.startswith("file:") else url
        editable = "-e " if direct_url["dir_info"].get("editable") else ""
        return f"pip install {editable}{shlex.quote(f'{folder}[{extra}]')}"
    vcs = direct_url.get("vcs_info")
    if vcs is not None:
        url = f"{vcs.get('vcs', 'git')}+{url}@{vcs.get('commit_id', '')}".rstrip("@")
        if direct_url.get("subdirectory"):
            url += f"#subdirectory={direct_url['subdirectory']}"
    return f"pip install {shlex.quote(f'{DISTRIBUTION}[{extra}] @ {url}')}"


def _checkout() -> Path | None:
    """The source tree the running package lives in, if it lives in one."""
    root = Path(__file__).resolve().parent.parent
    try:
        pyproject = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    return root if f'name = "{DISTRIBUTION}"' in pyproject else None


def _direct_url() -> dict[str, Any] | None:
    """pip's record of where the installed distribution came from (None: an index, or not
    installed)."""
    from importlib import metadata

    try:
        text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def install_command(extra: str) -> str:
    """The pip command that installs the extra ``extra`` for the running copy of sagaloop."""
    checkout = _checkout()
    return command_for(extra, checkout=checkout, direct_url=None if checkout else _direct_url())


def missing_extra(what: str, extra: str, error: ImportError) -> ImportError:
    """The error to raise (``from error``) when ``what`` needs the extra ``extra`` and the
    module ``error.name`` is not installed: it names the command that installs it."""
    return ImportError(
        f"{what} needs {error.name} (not installed), from sagaloop's {extra!r} extra: "
        f"{install_command(extra)}"
    )
