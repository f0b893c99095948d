"""``sagaloop approvals``, ``approve`` and ``deny``: the approvals runs wait for
(``await ctx.approval(...)``), and their answers."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

import click

from sagaloop.cli.common import Obj, errors, json_arg
from sagaloop.cli.render import printable, short_json, text_table

if TYPE_CHECKING:  # imported where used: the client loads the store, not for --help
    from sagaloop.client import Client
    from sagaloop.sagas.approvals import PendingApproval


def approvals_text(pending: list[PendingApproval]) -> str:
    if not pending:
        return "no approval is pending"
    rows = [
        [
            p.run_id,
            p.call_id,
            p.action,
            short_json(p.args, 40),
            p.args_hash[:12],
            f"{p.deadline:%Y-%m-%d %H:%M:%S}" if p.deadline and p.status == "pending" else "-",
            p.status,
        ]
        for p in pending
    ]
    headers = ["run", "call", "action", "args", "hash", "deadline (UTC)", "status"]
    hint = "answer with: sagaloop approve RUN CALL [--args JSON] | sagaloop deny RUN CALL --reason"
    return f"{text_table(headers, rows)}\n\n{hint}"


@click.command("approvals")
@click.option("--run", "run_id", help="Only the approvals of this run.")
@click.option(
    "--limit", type=click.IntRange(1, 1000), default=50, show_default=True, help="A page's size."
)
@click.option("--after", help="The page after this cursor (the last line's, or its `cursor`).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def approvals(obj: Obj, run_id: str | None, limit: int, after: str | None, as_json: bool) -> None:
    """List the approvals that runs wait for (pending or escalated), oldest first, a page at
    a time. Each one's request_id is what an answer sent by other means must name."""
    with errors():
        pending = _client(obj).approvals(run_id, after=after, limit=limit)
    if as_json:
        click.echo(json.dumps([p.model_dump(mode="json") for p in pending], indent=2))
        return
    click.echo(approvals_text(pending))
    if len(pending) == limit:
        click.echo(
            printable(f"next page: sagaloop approvals --after {shlex.quote(pending[-1].cursor)}")
        )


@click.command()
@click.argument("run_id")
@click.argument("call_id")
@click.option("--args", "args_json", help="Approve these arguments (JSON) instead of those asked.")
@click.option("--by", help="Who approves (recorded with the answer).")
@click.pass_obj
def approve(obj: Obj, run_id: str, call_id: str, args_json: str | None, by: str | None) -> None:
    """Approve the approval CALL_ID that the run RUN_ID waits for."""
    args = json_arg(args_json, "--args")
    if args_json is not None and args is None:
        raise click.BadParameter(
            "null is not an edit: leave --args out to approve the arguments as asked",
            param_hint="--args",
        )
    with errors():
        _client(obj).approve(run_id, call_id, args=args, by=by)
    edited = " with edited arguments" if args is not None else ""
    click.echo(printable(f"approved{edited}: run {run_id}, call {call_id}"))


@click.command()
@click.argument("run_id")
@click.argument("call_id")
@click.option("--reason", required=True, help="Why (the run receives it).")
@click.option("--by", help="Who denies (recorded with the answer).")
@click.pass_obj
def deny(obj: Obj, run_id: str, call_id: str, reason: str, by: str | None) -> None:
    """Deny the approval CALL_ID that the run RUN_ID waits for."""
    with errors():
        _client(obj).deny(run_id, call_id, reason=reason, by=by)
    click.echo(printable(f"denied: run {run_id}, call {call_id}"))


def _client(obj: Obj) -> Client:
    from sagaloop.client import Client  # SQLAlchemy: loaded when a command runs

    return Client(obj.store())
