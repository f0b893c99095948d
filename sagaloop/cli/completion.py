"""``sagaloop complete-step``: complete or fail, by its task token, a step attempt that its
body handed to an outside system (``ctx.complete_async()``)."""

from __future__ import annotations

import click

from sagaloop.cli.common import Obj, errors, json_arg
from sagaloop.cli.render import printable
from sagaloop.client import Client


@click.command("complete-step")
@click.argument("token")
@click.option("--result", help="The step's result, as JSON ('@path': read from a file).")
@click.option("--fail", "fail", metavar="MESSAGE", help="Fail the attempt with this message.")
@click.option(
    "--non-retryable", is_flag=True, help="With --fail: no retry, the step fails for good."
)
@click.pass_obj
def complete_step(
    obj: Obj, token: str, result: str | None, fail: str | None, non_retryable: bool
) -> None:
    """Complete the step attempt TOKEN names (its ctx.task_token) with --result, or fail it
    with --fail (the step's retry policy applies). Refused when the attempt no longer waits
    to be completed from outside (completed already, timed out, its run ended)."""
    if fail is not None and result is not None:
        raise click.UsageError("give --result or --fail, not both")
    if non_retryable and fail is None:
        raise click.UsageError("--non-retryable goes with --fail")
    with errors():
        client = Client(obj.store())
        if fail is not None:
            client.fail_step(token, fail, non_retryable=non_retryable)
            click.echo(printable("step attempt failed: the engine records it"))
            return
        client.complete_step(token, json_arg(result, "--result"))
    click.echo(printable("step attempt completed: the engine records it"))
