"""Forking a run (:meth:`Client.fork <sagaloop.client.client.Client.fork>`): a new run whose
history is a copy of another's up to a command position, checked against the saga code as it is
now before anything is written."""

from __future__ import annotations

import itertools
import uuid
from typing import TYPE_CHECKING, Any

from sagaloop import tracing
from sagaloop.client.checks import check_message, check_text
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.fork import fork_history
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.messages import Envelope, derived_id, start_queue
from sagaloop.engine.ports import Outgoing, RunRecord, Store
from sagaloop.engine.replay import check_replay
from sagaloop.engine.state import RunState
from sagaloop.errors import (
    ActivationDeadlineError,
    NonDeterminismError,
    RunStateError,
    ValidationError,
)
from sagaloop.sagas.approvals import OPEN_STATUSES, call_id_of

if TYPE_CHECKING:
    from sagaloop.client.client import Client


def fork_run(client: Client, source: str, at: int, run_id: str | None) -> str:
    """What :meth:`Client.fork <sagaloop.client.client.Client.fork>` does (see there)."""
    if client.app is None:
        raise ValidationError("Client(store, app) needs the App to fork runs")
    old = client.get(source)
    saga = client.app.get_saga(old.saga) if old.app == client.app.name else None
    if saga is None:
        raise RunStateError(
            f"run {source!r} is a run of saga {old.saga!r} of app {old.app!r}, which app "
            f"{client.app.name!r} does not declare: fork it with the app that does"
        )
    if isinstance(at, bool) or not isinstance(at, int):
        raise ValidationError(f"a position is a whole number, not {at!r:.60}")
    kept = fork_history(client.store.load_history(None, source), at, run_id=source)
    new_id = check_text(uuid.uuid4().hex if run_id is None else run_id, "run_id")
    if new_id == source:
        raise RunStateError(f"a fork is a new run: give it another id than {source!r}")
    link = {"run_id": source, "position": at}
    first_pos = kept[0].data.get("first_pos")
    input_json = kept[0].data.get("input")
    now = client.clock.now()
    shift = now - kept[-1].at  # the cut is now: timers issued after it count from now
    with tracing.start(new_id, saga.name) as trace:
        data = {
            "input": input_json,
            "forked_from": link,
            **({"first_pos": first_pos} if first_pos else {}),
            **({"trace": trace} if trace else {}),
            **({"events": accepts} if (accepts := saga.recorded_events()) else {}),
        }
        events = [
            Event(seq, e.kind, e.at + shift, e.pos, e.name, data if seq == 1 else e.data)
            for seq, e in enumerate(kept, start=1)
        ]
        try:  # a fork the code as it is now cannot continue would park at once
            check_replay(client.app, saga, new_id, events, whole=False)
        except (NonDeterminismError, ActivationDeadlineError) as e:
            reason = str(e).removeprefix(f"run {new_id!r}: ")
            raise ValidationError(
                f"cannot fork run {source!r} at position {at}: the saga code does not "
                f"replay what the fork keeps ({reason}); fork at an earlier position"
            ) from e
        env = Envelope(
            type="start",
            message_id=derived_id("start", new_id),
            run_id=new_id,
            saga=saga.name,
            payload={"input": input_json},
            created_at=now,
            trace=trace,
        )
        check_message(env)
        record = RunRecord(new_id, client.app.name, saga.name, s.RUNNING, input_json, now, now)
        # Processed but the last event: the engine's activation replays the copy (the saga's
        # logger silent), gives the code that last event, and records what it does next.
        # The engine expects no command among the events it has not processed: if the last
        # is one, the whole copy is given as new (the saga's log lines said again).
        record.last_seq = len(events)
        record.processed_seq = 0 if events[-1].kind in h.COMMAND_KINDS else len(events) - 1
        with client.store.transaction() as tx:
            if not client.store.create_run(tx, record):
                first = client.store.load_history(tx, new_id)[:1]
                if first and first[0].data.get("forked_from") == link:
                    return new_id  # this very fork, made already
                raise RunStateError(f"run id {new_id!r} is taken: choose another run id")
            after = 0
            for when, group in itertools.groupby(events, key=lambda e: e.at):
                batch = [NewEvent(e.kind, e.pos, e.name, e.data) for e in group]
                after = client.store.append_events(tx, new_id, after, batch, when)[-1].seq
            _index_open_approvals(client.store, tx, record, events, now)
            client.store.enqueue(tx, [Outgoing(start_queue(client.app.name), env)], now)
    return new_id


def _index_open_approvals(
    store: Store, tx: Any, run: RunRecord, events: list[Event], now: Any
) -> None:
    """Index the approvals a fork's copied history leaves open, as the engine indexes
    those it records: the fork's own requests, answered with its own request ids."""
    state = RunState(run.run_id)
    for event in events:
        state.apply(event)
    for key, value in state.published.items():
        call_id = call_id_of(key)
        if call_id and isinstance(value, dict) and value.get("status") in OPEN_STATUSES:
            store.publish_approval(tx, run, call_id, value, now=now)
