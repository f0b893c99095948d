"""The web console (the ``ui`` extra; ``sagaloop ui``): the runs with filters and
counts, each run's timeline (steps, attempts, errors with tracebacks, waits and what they ask,
published values, compensations), an agent run's transcript, pending approvals with approve
and deny, send event, cancel and retry, and the dead letters; pages update while runs move.

It renders what :class:`~sagaloop.Client` reads and does what it does: a leaf beside the CLI,
imported by nothing in the core. :mod:`~sagaloop.ui.app` builds the Starlette app (Jinja2
templates, htmx from ``static/``), :mod:`~sagaloop.ui.views` what the pages show,
:mod:`~sagaloop.ui.transcript` the transcripts, :mod:`~sagaloop.ui.security` who may reach it
and which requests may change anything, :mod:`~sagaloop.ui.server` serves it with uvicorn.
"""

from __future__ import annotations

try:
    import jinja2  # noqa: F401
    import starlette  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - the extra is missing
    from sagaloop.extras import missing_extra

    raise missing_extra("the console", "ui", e) from e

from sagaloop.ui.app import create_app
from sagaloop.ui.security import check_bind

__all__ = ["check_bind", "create_app"]
