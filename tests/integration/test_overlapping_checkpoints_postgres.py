"""In-process checkpoints overlap: a group of replies is prepared under the engine's lock and
written without it (``EngineConsumer.prepared``), so one group's transaction does not hold up
the next group's saga code and statement. A run stays in one open transaction at a time: the
replies for a run whose transaction is open wait for it to end, then are prepared together from
what it committed."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from contextlib import closing
from typing import Any

import pytest

from sagaloop import App, SagaContext, StepContext
from sagaloop.testing import Harness
from sagaloop.testing.wait import eventually
from tests.unit.test_local_steps import ready_replies

pytestmark = pytest.mark.integration

WAIT = 60.0

app = App("overlap")


@app.step(local=True)
def square(ctx: StepContext, x: int) -> int:
    return x * x


@app.saga(name="one")
async def one(ctx: SagaContext, x: int) -> int:
    return await ctx.call(square, x)


@app.saga(name="three")
async def three(ctx: SagaContext, x: int) -> list[int]:
    return list(await asyncio.gather(*(ctx.call(square, x + i) for i in range(3))))


def _paused_in_transaction(h: Harness, run_id: str) -> tuple[threading.Event, threading.Event]:
    """The transaction that applies a plan of ``run_id`` stops after it (its stage not ended)
    until the second event is set; the first is set when it got there."""
    engine = h._local_consumer.consumer.engine
    inside, go = threading.Event(), threading.Event()
    apply = engine.apply

    def paused(tx: Any, plan: Any, **kw: Any) -> None:
        apply(tx, plan, **kw)
        if plan.env.run_id == run_id and not go.is_set():
            inside.set()
            assert go.wait(WAIT)

    engine.apply = paused  # type: ignore[method-assign]
    return inside, go


def _thread(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_groups_transaction_does_not_hold_up_another_runs_checkpoint(database: str) -> None:
    with closing(Harness(app, url=database, broker="memory")) as h:
        a, b = h.start(one, 2), h.start(one, 3)
        h.step_once(), h.step_once()  # the starts: each dispatches its step
        ck_a, ck_b = sorted(ready_replies(h), key=lambda c: c.env.run_id != a)
        worker = h._local_consumer
        inside, go = _paused_in_transaction(h, a)
        first = _thread(lambda: worker._checkpoint(ck_a))
        assert inside.wait(WAIT)
        second = _thread(lambda: worker._checkpoint(ck_b))  # while a's transaction is open
        second.join(WAIT)
        assert not second.is_alive(), "b's checkpoint waited for a's transaction"
        assert ck_b.done is True and ck_a.done is None
        go.set()
        first.join(WAIT)
        assert ck_a.done is True
        h.run_until_idle()
        assert (h.result(a), h.result(b)) == (4, 9)
        stages = worker.consumer.engine._stages
        assert stages.open == [stages.own], "every transaction's stage ended"


def test_replies_for_a_run_in_an_open_transaction_wait_for_it_then_go_together(
    database: str,
) -> None:
    """Not an ActivationConflict (a reply would go the long way, by the engine queue), nor one
    transaction each: the replies that came meanwhile (a fan-out's) are prepared together once
    the run's transaction ended, from the state it committed."""
    with closing(Harness(app, url=database, broker="memory")) as h:
        run_id = h.start(three, 2)
        h.step_once()  # the start: three in-process steps of one run
        ck_1, *others = ready_replies(h)
        worker = h._local_consumer
        engine = worker.consumer.engine
        inside, go = _paused_in_transaction(h, run_id)
        waiting: set[int] = set()
        holds, transaction = engine.holds, worker._transaction
        groups: list[int] = []

        def watched(run_ids: Any) -> bool:
            held = holds(run_ids)
            if held:
                waiting.add(threading.get_ident())
            return held

        def counted(group: Any, prepared: Any) -> None:
            groups.append(len(group))
            transaction(group, prepared)

        engine.holds = watched  # type: ignore[method-assign]
        worker._transaction = counted  # type: ignore[method-assign]
        first = _thread(lambda: worker._checkpoint(ck_1))
        assert inside.wait(WAIT)
        rest = [_thread(functools.partial(worker._checkpoint, c)) for c in others]
        eventually(lambda: len(waiting) == 2, WAIT, "both replies waiting for the run")
        assert [c.done for c in others] == [None, None]
        go.set()
        for thread in [first, *rest]:
            thread.join(WAIT)
        assert [c.done for c in [ck_1, *others]] == [True] * 3, "all applied in process"
        assert groups == [1, 2], "the two that waited: one transaction"
        h.run_until_idle()
        assert h.result(run_id) == [4, 9, 16]
        assert engine._stages.open == [engine._stages.own], "every transaction's stage ended"
