"""``sagaloop mcp``: the app's sagas as MCP tools (the server is :mod:`sagaloop.mcp_server`)."""

from __future__ import annotations

import click

from sagaloop.cli.common import Obj, app_option, errors
from sagaloop.client import Client


@click.command("mcp")
@app_option
@click.option("--http", is_flag=True, help="Serve streamable HTTP instead of stdio.")
@click.option("--host", default="127.0.0.1", show_default=True, help="With --http: the address.")
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="With --http."
)
@click.option("--path", default="/mcp", show_default=True, help="With --http: the endpoint.")
@click.option(
    "--token",
    envvar="SAGALOOP_MCP_TOKEN",
    help="With --http: the bearer token every request must carry (required beyond 127.0.0.1; "
    "prefer $SAGALOOP_MCP_TOKEN, which no process listing shows).",
)
@click.pass_context
def mcp(
    ctx: click.Context,
    app_spec: str | None,
    http: bool,
    host: str,
    port: int,
    path: str,
    token: str | None,
) -> None:
    """Serve the app's sagas to MCP clients: a tool per saga that starts a run and returns its
    id at once, and run_status, send_event, list_approvals, approve and deny. Speaks stdio
    unless --http. Runs execute in the app's engine and workers (`sagaloop dev`) on the same
    database: this server only starts, reads and signals them."""
    if not http:
        given = [
            f"--{name}"
            for name in ("host", "port", "path")
            if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
        ]
        if given:
            raise click.UsageError(f"{', '.join(given)} go with --http")
    obj: Obj = ctx.obj
    try:
        from sagaloop import mcp_server
    except ImportError as e:
        raise click.ClickException(str(e)) from e
    with errors():
        if http:
            mcp_server.check_bind(host, token)
        app = obj.app(app_spec)
        server = mcp_server.SagaMCPServer(Client(obj.store(), app), app, scrub=obj.scrub)
        if http:
            server.run_http(host=host, port=port, path=path, token=token)
        else:
            server.run_stdio()
