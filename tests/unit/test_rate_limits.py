"""Rate limits (issue 15): ``@app.step(rate_limit="10/s")`` parsed at declaration, the GCRA
slots the store reserves (one start per interval, no burst, shared by every process of the
database), and the worker that waits for its slot, or gives the message back to its queue with
the slot kept for it, without making the attempt in doubt."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sagaloop import App, DeclarationError, RetryPolicy, SagaContext, StepContext
from sagaloop.agents._core import ToolPolicy, tool_step
from sagaloop.errors import InvalidRateLimit
from sagaloop.sagas.policy import RateLimit
from sagaloop.store import tables as t
from sagaloop.testing import Harness, VirtualClock

T0 = datetime(2030, 1, 2, tzinfo=UTC)


# --- declaration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "per_second"),
    [("10/s", 10.0), ("600/m", 10.0), ("2/s", 2.0), ("0.5/s", 0.5), ("90/h", 0.025)],
)
def test_accepted_forms(rate: str, per_second: float) -> None:
    app = App("limits")

    @app.step(rate_limit=rate)
    def call(ctx: StepContext) -> None: ...

    assert call.rate_limit is not None
    assert call.rate_limit.per_second == pytest.approx(per_second)
    assert call.rate_limit.interval == pytest.approx(1 / per_second)
    assert call.rate_limit.key == "limits/call", "by default, the step's own quota"


@pytest.mark.parametrize("rate", ["10", "10/d", "0/s", "-1/s", "x/s", "10 per second", ""])
def test_a_bad_rate_is_a_value_error_naming_the_step_and_the_forms(rate: str) -> None:
    app = App("limits")
    with pytest.raises(ValueError) as raised:
        app.step(name="call", rate_limit=rate)(lambda ctx: None)
    message = str(raised.value)
    assert "step 'call'" in message and repr(rate) in message
    assert "'N/s', 'N/m' or 'N/h'" in message
    assert isinstance(raised.value, DeclarationError), "and a declaration error"
    assert "call" not in app.steps


def test_keys_are_checked_and_shared_keys_share_one_rate() -> None:
    app = App("limits")
    app.step(name="a", rate_limit="10/s", rate_key="openai")(lambda ctx: None)
    app.step(name="b", rate_limit="600/m", rate_key="openai")(lambda ctx: None)  # the same rate
    with pytest.raises(InvalidRateLimit, match="already limited to '10/s' by step 'a'"):
        app.step(name="c", rate_limit="20/s", rate_key="openai")(lambda ctx: None)
    with pytest.raises(InvalidRateLimit, match="rate_key 'a/b' is not valid"):
        app.step(name="d", rate_limit="1/s", rate_key="a/b")(lambda ctx: None)
    with pytest.raises(InvalidRateLimit, match="needs a rate_limit"):
        app.step(name="e", rate_key="openai")(lambda ctx: None)
    a, b = app.steps["a"].rate_limit, app.steps["b"].rate_limit
    assert a is not None and b is not None
    assert (a.key, a.per_second) == (b.key, b.per_second) == ("openai", 10.0)


def test_a_tool_policy_rate_limit_reaches_the_tool_step() -> None:
    app = App("limits")
    policy = ToolPolicy(rate_limit="2/s", rate_key="search-api")
    step = tool_step(app, "agent__x__search", policy, "tools")(lambda ctx, call: {"value": 1})
    assert step.rate_limit == RateLimit(rate="2/s", key="search-api", per_second=2.0)


# The store's slots and holds: StoreContract (sagaloop/testing/store_contract.py), on SQLite
# and PostgreSQL.


# --- the worker ------------------------------------------------------------------------------

app = App("rated")
ONCE = RetryPolicy(max_attempts=1)
starts: list[tuple[str, datetime, bool]] = []
clock = VirtualClock(T0)


@app.step(queue="llm", rate_limit="2/s", rate_key="provider", idempotent=False, retry=ONCE)
def ask(ctx: StepContext, i: int) -> int:
    starts.append(("ask", clock.now(), ctx.in_doubt))
    return i


@app.step(queue="llm", rate_limit="2/s", rate_key="provider", retry=ONCE)
def book(ctx: StepContext, i: int) -> int:
    starts.append(("book", clock.now(), ctx.in_doubt))
    if i < 0:
        raise ValueError("no")
    return i


@book.compensation
def unbook(ctx: StepContext, i: int, result: int) -> None:
    starts.append(("unbook", clock.now(), ctx.in_doubt))


@app.saga(name="fan-out")
async def fan_out(ctx: SagaContext, n: int) -> int:
    asks = [ctx.call(ask, i) for i in range(n)]
    books = [ctx.call(book, i) for i in range(n)]
    return sum(await asyncio.gather(*asks, *books))


@app.saga(name="undo")
async def undo(ctx: SagaContext) -> None:
    await ctx.call(book, 1)
    await ctx.call(book, 2)
    await ctx.call(book, -1)


@pytest.fixture
def env() -> Any:
    global clock
    clock = VirtualClock(T0)
    starts.clear()
    harness = Harness(app, clock=clock)
    yield harness
    harness.close()


def seconds(at: datetime) -> float:
    return round((at - T0).total_seconds(), 6)


def test_steps_sharing_a_key_start_one_interval_apart(env: Harness) -> None:
    run_id = env.start(fan_out, 3)
    env.run_until_idle()
    assert env.result(run_id) == 6
    assert [seconds(at) for _, at, _ in starts] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert {name for name, _, _ in starts} == {"ask", "book"}
    assert not any(doubt for _, _, doubt in starts)


def test_compensations_take_slots_too(env: Harness) -> None:
    run_id = env.start(undo)
    env.run_until_idle()
    assert env.get(run_id).status == "compensated"
    assert [(name, seconds(at)) for name, at, _ in starts] == [
        ("book", 0.0),
        ("book", 0.5),
        ("book", 1.0),
        ("unbook", 1.5),  # the failed attempt, in doubt, is undone too
        ("unbook", 2.0),
        ("unbook", 2.5),
    ]


def held_slots(env: Harness) -> list[Any]:
    with env.store.engine.connect() as conn:
        return list(conn.execute(sa.select(t.rate_holds)))


def step_until_given_back(env: Harness) -> None:
    for _ in range(20):
        env.step_once()
        if held_slots(env):
            return
    raise AssertionError("the step was never given back")


def test_a_far_slot_gives_the_message_back_and_it_keeps_the_slot(env: Harness) -> None:
    for _ in range(10):  # other workers took the next 5 s of the quota
        env.store.reserve_slot("provider", 0.5, T0)
    run_id = env.start(fan_out, 1)
    step_until_given_back(env)
    assert starts == [], "the thread did not wait 5 s: the message went back to its queue"
    (hold,) = held_slots(env)
    assert (hold.slot - T0.timestamp(), hold.give_backs, hold.in_doubt) == (5.0, 1, False)
    depths = env.store.queue_depths()
    assert depths.get("rated.steps.llm") == 2, "both steps wait in the queue"
    env.clock.advance(timedelta(seconds=4.5))  # back half the wait bound before its slot
    env.run_until_idle()
    assert env.result(run_id) == 0
    assert next((name, seconds(at)) for name, at, _ in starts) == ("ask", 5.0), "its slot"
    assert not any(doubt for _, _, doubt in starts), "a give-back makes no attempt in doubt"


def test_a_slot_missed_while_away_is_a_gap_and_the_next_free_one_is_taken(env: Harness) -> None:
    for _ in range(10):
        env.store.reserve_slot("provider", 0.5, T0)
    run_id = env.start(fan_out, 1)
    step_until_given_back(env)
    env.clock.advance(timedelta(seconds=30))  # no thread was free at its slot
    env.run_until_idle()
    assert env.result(run_id) == 0
    assert [seconds(at) for _, at, _ in starts] == [30.0, 30.5]
    assert not any(doubt for _, _, doubt in starts)


def test_a_hold_taken_by_a_delivery_that_died_leaves_the_attempt_in_doubt(env: Harness) -> None:
    for _ in range(10):
        env.store.reserve_slot("provider", 0.5, T0)
    run_id = env.start(fan_out, 1)
    step_until_given_back(env)
    (hold,) = held_slots(env)
    taken = env.store.take_held_slot(hold.message_id)  # as a worker that died after this
    assert taken is not None and taken.fresh
    env.clock.advance(timedelta(seconds=4.5))
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "needs_attention", "idempotent=False, in doubt: not run again"
    assert "ask" not in [name for name, _, _ in starts]


def test_a_thread_that_wakes_too_late_for_its_slot_takes_the_next_one(env: Harness) -> None:
    env.store.reserve_slot("provider", 0.5, T0)  # another worker's: this one gets T0 + 0.5 s
    overslept: list[float] = []

    def busy_machine(seconds: float) -> None:  # the first wake-up comes 0.6 s late
        late = 0.0 if overslept else 0.6
        overslept.append(late)
        env.clock.advance(timedelta(seconds=seconds + late))

    env._worker_consumer._sleep = busy_machine
    run_id = env.start(fan_out, 1)
    env.run_until_idle()
    assert env.result(run_id) == 0
    # Its slot (0.5 s) was missed: a gap. At the wake-up (1.1 s) the next free slot is now,
    # and the second step's is one interval after it.
    assert [seconds(at) for _, at, _ in starts] == [1.1, 1.6]
    assert not any(doubt for _, _, doubt in starts)


def test_a_slot_minutes_away_is_waited_for_in_give_backs_of_a_minute_at_most(
    env: Harness,
) -> None:
    env.store.reserve_slot("provider", 150.0, T0)  # the quota is taken for 150 s
    run_id = env.start(fan_out, 1)
    backs: list[float] = []
    for _ in range(20):  # time passes as in production: each message comes back when due
        env.run_until_idle(skip_time=False)
        if env.get(run_id).status == "completed":
            break
        due = env.store.oldest_outbox_message()
        assert due is not None
        backs.append(seconds(due))
        env.clock.set(due)
    assert env.result(run_id) == 0
    assert [(name, seconds(at)) for name, at, _ in starts] == [("ask", 150.0), ("book", 150.5)]
    assert not any(doubt for _, _, doubt in starts)
    assert backs[:2] == [60.0, 120.0], "no broker holds a message for more than a minute"
    assert max(h.give_backs for h in held_slots(env)) == 3
