"""The store's roles that each serve one saga feature: rate limits, approvals and
run-concurrency slots (roles of every ``Store``), schedules, subscriptions and debounce windows
(roles of the stores that have them). ``sagaloop.engine.ports`` re-exports them beside the
core roles and ``Store``, the union of every store's roles."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sagaloop.engine.records import ApprovalRow, Debounced, HeldSlot, KeySlots, RunRecord, Schedule

if TYPE_CHECKING:
    from sagaloop.engine.ports import Tx


@runtime_checkable
class RateLimits(Protocol):
    """Rate limits shared by every worker of the database (see ``store/limits.py``)."""

    def reserve_slot(self, key: str, interval: float, now: datetime) -> datetime:
        """Reserve the next start slot of the rate limit ``key`` (one start every ``interval``
        seconds, no burst), atomically: ``slot = max(next_free, now)``, then ``next_free =
        slot + interval``; return ``slot``."""
        ...

    def hold_slot(
        self,
        message_id: str,
        key: str,
        slot: datetime,
        *,
        in_doubt: bool,
        give_backs: int,
        now: datetime,
    ) -> None:
        """Keep ``slot`` for the step message ``message_id`` (its inbox key) while it is given
        back to its queue until then (replacing what it held before)."""
        ...

    def take_held_slot(self, message_id: str) -> HeldSlot | None:
        """What :meth:`hold_slot` kept for ``message_id``, marked as taken (None: nothing)."""
        ...


@runtime_checkable
class ApprovalStore(Protocol):
    """The approvals index: one row per approval a run asked for, written in the transaction
    of the activation that published it, claimed by the answer that wins, deleted when the run
    finishes."""

    def publish_approval(
        self,
        tx: Tx,
        run: RunRecord,
        call_id: str,
        request: dict[str, Any],
        *,
        now: datetime,
        release: str | None = None,
    ) -> None:
        """Index the request of approval ``call_id`` as ``run`` published it now. A request
        seen for the first time gets its random ``request_id``. ``release``: the message id of
        the answer this activation gave the run; if the request is still open after it (the
        run refused that answer), its claim is released, so that another answer may win."""
        ...

    def end_approvals(self, tx: Tx, run_id: str) -> None:
        """Forget the approvals of the run (it finished, or restarted)."""
        ...

    def approval(self, tx: Tx | None, run_id: str, call_id: str) -> ApprovalRow | None: ...
    def claim_approval(
        self,
        tx: Tx,
        run_id: str,
        call_id: str,
        *,
        request_id: str,
        message_id: str,
        answer: dict[str, Any],
    ) -> bool:
        """Make ``message_id`` the answer of the open request ``request_id``, unless another
        answer holds it; True when it does now (also when it already did)."""
        ...

    def open_approvals(
        self,
        *,
        app: str | None,
        run_id: str | None = None,
        after: tuple[datetime, str, str] | None = None,
        limit: int = 50,
    ) -> list[ApprovalRow]:
        """Open approvals (pending or escalated), oldest request first, after the cursor
        ``(requested_at, run_id, call_id)``: a page of at most ``limit``."""
        ...


@runtime_checkable
class ScheduleStore(Protocol):
    """The schedules of the apps (see ``store/schedules.py``). Not a role of every ``Store``:
    the scheduler runs where the store has it."""

    def put_schedule(self, schedule: Schedule, *, replace: bool) -> bool:
        """Insert ``schedule``; a stored one of the same (app, name) is kept (False) unless
        ``replace``, where its saga, spec, input and policy are replaced (its pause, last run
        and, for the same spec, next tick are kept)."""
        ...

    def get_schedule(self, app: str, name: str) -> Schedule | None: ...

    def list_schedules(self, app: str | None = None) -> list[Schedule]: ...

    def due_schedules(self, app: str, now: datetime) -> list[Schedule]:
        """The schedules of ``app`` not paused whose next tick is at or before ``now``."""
        ...

    def advance_schedule(
        self,
        schedule: Schedule,
        next_tick: datetime,
        last_tick: datetime | None,
        last_run_id: str | None,
        now: datetime,
    ) -> bool:
        """Move the next tick on, if it is still ``schedule.next_tick`` (else another engine
        did: False)."""
        ...

    def pause_schedule(
        self,
        app: str,
        name: str,
        *,
        paused: bool,
        now: datetime,
        next_tick: datetime | None,
        note: str | None = None,
    ) -> bool:
        """Pause or resume; ``next_tick`` (on resume) replaces the stored one, so that the
        ticks of the pause are not caught up. ``note`` replaces the stored note (a resume
        clears it unless given). False: no such schedule."""
        ...

    def delete_schedule(self, app: str, name: str) -> bool: ...


@runtime_checkable
class SubscriptionStore(Protocol):
    """Which runs a published event reaches (see ``store/subscriptions.py``): a row per run
    and ``(name, key)`` it is subscribed to, ``key`` ``""`` meaning every key of the name. Not a
    role of every ``Store``: an engine whose store lacks it refuses ``publish`` messages."""

    def set_subscriptions(
        self, tx: Tx, app: str, run_id: str, wanted: frozenset[tuple[str, str]]
    ) -> None:
        """Make ``wanted`` (``(name, key)`` pairs) the subscriptions of ``run_id``: the rows it
        has beyond them are deleted, the missing ones inserted."""
        ...

    def subscribers(self, tx: Tx | None, app: str, name: str, key: str | None) -> list[str]:
        """The runs of ``app`` subscribed to ``name`` with ``key`` or with every key (``""``),
        each once, in run id order, as ``tx`` (None: committed state) sees them."""
        ...

    def subscriptions_of(self, tx: Tx | None, run_id: str) -> frozenset[tuple[str, str]]:
        """The ``(name, key)`` pairs ``run_id`` is subscribed to."""
        ...


@runtime_checkable
class ConcurrencySlots(Protocol):
    """The slots of run-concurrency keys and the runs queued for them (see
    ``engine/concurrency.py``). A slot is a row keyed by (app, saga, key, slot index) naming
    the run that holds it: two transactions cannot both insert it."""

    def key_slots(self, tx: Tx | None, app: str, saga: str, key: str) -> KeySlots:
        """The slots held and the runs waiting for ``key``, as ``tx`` (or, None: committed
        state) sees them."""
        ...

    def lock_key(self, tx: Tx, app: str, saga: str, key: str) -> None:
        """Serialize the transactions that change ``key``'s slots or queue until ``tx`` ends."""
        ...

    def claim_slot(
        self, tx: Tx, app: str, saga: str, key: str, slot: int, run_id: str, now: datetime
    ) -> bool:
        """Give slot ``slot`` of ``key`` to ``run_id`` and take the run off the key's queue;
        False (nothing written) if another run holds that slot."""
        ...

    def move_slot(
        self, tx: Tx, app: str, saga: str, key: str, slot: int, holder: str, run_id: str
    ) -> bool:
        """Hand slot ``slot`` from ``holder`` to ``run_id``; False if ``holder`` lost it."""
        ...

    def release_slot(self, tx: Tx, run_id: str) -> tuple[str, str, str] | None:
        """Free the slot ``run_id`` holds and take it off any queue, under the key's lock (as
        :meth:`lock_key`); its (app, saga, key), or None if it held no slot and waited for
        none."""
        ...

    def note_waiting(self, tx: Tx, reasons: dict[str, str]) -> None:
        """Set the ``reason`` of each run of ``reasons`` (run id -> reason) still running: what
        ``status`` says of a run queued for a slot. Changes nothing else of the run."""
        ...

    def queue_for_slot(
        self, tx: Tx, app: str, saga: str, key: str, run_id: str, started_at: datetime
    ) -> None:
        """Queue ``run_id`` for a slot of ``key``, ordered by ``started_at``, then behind the
        runs queued before it; a run queued already keeps its place."""
        ...


@runtime_checkable
class DebounceStore(Protocol):
    """The open windows of debounced sagas (see ``store/debounce.py``), one per (app, saga,
    key). Not a role of every ``Store``: debounced starts need a store that has it."""

    def debounce(
        self,
        app: str,
        saga: str,
        key: str,
        input: Any,
        now: datetime,
        period: timedelta,
        max_wait: timedelta | None,
        run_id: str,
    ) -> Debounced:
        """Record a start: open the key's window (its run id ``run_id``, due ``period`` from
        now) or, if one is open, give it this input and move its due time to ``period`` from
        now, bounded by ``max_wait`` from its first start. Return the window as written."""
        ...

    def pending_debounced(self, app: str | None = None, saga: str | None = None) -> list[Debounced]:
        """The open windows (of ``app``, of ``saga``), by due time."""
        ...

    def due_debounced(self, app: str, now: datetime, limit: int = 100) -> list[Debounced]:
        """The windows of ``app`` due at or before ``now``, by due time."""
        ...

    def find_debounced(self, run_id: str) -> Debounced | None:
        """The open window whose run will be ``run_id``, if there is one."""
        ...

    def take_debounced(self, tx: Tx, window: Debounced) -> bool:
        """In ``tx``: close ``window`` if it is still as read (same run id and ``starts``);
        False when a start moved it since, or another engine took it."""
        ...
