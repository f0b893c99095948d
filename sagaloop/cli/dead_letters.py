"""``sagaloop dead-letters``: list, show, resend and purge the broker's dead letters."""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from sagaloop.brokers.dead_letters import DeadLetter, DeadLetters, resend_one
from sagaloop.cli.common import Obj, errors
from sagaloop.cli.render import printable, text_table

REASON_WIDTH = 60
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


@click.group("dead-letters")
def dead_letters() -> None:
    """List, show, resend and purge the dead letters of the configured broker: RabbitMQ's
    queue <namespace>.dead, or the database broker's table."""


@contextmanager
def _broker(obj: Obj) -> Iterator[DeadLetters]:
    if obj.settings.broker_url == "memory":
        raise click.ClickException(
            "the memory broker keeps its dead letters inside the process that made them: "
            "set SAGALOOP_BROKER_URL to database, amqp://... or redis://..."
        )
    with errors():
        store = obj.store()
        try:
            broker = obj.broker(store, connect_timeout=5)
            try:
                if not isinstance(broker, DeadLetters):
                    raise click.ClickException(
                        f"the broker {type(broker).__name__} cannot manage dead letters"
                    )
                yield broker
            finally:
                broker.close()
        finally:
            store.close()


def _unknown(id: str) -> click.ClickException:
    return click.ClickException(
        f"no dead letter with id {id!r}: `sagaloop dead-letters list` shows their ids"
    )


def _one_line(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _when(letter: DeadLetter) -> str:
    return letter.at.strftime("%Y-%m-%d %H:%M:%S") if letter.at else "-"


def _check_target(id: str | None, all_: bool) -> None:
    if (id is None) == (not all_):
        raise click.UsageError("name one dead letter by its ID, or give --all")


@dead_letters.command("list")
@click.option(
    "--limit", default=100, type=click.IntRange(1, 10_000), show_default=True, help="At most."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def list_(obj: Obj, limit: int, as_json: bool) -> None:
    """List dead letters, oldest first: id, queue, message type, run, size, time, reason."""
    with _broker(obj) as broker:
        letters = broker.list_dead_letters(limit)
        total = max(broker.count_dead_letters(), len(letters))
    if as_json:
        click.echo(
            json.dumps({"dead_letters": [d.to_json() for d in letters], "total": total}, indent=2)
        )
        return
    if not letters:
        click.echo("no dead letters")
        return
    rows = [
        [
            d.id,
            d.queue or "?",
            d.message_type or "-",
            _one_line(d.run_id or "-", 40),
            str(d.size),
            _when(d),
            _one_line(d.reason, REASON_WIDTH),
        ]
        for d in letters
    ]
    headers = ["id", "queue", "type", "run", "bytes", "dead-lettered (UTC)", "reason"]
    click.echo(text_table(headers, rows))
    shown = f"{len(letters)} shown of {total}" if total > len(letters) else str(total)
    click.echo(f"\n{shown} dead letter{'s' if total != 1 else ''}")


@dead_letters.command()
@click.argument("id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def show(obj: Obj, id: str, as_json: bool) -> None:
    """Show one dead letter: where it came from, why, and its envelope."""
    with _broker(obj) as broker:
        letter = broker.find_dead_letter(id)
    if letter is None:
        raise _unknown(id)
    if as_json:
        click.echo(json.dumps(letter.to_json(body=True), indent=2))
        return
    fields = [
        ("id", letter.id),
        ("queue", letter.queue or "?"),
        ("reason", letter.reason),
        ("dead-lettered", f"{_when(letter)} UTC" if letter.at else "-"),
        ("type", letter.message_type or "-"),
        ("message id", letter.message_id or "-"),
        ("run", letter.run_id or "-"),
        ("size", f"{letter.size} bytes"),
        ("content type", letter.content_type or "-"),
    ]
    for name, value in fields:
        click.echo(f"{name:<14} {printable(value)}")
    click.echo("")
    if letter.document is None:
        click.echo(printable(letter.body.decode("utf-8", "backslashreplace"), newlines=True))
    else:
        document = json.dumps(letter.document, indent=2, ensure_ascii=False)
        click.echo(printable(document, newlines=True))


def _one_or_all(verb: str) -> Callable[[F], F]:
    """The ``ID`` argument and the ``--all`` and ``--yes`` options of a command that acts on
    one dead letter or on all (``verb``: what it does to them, for ``--all``'s help)."""

    def apply(command: F) -> F:
        command = click.option(
            "--yes", is_flag=True, help="Do not ask for confirmation (with --all)."
        )(command)
        command = click.option("--all", "all_", is_flag=True, help=f"{verb} every dead letter.")(
            command
        )
        return click.argument("id", required=False)(command)

    return apply


@dead_letters.command()
@_one_or_all("Resend")
@click.pass_obj
def resend(obj: Obj, id: str | None, all_: bool, yes: bool) -> None:
    """Publish a dead letter (or all) again to the queue it came from, unchanged (same message
    id: a consumer that processed it already skips it), then remove it from the dead letters."""
    if id is not None and not all_:
        with _broker(obj) as broker:  # its errors() reports UnknownDeadLetter
            letter = resend_one(broker, id)
        click.echo(f"resent {letter.id} to {letter.queue}")
        return
    question = "Resend all {} dead letters to their queues?"
    resent = _apply(obj, id, all_, yes, question, lambda b, ids: b.resend_dead_letters(ids))
    if resent is None:
        return
    queues = collections.Counter(d.queue for d in resent)
    where = ", ".join(f"{q}: {n}" for q, n in sorted(queues.items()))
    click.echo(f"resent {len(resent)} dead letter{'s' if len(resent) != 1 else ''} ({where})")


@dead_letters.command()
@_one_or_all("Purge")
@click.pass_obj
def purge(obj: Obj, id: str | None, all_: bool, yes: bool) -> None:
    """Delete a dead letter (or all) for good."""
    question = "Delete all {} dead letters for good?"
    purged = _apply(obj, id, all_, yes, question, lambda b, ids: b.purge_dead_letters(ids))
    if purged is None:
        return
    if id is not None:
        click.echo(f"purged {id}")
        return
    click.echo(f"purged {purged} dead letter{'s' if purged != 1 else ''}")


def _apply(
    obj: Obj,
    id: str | None,
    all_: bool,
    yes: bool,
    question: str,
    act: Callable[[DeadLetters, list[str] | None], T],
) -> T | None:
    """``act(broker, [id])`` on dead letter ``id`` (which must exist), or ``act(broker, None)``
    on all of them (``--all``) once there are some and the user agreed to ``question``; None:
    nothing was done."""
    _check_target(id, all_)
    with _broker(obj) as broker:
        if id is None:
            return act(broker, None) if _confirm_all(broker, yes, question) else None
        done = act(broker, [id])
        if not done:
            raise _unknown(id)
        return done


def _confirm_all(broker: DeadLetters, yes: bool, question: str) -> bool:
    """Whether to go on with ``--all``: there are dead letters, and the user agreed (asked
    ``question`` with their number, unless ``--yes``)."""
    total = broker.count_dead_letters()
    if not total:
        click.echo("no dead letters")
        return False
    if not yes:
        click.confirm(question.format(total), abort=True)
    return True
