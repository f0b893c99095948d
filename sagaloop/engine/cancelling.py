"""The cancel policy, as pure functions beside :mod:`~sagaloop.engine.decide`: a cancel
request delivered into the saga code for its ``cancel_grace`` (the run is ``cancelling``) or
applied at once, the grace's expiry, the outcome of code that ended while cancelling, a
parent's request to undo a completed child run, and the cancels sent to child runs."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import derived_id, engine_queue
from sagaloop.engine.state import RunState
from sagaloop.sagas.app import App

if TYPE_CHECKING:
    from sagaloop.engine.decide import Effects


def cancel_events(
    st: RunState,
    reason: str | None,
    *,
    grace: timedelta = timedelta(0),
    now: datetime | None = None,
    cut_short: bool = False,
) -> list[NewEvent]:
    """A cancel request: recorded once, and only while the saga code has not finished. With a
    ``grace`` (the saga's ``cancel_grace``), it is delivered into the saga code
    (``cancel_delivered``: the run is ``cancelling`` until ``now + grace``); without, or when
    the run needs attention, the run is cancelled at once (``cancel_requested``). A second
    cancel changes nothing, but one that ``cut_short`` (``Client.cancel(now=True)``) stops
    the code of a ``cancelling`` run where its cleanup waits."""
    if st.cancelling is not None and cut_short and st.cancel_reason is None:
        return [NewEvent(h.CANCEL_REQUESTED, data={"reason": reason or st.cancelling["reason"]})]
    if st.cancel_reason is not None or st.saga_done or st.cancelling is not None:
        return []
    why = reason or "cancelled"
    if grace > timedelta(0) and now is not None and st.parked is None:
        abandoned = sorted((x for x in st.in_flight() if x.child is None), key=lambda x: x.pos)
        steps = [x.pos for x in abandoned]
        data = {"reason": why, "until": (now + grace).isoformat(), "steps": steps}
        # a step waiting to retry gets no new attempt: it fails now, with its last error
        ended = [
            NewEvent(h.STEP_FAILED, x.pos, x.name, {"error": x.error, "in_doubt": x.in_doubt})
            for x in abandoned
            if x.status == s.RETRYING
        ]
        return [NewEvent(h.CANCEL_DELIVERED, data=data), *ended]
    return [NewEvent(h.CANCEL_REQUESTED, data={"reason": why})]


def grace_expired_events(st: RunState) -> list[NewEvent]:
    """The saga code did not end within its ``cancel_grace``: the run is cancelled as one
    without a grace is (its code stopped where it waits, its steps compensated)."""
    assert st.cancelling is not None
    reason = str(st.cancelling.get("reason") or "cancelled")
    return [
        NewEvent(h.CANCEL_GRACE_EXPIRED, data={"until": st.cancelling.get("until")}),
        NewEvent(h.CANCEL_REQUESTED, data={"reason": reason}),
    ]


def cancelled_code_events(st: RunState, outcome: dict[str, Any]) -> list[NewEvent]:
    """The saga code ended while it was ``cancelling``: the cancel wins whatever it did. Code
    that let ``CancelledError`` out (or continued as new) is cancelled as a run without a
    grace is; code that raised another error or returned a value (it swallowed the cancel)
    records its outcome first. Either way the run ends ``cancelled`` and its completed steps
    are compensated: an operator's cancel is never turned into a completion."""
    assert st.cancelling is not None
    cancel = NewEvent(h.CANCEL_REQUESTED, data={"reason": st.cancelling.get("reason")})
    if outcome.get("cancelled") or "continue_as_new" in outcome or st.saga_done:
        return [cancel]
    return [NewEvent(h.SAGA_FINISHED, data=recorded(outcome)), cancel]


def recorded(outcome: dict[str, Any]) -> dict[str, Any]:
    """The ``saga_finished`` data of the code's outcome (without the replayer's flags)."""
    return {k: v for k, v in outcome.items() if k != "cancelled"}


def undo_run_events(st: RunState, link: dict[str, Any]) -> list[NewEvent]:
    """The parent (``link``: its run id and call's position) asks to undo this completed
    child run as a whole: only its own parent may, once."""
    if st.finished != s.COMPLETED or st.undoing or st.parent != link:
        return []
    return [NewEvent(h.UNDO_REQUESTED, data={"parent": link})]


GRACE_POS = -1
"""The position of a run's ``cancel_grace`` timer: no command's."""


def cancel_children(
    app: App, st: RunState, effects: Effects, only: int | None = None, why: str = ""
) -> None:
    """Cancel the child runs still in flight (or the one at position ``only``): their parent
    is cancelled or has ended, or stopped waiting for it. One message id per child, whichever
    asks first."""
    for pos, (child, _) in st.children.items():
        if only is not None and pos != only:
            continue
        effects.send(
            engine_queue(app.name),
            type="cancel",
            message_id=derived_id("cancel-child", st.run_id, pos),
            run_id=child,
            payload={"reason": why or f"its parent run {st.run_id!r} was cancelled or ended"},
        )
