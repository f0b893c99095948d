"""The MCP server: the tools' calls, through :class:`~sagaloop.Client`, over stdio or streamable
HTTP (``mcp``'s low-level ``Server``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

try:
    import anyio
    import anyio.to_thread
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server
    from mcp.shared.exceptions import MCPError
    from starlette.types import ASGIApp
except ModuleNotFoundError as e:  # pragma: no cover - the extra is missing
    from sagaloop.extras import missing_extra

    raise missing_extra("`sagaloop mcp`", "mcp", e) from e

from sagaloop import Client, __version__
from sagaloop.engine import state as s
from sagaloop.engine.messages import derived_id
from sagaloop.errors import ErrorInfo, RunNotFoundError, SagaloopError, ValidationError
from sagaloop.mcp_server.http import BearerToken, HostCheck, check_bind
from sagaloop.mcp_server.tools import (
    FIXED,
    FIXED_NAMES,
    IDEMPOTENCY_KEY,
    META_KEY,
    ApproveArgs,
    DenyArgs,
    Fixed,
    Key,
    ListApprovalsArgs,
    RunStatusArgs,
    SagaTool,
    SendEventArgs,
    ToolError,
    check,
    saga_tools,
    schema_of,
)
from sagaloop.sagas.app import App
from sagaloop.sagas.approvals import args_hash

logger = logging.getLogger(__name__)


class SagaMCPServer:
    """The MCP server of ``app``'s sagas, on ``client`` (a :class:`~sagaloop.Client` of that
    app on the engine's database). ``scrub`` cleans every error text sent to a client (the CLI
    passes the one that removes configured passwords)."""

    def __init__(
        self, client: Client, app: App, *, scrub: Callable[[str], str] | None = None
    ) -> None:
        if client.app_name != app.name:
            raise ValidationError("SagaMCPServer(client, app) needs Client(store, app)")
        self.client = client.scoped()  # another app's runs are not found
        self.app = app
        self.scrub = scrub or (lambda text: text)
        self.sagas = {t.name: t for t in saga_tools(app, FIXED_NAMES)}
        self.fixed = {f.name: f for f in FIXED}
        self.tools = [*(self._saga_tool(t) for t in self.sagas.values()), *map(_tool, FIXED)]
        self.schemas = {t.name: t.input_schema for t in self.tools}
        self.server: Server[Any] = Server(
            f"sagaloop-{app.name}",
            version=__version__,
            instructions=_instructions(app),
            get_tool_input_schema=self.schemas.get,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )

    # --- transports

    def run_stdio(self) -> None:
        """Serve one client over stdin and stdout until it closes them."""

        async def serve() -> None:
            async with stdio_server() as (read, write):
                options = self.server.create_initialization_options()
                await self.server.run(read, write, options)

        anyio.run(serve)

    def http_app(
        self,
        *,
        path: str = "/mcp",
        host: str = "127.0.0.1",
        port: int = 8000,
        token: str | None = None,
    ) -> ASGIApp:
        """The streamable HTTP endpoint at ``path`` as an ASGI app, served on ``host:port``;
        with ``token``, every request must carry ``Authorization: Bearer <token>``; without,
        every request must name ``host:port`` in its ``Host`` (and ``Origin``, if any): see
        :class:`~sagaloop.mcp_server.http.HostCheck`."""
        if not path.startswith("/"):
            raise ValidationError(f"the MCP endpoint's path must start with '/', not {path!r}")
        app = self.server.streamable_http_app(streamable_http_path=path, host=host)
        if token is None:
            return HostCheck(app, host=host, port=port)
        return BearerToken(app, token)

    def run_http(
        self, *, host: str = "127.0.0.1", port: int = 8000, path: str = "/mcp", token: str | None
    ) -> None:
        """Serve streamable HTTP on ``host:port`` until stopped (Ctrl-C, SIGTERM). Refuses a
        host beyond the loopback interface without a token (:func:`check_bind`)."""
        import uvicorn

        check_bind(host, token)
        app = self.http_app(path=path, host=host, port=port, token=token)
        shown = f"[{host}]" if ":" in host else host
        logger.info(
            "serving the sagas of app %s over MCP at http://%s:%d%s%s",
            self.app.name,
            shown,
            port,
            path,
            " (bearer token required)" if token else "",
        )
        config = uvicorn.Config(app, host=host, port=port, access_log=False, log_level="warning")
        uvicorn.Server(config).run()

    # --- handlers

    def _saga_tool(self, tool: SagaTool) -> types.Tool:
        annotations = types.ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=True
        )
        return types.Tool(
            name=tool.name,
            title=f"Start {tool.saga.name}",
            description=tool.description,
            input_schema=tool.input_schema,
            annotations=annotations,
        )

    async def _list_tools(
        self, ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools)

    async def _call_tool(
        self, ctx: Any, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        name, arguments = params.name, dict(params.arguments or {})
        if name in self.sagas:
            call = partial(self.start, self.sagas[name], arguments, _meta_key(params.meta))
        elif name in self.fixed:
            call = partial(self.answer, name, arguments, _client_name(ctx))
        else:
            raise MCPError(code=types.INVALID_PARAMS, message=f"no tool {name!r}")
        try:
            data = await anyio.to_thread.run_sync(call)
        except (ToolError, SagaloopError) as e:
            text = self.scrub(str(e))
            logger.info("tool %s refused: %s", name, text)
            return types.CallToolResult(content=[_text(text)], is_error=True)
        except Exception as e:  # a bug, or the database gone: logged, and one line to the client
            logger.exception("tool %s failed", name)
            text = self.scrub(f"tool {name!r} failed: {type(e).__name__}: {e}")
            return types.CallToolResult(content=[_text(text)], is_error=True)
        return types.CallToolResult(content=[_text(_json(data))], structured_content=data)

    def start(
        self, tool: SagaTool, arguments: dict[str, Any], meta_key: Any = None
    ) -> dict[str, Any]:
        """Start (or find) the run that the call names; what the tool returns."""
        key = arguments.pop(IDEMPOTENCY_KEY, None)
        key = meta_key if key is None else key
        if key is not None:
            key = check(Key, {IDEMPOTENCY_KEY: key}, tool.name).idempotency_key
        check(tool.arguments, arguments, tool.name)
        saga = tool.saga
        value = tool.input_of(arguments)
        input_json = saga.input.to_json(value, what=f"input of saga {saga.name!r}")
        if key is None:
            run_id = derived_id(
                "mcp", self.app.name, saga.name, "input", args_hash(input_json)[:32]
            )
        else:
            run_id = derived_id("mcp", self.app.name, saga.name, "key", key)
        try:
            existing = self.client.get(run_id)
        except RunNotFoundError:
            existing = None
        if existing is not None and key is not None and existing.input != input_json:
            raise ToolError(
                f"{IDEMPOTENCY_KEY} {key!r} started run {run_id!r} with other input, so nothing "
                "was started: pass a new key to start another run, or read that run with "
                "run_status"
            )
        self.client.start(saga, value, run_id=run_id)
        status = existing.status if existing is not None else self.client.get(run_id).status
        if existing is None:
            logger.info(
                "run %s of saga %s started over MCP", run_id, saga.name, extra={"run_id": run_id}
            )
        return {
            "run_id": run_id,
            "saga": saga.name,
            "status": status,
            "started": existing is None,
            "next": (
                f"call run_status with run_id {run_id!r} to follow it (the app's engine runs it; "
                "a run may wait for days)"
            ),
        }

    def answer(self, name: str, arguments: dict[str, Any], who: str) -> dict[str, Any]:
        """Run the fixed tool ``name``; what it returns."""
        client = self.client
        args = check(self.fixed[name].args, arguments, name)
        if isinstance(args, RunStatusArgs):
            return self.status(args.run_id)
        if isinstance(args, SendEventArgs):
            event_id = args.event_id or "mcp-" + args_hash([args.name, args.data])[:32]
            client.send_event(args.run_id, args.name, args.data, event_id=event_id)
            return {"run_id": args.run_id, "event": args.name, "event_id": event_id, "sent": True}
        if isinstance(args, ListApprovalsArgs):
            page = client.approvals(args.run_id, after=args.after, limit=args.limit)
            more = page[-1].cursor if len(page) == args.limit else None
            return {"approvals": [p.model_dump(mode="json") for p in page], "next": more}
        if isinstance(args, ApproveArgs):
            by = args.by or who
            client.approve(args.run_id, args.call_id, args=args.args, by=by)
            return {"run_id": args.run_id, "call_id": args.call_id, "answer": "approved", "by": by}
        assert isinstance(args, DenyArgs)
        by = args.by or who
        client.deny(args.run_id, args.call_id, reason=args.reason, by=by)
        return {"run_id": args.run_id, "call_id": args.call_id, "answer": "denied", "by": by}

    def status(self, run_id: str) -> dict[str, Any]:
        """What ``run_status`` returns: the run's :class:`Timeline`, for a reader that acts."""
        tl = self.client.status(run_id)
        data = tl.to_json()
        out: dict[str, Any] = {
            "run_id": tl.run_id,
            "saga": tl.saga,
            "status": tl.status,
            "finished": tl.status in s.FINAL_STATUSES,
            "waiting_for": tl.waiting_for,
            "asks": tl.prompts,
            "published": tl.published,
            "steps": [
                {"step": x["step"], "state": x["state"], "attempts": x["attempts"]}
                for x in data["steps"]
            ],
            "created_at": data["created_at"],
            "updated_at": data["updated_at"],
        }
        if tl.status == s.COMPLETED:
            out["result"] = tl.output
        if tl.error:
            out["error"] = ErrorInfo.from_json(tl.error).describe()
        if tl.reason:
            out["reason"] = tl.reason
        if not out["finished"]:
            out["next"] = (
                "call run_status again later; waiting_for says what the run waits for "
                "(send_event delivers an event, approve or deny answers an approval)"
            )
        return out


def _tool(fixed: Fixed) -> types.Tool:
    return types.Tool(
        name=fixed.name,
        description=fixed.description,
        input_schema=schema_of(fixed.args),
        annotations=types.ToolAnnotations(read_only_hint=fixed.read_only),
    )


def _meta_key(meta: Mapping[str, Any] | None) -> Any:
    return None if meta is None else meta.get(META_KEY)


def _client_name(ctx: Any) -> str:
    """``mcp:<the client's name>`` (who answers an approval unless the call says), or
    ``mcp``."""
    params = getattr(getattr(ctx, "session", None), "client_params", None)
    name = getattr(getattr(params, "client_info", None), "name", None)
    meta = getattr(ctx, "meta", None) or {}
    info = meta.get(types.CLIENT_INFO_META_KEY) if isinstance(meta, Mapping) else None
    if name is None and isinstance(info, Mapping):
        name = info.get("name")
    return f"mcp:{name}" if isinstance(name, str) and name else "mcp"


def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, default=str)


def _instructions(app: App) -> str:
    return (
        f"The sagas of the sagaloop app {app.name!r}: durable runs that may take days. Each "
        "start tool starts a run and returns its run_id at once; come back with run_status. "
        "Runs wait for events (send_event) and approvals (list_approvals, approve, deny). "
        "Calling a start tool again with the same arguments returns the same run."
    )
