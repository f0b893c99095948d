"""An app's sagas served as MCP tools (``sagaloop mcp --app M``), with the ``mcp`` package.

The server is a client of the engine, nothing more: it starts runs, reads them and signals them
through :class:`~sagaloop.Client`, on the database that the app's engine and workers use
(``sagaloop dev``, or ``engine`` and ``worker`` services, whatever their broker: a start is
written to the outbox table). Runs execute there; without them a started run stays ``running``,
"queued for the engine".

Tools
    - one per saga, named after it (letters, digits, ``_`` and ``-``: the saga ``billing.refund``
      is the tool ``billing_refund``; a name another tool holds gets ``_`` and 8 hex of its
      SHA-256). Its description is the saga's docstring; its input schema the JSON Schema of the
      saga's input annotation (pydantic): a model, TypedDict or dataclass gives its fields as the
      arguments, any other type is the argument ``input``, a saga without input takes none. It
      starts a run and returns at once: ``run_id``, ``saga``, ``status``, ``started`` and what
      to call next. Arguments that do not fit are a tool error naming the fields, and write
      nothing.
    - ``run_status``: status, what the run waits for and asks, its published values, its steps,
      and its result or error (from the :class:`~sagaloop.engine.timeline.Timeline` that
      ``sagaloop status`` shows).
    - ``send_event``, ``list_approvals``, ``approve``, ``deny``: as the CLI commands of these
      names.

Idempotent start
    A start tool's run id derives from the request: ``mcp:{app}:{saga}:key:{idempotency_key}``
    when the call names an ``idempotency_key`` (the argument, else the request's
    ``_meta["sagaloop/idempotency_key"]``), else ``mcp:{app}:{saga}:input:{hash}``, the hash of
    the canonical JSON of the validated input. A retried call (the reply was lost, the client
    timed out, the assistant asked again) therefore returns the run already started
    (``started: false``) and starts nothing. The price of the default: the same saga with the
    same input starts once, for as long as the run is kept (finished runs are deleted after
    ``SAGALOOP_RETENTION_DAYS``); to start it again on purpose, pass a new ``idempotency_key``.
    A key used before with another input is refused. JSON-RPC request ids are not used: a
    client gives a retried request a new id. ``send_event`` is safe to retry the same way: its
    ``event_id`` defaults to the hash of the event's name and data.

Transports
    :meth:`SagaMCPServer.run_stdio`, and :meth:`SagaMCPServer.run_http` (streamable HTTP), which
    refuses to listen beyond the loopback interface without a bearer token
    (:func:`check_bind`), and checks the token, when there is one, on every request.

The package: :mod:`~sagaloop.mcp_server.tools` declares the tools (pydantic only),
:mod:`~sagaloop.mcp_server.server` serves them (the only module that imports ``mcp``: ``pip
install sagaloop[mcp]``; ``import sagaloop`` imports neither), :mod:`~sagaloop.mcp_server.http`
guards the HTTP endpoint.
"""

from sagaloop.mcp_server.http import check_bind
from sagaloop.mcp_server.server import SagaMCPServer
from sagaloop.mcp_server.tools import (
    FIXED_NAMES,
    IDEMPOTENCY_KEY,
    META_KEY,
    SagaTool,
    saga_tools,
    tool_name,
)

__all__ = [
    "FIXED_NAMES",
    "IDEMPOTENCY_KEY",
    "META_KEY",
    "SagaMCPServer",
    "SagaTool",
    "check_bind",
    "saga_tools",
    "tool_name",
]
