"""The client: start runs, send events, cancel, retry, and read status. It needs no saga code
(pass a declared saga instead of its name to have the input validated before anything is
written)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.messages import MAX_MESSAGE_BYTES, Envelope, derived_id, engine_queue
from sagaloop.engine.ports import Clock, Outgoing, RunRecord, Store, SystemClock
from sagaloop.engine.timeline import Timeline, timeline
from sagaloop.errors import ErrorInfo as _ErrorInfo
from sagaloop.errors import (
    RunFinishedError,
    RunNotFoundError,
    RunStateError,
    SagaFailedError,
    ValidationError,
)
from sagaloop.sagas.app import App, SagaDef


def _json(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValidationError(f"{what} is not JSON-compatible: {e}") from e


def _check_size(env: Envelope) -> None:
    """Refuse, before anything is written, a message that consumers would dead-letter."""
    size = len(env.to_bytes())
    if size > MAX_MESSAGE_BYTES:
        raise ValidationError(
            f"the {env.type} message of run {env.run_id!r} would be {size} bytes, over the "
            f"limit of {MAX_MESSAGE_BYTES}: keep large payloads out of messages (store them "
            "and pass a reference)"
        )


class Client:
    def __init__(
        self, store: Store, app: App | str | None = None, *, clock: Clock | None = None
    ) -> None:
        """``app`` (an App, or just its name) is needed to start runs; events, cancellation
        and retries go to the engine of the app that each run belongs to."""
        self.store = store
        self.app = app if isinstance(app, App) else None
        self.app_name = app.name if isinstance(app, App) else app
        self.clock = clock or SystemClock()

    def start(
        self, saga: SagaDef[Any, Any] | str, input: Any = None, *, run_id: str | None = None
    ) -> str:
        """Start a run and return its id. Idempotent per ``run_id``: starting an existing run
        id returns it without starting another."""
        if isinstance(saga, str):
            definition = self.app.get_saga(saga) if self.app is not None else None
            if self.app is not None and definition is None:
                from sagaloop.errors import UnknownSagaError

                raise UnknownSagaError(saga, list(self.app.sagas))
        else:
            definition = saga
        name = definition.name if definition is not None else str(saga)
        if not self.app_name:
            raise ValidationError("Client(store, app) needs the app to start runs")
        if definition is not None:
            input_json = definition.input.to_json(input, what=f"input of saga {name!r}")
        else:
            input_json = _json(input, f"input of saga {name!r}")
        run_id = run_id or uuid.uuid4().hex
        if not run_id or len(run_id) > 200 or "\x00" in run_id:
            raise ValidationError("run_id must be 1 to 200 characters, without NUL")
        now = self.clock.now()
        env = Envelope(
            type="start",
            message_id=derived_id("start", run_id),
            run_id=run_id,
            saga=name,
            payload={"input": input_json},
            created_at=now,
        )
        _check_size(env)
        with self.store.transaction() as tx:
            record = RunRecord(run_id, self.app_name, name, s.RUNNING, input_json, now, now, 1)
            if not self.store.create_run(tx, record):
                existing = self.store.lock_run(tx, run_id)
                if existing is not None and existing.saga != name:
                    raise RunStateError(
                        f"run {run_id!r} already exists as a run of saga {existing.saga!r}"
                    )
                return run_id
            started = NewEvent(h.RUN_STARTED, name=name, data={"input": input_json})
            self.store.append_events(tx, run_id, 0, [started], now)
            self.store.enqueue(tx, [Outgoing(engine_queue(self.app_name), env)], now)
        return run_id

    def _send(
        self,
        run_id: str,
        type: Any,
        payload: dict[str, Any],
        *,
        live: bool,
        message_id: str | None = None,
    ) -> None:
        run = self.get(run_id)
        if live and run.status in s.FINAL_STATUSES:
            raise RunFinishedError(run_id, run.status)
        now = self.clock.now()
        env = Envelope(
            type=type,
            run_id=run_id,
            payload=payload,
            created_at=now,
            message_id=message_id or uuid.uuid4().hex,
        )
        _check_size(env)
        with self.store.transaction() as tx:
            self.store.enqueue(tx, [Outgoing(engine_queue(run.app), env)], now)

    def send_event(
        self, run_id: str, name: str, data: Any = None, *, event_id: str | None = None
    ) -> None:
        """Deliver an event to a run; kept until the run waits for it if it arrives early.
        Sends with the same ``event_id`` are delivered once (safe to retry)."""
        if not name or len(name) > 200 or "\x00" in name:
            raise ValidationError("event name must be 1 to 200 characters, without NUL")
        payload = {"name": name, "data": _json(data, "event data")}
        message_id = derived_id("event", run_id, event_id) if event_id else None
        self._send(run_id, "event", payload, live=True, message_id=message_id)

    def cancel(self, run_id: str, reason: str | None = None) -> None:
        """Stop the run at its next suspension point and compensate its completed steps."""
        self._send(run_id, "cancel", {"reason": reason}, live=True)

    def retry(self, run_id: str) -> None:
        """Resume a run in ``needs_attention`` once its cause is fixed."""
        run = self.get(run_id)
        if run.status != s.NEEDS_ATTENTION:
            raise RunStateError(f"run {run_id!r} is {run.status}, not needs_attention")
        self._send(run_id, "retry", {}, live=False)

    # --- reading -----------------------------------------------------------------------------

    def get(self, run_id: str) -> RunRecord:
        run = self.store.get_run(run_id)
        if run is None:
            raise RunNotFoundError(run_id)
        return run

    def history(self, run_id: str) -> list[Event]:
        self.get(run_id)
        return self.store.load_history(None, run_id)

    def status(self, run_id: str) -> Timeline:
        run = self.get(run_id)
        return timeline(run, self.store.load_history(None, run_id), self.clock.now())

    def list(
        self, *, status: str | None = None, saga: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        return self.store.list_runs(status=status, saga=saga, limit=limit)

    def result(self, run_id: str, *, timeout: float | None = None, poll: float = 0.05) -> Any:
        """Wait for the run to finish; return its output or raise SagaFailedError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.get(run_id)
            if run.status == s.COMPLETED:
                return run.output
            if run.status in s.FINAL_STATUSES:
                error = _ErrorInfo.from_json(run.error) if run.error else None
                raise SagaFailedError(run_id, run.status, error)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id!r} is still {run.status} after {timeout} s")
            time.sleep(poll)
