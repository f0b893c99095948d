"""Random saga programs interrupted at random points end like an uninterrupted run.

One app declares a generic *interpreter* saga whose input is a JSON program (sequential steps,
concurrent steps, sleeps, transient failures, permanent failures, a raising saga). Its steps act
on a fake payment provider that lives outside the engine and honours idempotency keys: a charge
is recorded once per key, a refund once per compensation key, and raw counters say how often each
body actually ran. Every example gets a fresh ledger, found through a token in the program.

The property: a program run without interruption, and the same program run while messages are
lost in flight (``Crash`` before processing), published twice, or acknowledged by a process that
dies after its commit, while the engine and workers restart (caches dropped), and while step
bodies die right after their effect and before their attempt commits, end in the same status,
output and error; each effect is applied exactly once; step bodies run again only where a kill
interrupted them; the same steps are compensated, newest first; and every history has gap-free
``seq`` and no command position recorded twice.

"Newest first" is the reverse of the completion order each history recorded. Members of one
``gather`` may complete in another order once messages are delayed, so between the two runs the
compensation order is compared op by op (the members of a gather share their op).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any, Literal

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext, StepFailedError
from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.engine.messages import Envelope, engine_queue, step_queue
from sagaloop.engine.ports import Delivery
from sagaloop.runtime.crashpoints import CrashPointRaised
from sagaloop.testing import Crash, Harness

Broker = Literal["database", "memory"]
BROKERS: tuple[Broker, ...] = ("database", "memory")
RUN_ID = "prog"
FLAKY_ATTEMPTS = 3  # a flaky step fails at most FLAKY_ATTEMPTS - 1 times, then succeeds


# --- the ledger: side effects recorded outside the engine ------------------------------------


class Killed(CrashPointRaised):
    """The process died: in a step body after its effect (before the attempt committed), or
    between a commit and the acknowledgement of the message.

    A CrashPointRaised (a BaseException that sagaloop lets through, unlike any other raised by
    step code), so neither the step runner nor the consumers turn it into a step failure or a
    retry: it escapes the harness as a SIGKILL would end the process."""


@dataclasses.dataclass
class Ledger:
    """A fake payment provider honouring idempotency keys, plus raw counters."""

    kill_at: frozenset[int] = frozenset()
    """Body invocations (numbered from 0, do and undo alike) that die right after their effect."""
    charges: dict[str, str] = dataclasses.field(default_factory=dict)
    """The provider's charges: idempotency key -> step id (one per key, whatever the retries)."""
    refunds: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    """Compensation idempotency key -> (step id, the step result the compensation received)."""
    refund_order: list[str] = dataclasses.field(default_factory=list)
    failures: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Transient failures already served, by idempotency key (not by attempt number)."""
    runs: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Raw count of body executions, by ``do:sid`` / ``undo:sid``."""
    killed: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Bodies killed after their effect, by ``do:sid`` / ``undo:sid``."""
    seen: list[tuple[str, str, int, bool]] = dataclasses.field(default_factory=list)
    """(direction, sid, ctx.attempt, ctx.in_doubt) of every body execution."""
    invocations: int = 0

    def enter(self, ctx: StepContext, direction: str, sid: str) -> int:
        self.runs[f"{direction}:{sid}"] += 1
        self.seen.append((direction, sid, ctx.attempt, ctx.in_doubt))
        self.invocations += 1
        return self.invocations - 1

    def charge(self, ctx: StepContext, sid: str, call: int) -> str:
        self.charges.setdefault(ctx.idempotency_key, sid)
        if call in self.kill_at:
            self.killed[f"do:{sid}"] += 1
            raise Killed(f"killed after charging {sid} (invocation {call})")
        return f"done:{sid}"

    def refund(self, ctx: StepContext, sid: str, result: Any, call: int) -> None:
        if ctx.idempotency_key not in self.refunds:
            self.refunds[ctx.idempotency_key] = (sid, result)
            self.refund_order.append(sid)
        if call in self.kill_at:
            self.killed[f"undo:{sid}"] += 1
            raise Killed(f"killed after refunding {sid} (invocation {call})")


LEDGERS: dict[str, Ledger] = {}


@contextlib.contextmanager
def fresh_ledger(kill_at: frozenset[int] = frozenset()) -> Iterator[tuple[str, Ledger]]:
    token = uuid.uuid4().hex
    ledger = LEDGERS[token] = Ledger(kill_at=kill_at)
    try:
        yield token, ledger
    finally:
        del LEDGERS[token]


# --- the app ---------------------------------------------------------------------------------

app = App("interrupted")
RETRY = RetryPolicy(max_attempts=FLAKY_ATTEMPTS, initial_interval=timedelta(seconds=5))


@app.step(queue="provider", retry=RETRY)
def charge(ctx: StepContext, token: str, sid: str) -> str:
    ledger = LEDGERS[token]
    return ledger.charge(ctx, sid, ledger.enter(ctx, "do", sid))


@charge.compensation
def refund_charge(ctx: StepContext, token: str, sid: str, result: str) -> None:
    ledger = LEDGERS[token]
    ledger.refund(ctx, sid, result, ledger.enter(ctx, "undo", sid))


@app.step(queue="provider", retry=RETRY)
def flaky_charge(ctx: StepContext, token: str, sid: str, failures: int) -> str:
    ledger = LEDGERS[token]
    call = ledger.enter(ctx, "do", sid)
    if ledger.failures[ctx.idempotency_key] < failures:
        ledger.failures[ctx.idempotency_key] += 1
        raise ConnectionError(f"provider unavailable for {sid}")
    return ledger.charge(ctx, sid, call)


@flaky_charge.compensation
def refund_flaky(ctx: StepContext, token: str, sid: str, failures: int, result: str) -> None:
    ledger = LEDGERS[token]
    ledger.refund(ctx, sid, result, ledger.enter(ctx, "undo", sid))


@app.step(queue="provider", retry=RETRY)
def rejected_charge(ctx: StepContext, token: str, sid: str) -> str:
    LEDGERS[token].enter(ctx, "do", sid)
    raise ApplicationError(f"card declined for {sid}", non_retryable=True)


@rejected_charge.compensation
def refund_rejected(ctx: StepContext, token: str, sid: str, result: str) -> None:
    ledger = LEDGERS[token]  # never expected to run: a declined charge took no effect
    ledger.refund(ctx, sid, result, ledger.enter(ctx, "undo", sid))


def _step(ctx: SagaContext, token: str, op: dict[str, Any]) -> Awaitable[str]:
    if op["op"] == "call":
        return ctx.call(charge, token, op["id"])
    if op["op"] == "flaky":
        return ctx.call(flaky_charge, token, op["id"], op["failures"])
    assert op["op"] == "fail", op
    return ctx.call(rejected_charge, token, op["id"])


@app.saga(name="interpreter")
async def interpreter(ctx: SagaContext, program: dict[str, Any]) -> list[Any]:
    token: str = program["token"]
    results: list[Any] = []
    for index, op in enumerate(program["ops"]):
        kind = op["op"]
        if kind == "sleep":
            await ctx.sleep(timedelta(seconds=op["seconds"]))
            results.append(None)
        elif kind == "raise":
            raise RuntimeError(f"the program raised at op {index}")
        elif kind == "gather":
            calls = [_step(ctx, token, member) for member in op["steps"]]
            gathered = await (ctx.gather(*calls) if op["ctx"] else asyncio.gather(*calls))
            results.append(list(gathered))
        elif kind == "fail" and op["caught"]:
            try:
                await _step(ctx, token, op)
            except StepFailedError as e:
                results.append(f"caught:{op['id']}:{e.error.message}")
        else:
            results.append(await _step(ctx, token, op))
    return results


# --- programs and the expected outcome -------------------------------------------------------

_effect = st.one_of(
    st.fixed_dictionaries({"op": st.just("call")}),
    st.fixed_dictionaries({"op": st.just("flaky"), "failures": st.integers(1, FLAKY_ATTEMPTS - 1)}),
)


@st.composite
def _gather(draw: st.DrawFn) -> dict[str, Any]:
    members = draw(st.lists(_effect, min_size=2, max_size=3))
    if draw(st.booleans()):  # at most one member fails for good: the first error is then fixed
        members.insert(draw(st.integers(0, len(members))), {"op": "fail"})
    return {"op": "gather", "steps": members, "ctx": draw(st.booleans())}


_op = st.one_of(  # weighted towards steps, so that most programs get some way before failing
    _effect,
    _effect,
    _gather(),
    _gather(),
    st.fixed_dictionaries({"op": st.just("sleep"), "seconds": st.sampled_from([1, 3600, 172800])}),
    st.fixed_dictionaries({"op": st.just("fail"), "caught": st.booleans()}),
    st.just({"op": "raise"}),
)


def number_steps(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every step a distinct id s1, s2... in program order."""
    ids = (f"s{n}" for n in itertools.count(1))
    out = []
    for op in ops:
        if op["op"] == "gather":
            op = {**op, "steps": [{**m, "id": next(ids)} for m in op["steps"]]}
        elif op["op"] in ("call", "flaky", "fail"):
            op = {**op, "id": next(ids)}
        out.append(op)
    return out


programs = st.lists(_op, min_size=1, max_size=6).map(number_steps)


@dataclasses.dataclass
class Expected:
    status: str
    output: list[Any] | None
    error_type: str | None
    applied: list[str]
    group: dict[str, int]  # step id -> index of its op (the members of a gather share one)


def expected_outcome(ops: list[dict[str, Any]]) -> Expected:
    """What the program must do, from the program alone (no engine)."""
    applied: list[str] = []
    group: dict[str, int] = {}
    results: list[Any] = []

    def failing(error_type: str) -> Expected:
        status = "compensated" if applied else "failed"
        return Expected(status, None, error_type, applied, group)

    for index, op in enumerate(ops):
        members = op["steps"] if op["op"] == "gather" else [op]
        for m in members:
            if "id" in m:
                group[m["id"]] = index
        if op["op"] == "sleep":
            results.append(None)
        elif op["op"] == "raise":
            return failing("RuntimeError")
        elif op["op"] == "fail" and op["caught"]:
            results.append(f"caught:{op['id']}:card declined for {op['id']}")
        else:
            applied += [m["id"] for m in members if m["op"] != "fail"]
            if any(m["op"] == "fail" for m in members):
                return failing("StepFailedError")
            done = [f"done:{m['id']}" for m in members]
            results.append(done if op["op"] == "gather" else done[0])
    return Expected("completed", results, None, applied, group)


# --- running and observing -------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    status: str
    output: Any
    error: dict[str, Any] | None
    applied: list[str]  # step ids charged, sorted
    undone: list[str]  # step ids refunded, in the order the compensations ran
    commands: list[tuple[str, int | None, str | None]]
    completion_order: list[str]  # step ids in the order the history recorded their completion
    runs: collections.Counter[str]


def observe(env: Harness, ledger: Ledger) -> Outcome:
    run = env.get(RUN_ID)
    events = env.history(RUN_ID)
    check_history(events)
    charged = list(ledger.charges.values())
    assert len(charged) == len(set(charged)), f"a step was charged under two keys: {charged}"
    refunded = [sid for sid, _ in ledger.refunds.values()]
    assert refunded == ledger.refund_order
    assert len(refunded) == len(set(refunded)), f"a step was refunded twice: {refunded}"
    for sid, result in ledger.refunds.values():
        assert result == f"done:{sid}", "a compensation did not receive the step's result"
    sid_at = {e.pos: e.data["args"]["sid"] for e in events if e.kind == h.STEP_SCHEDULED}
    completed = [sid_at[e.pos] for e in events if e.kind == h.STEP_COMPLETED]
    undone_in_history = [sid_at[e.pos] for e in events if e.kind == h.COMPENSATION_COMPLETED]
    assert undone_in_history == ledger.refund_order
    return Outcome(
        status=run.status,
        output=run.output,
        error=run.error,
        applied=sorted(charged),
        undone=list(ledger.refund_order),
        commands=[(e.kind, e.pos, e.name) for e in events if e.kind in h.COMMAND_KINDS],
        completion_order=completed,
        runs=ledger.runs.copy(),
    )


def check_history(events: list[Event]) -> None:
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(events) + 1)), f"seq is not gap-free: {seqs}"
    positions = [e.pos for e in events if e.kind in h.COMMAND_KINDS]
    assert len(positions) == len(set(positions)), f"a command position twice: {positions}"
    for kinds in ({h.STEP_COMPLETED, h.STEP_FAILED}, {h.COMPENSATION_COMPLETED}):
        settled = [e.pos for e in events if e.kind in kinds]
        assert len(settled) == len(set(settled)), f"{sorted(kinds)} recorded twice: {settled}"
    assert events[-1].kind == h.RUN_FINISHED, f"the run did not finish: {events[-1]}"


Hook = Callable[[Harness, int, str, Delivery], None]


@dataclasses.dataclass
class Run:
    outcome: Outcome
    ledger: Ledger
    deliveries: int = 0  # calls of the crash hook
    kills: int = 0  # processes killed (in a step body, or between commit and ack)


def run_program(
    broker: Broker,
    ops: list[dict[str, Any]],
    *,
    hook: Hook | None = None,
    kill_at: frozenset[int] = frozenset(),
) -> Run:
    """Run ``ops`` to the end on a fresh harness and ledger; ``hook(env, n, role, delivery)`` is
    called before the n-th delivery (from 0) and may raise Crash, restart the harness, publish
    the message again or arm a kill."""
    deliveries = itertools.count()
    kills = 0
    with fresh_ledger(kill_at) as (token, ledger):
        env = Harness(app, broker=broker)
        try:
            if hook is not None:
                env.crash_hook = lambda role, d: hook(env, next(deliveries), role, d)
            env.start(interpreter, {"token": token, "ops": ops}, run_id=RUN_ID)
            while True:
                try:
                    env.run_until_idle(max_steps=20_000)
                    break
                except Killed:
                    kills += 1
                    assert kills <= 50, "killed over and over"
                    env.restart()  # the process died: nothing it held in memory survives
            return Run(observe(env, ledger), ledger, next(deliveries), kills)
        finally:
            env.close()


def assert_same_end(base: Outcome, other: Run, expected: Expected) -> None:
    """``other`` ends like ``base``; its step bodies ran again only where a kill interrupted
    them before their attempt was committed (never once a result was in the inbox)."""
    assert_same_outcome(base, other.outcome, expected)
    for key in base.runs.keys() | other.outcome.runs.keys():
        rerun = other.outcome.runs[key] - base.runs[key]
        assert rerun == other.ledger.killed[key], (
            f"{key} ran {other.outcome.runs[key]} times: {base.runs[key]} without "
            f"interruptions, and {other.ledger.killed[key]} of its attempts were killed"
        )


def assert_same_outcome(base: Outcome, other: Outcome, expected: Expected) -> None:
    assert other.status == base.status
    assert other.output == base.output
    assert other.error == base.error
    assert other.applied == base.applied, "effects differ (each must be applied exactly once)"
    assert sorted(other.undone) == sorted(base.undone)
    assert other.commands == base.commands
    # Compensations run newest first: exactly the reverse of the completions this history
    # recorded. Members of one gather may complete in another order once messages are delayed,
    # so across runs the order is compared op by op (all members of a gather share their op).
    for outcome in (base, other):
        if outcome.status == "completed":
            assert outcome.undone == []
        else:
            assert outcome.undone == outcome.completion_order[::-1]
        assert [expected.group[s] for s in outcome.undone] == [
            expected.group[s] for s in base.undone
        ]


def assert_expected(base: Outcome, expected: Expected) -> None:
    assert base.status == expected.status, base
    assert base.output == expected.output
    assert (base.error or {}).get("type") == expected.error_type
    assert base.applied == sorted(expected.applied)
    if expected.status == "completed":
        assert base.undone == []
    else:
        newest_first = sorted((expected.group[s] for s in expected.applied), reverse=True)
        assert [expected.group[s] for s in base.undone] == newest_first


# --- the property ----------------------------------------------------------------------------


def _queue(role: str) -> str:
    return engine_queue(app.name) if role == "engine" else step_queue(app.name, "provider")


def _die_before_ack() -> None:
    raise Killed("killed after the commit, before the acknowledgement")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Interruptions of one run. Deliveries are numbered from 0 in the order they are handed to
    a consumer (redeliveries and duplicates count); step-body invocations likewise."""

    crash: frozenset[int]  # deliveries lost before processing (redelivered after the lease)
    restart: frozenset[int]  # deliveries before which the engine and workers restart
    duplicate: frozenset[int]  # deliveries published a second time (a relay or broker repeat)
    ack_kill: frozenset[int]  # deliveries whose process dies after the commit, before the ack
    kill: frozenset[int]  # step-body invocations killed after their effect, before the commit

    def hook(self, env: Harness, n: int, role: str, delivery: Delivery) -> None:
        if n in self.restart:
            env.restart()
        if n in self.duplicate:
            # a relay or broker repeat: sagaloop's own message, trusted like the original
            env.broker.publish_raw(_queue(role), delivery.body, trusted=True)  # type: ignore[attr-defined]
        if n in self.ack_kill:
            setattr(delivery, "ack", _die_before_ack)  # noqa: B010
        if n in self.crash:
            raise Crash(f"lost delivery {n} ({role})")


@st.composite
def plans(draw: st.DrawFn, ops: list[dict[str, Any]]) -> Plan:
    """Interruptions that fall inside the run: a step takes 2 deliveries (3 more per retry or
    compensation), so indexes are drawn below about 3 deliveries and 2 bodies per step."""
    steps = sum(len(op.get("steps", [op])) for op in ops if op["op"] not in ("sleep", "raise"))
    deliveries = 3 * steps + 2 * len(ops) + 2

    def some(max_size: int, bound: int = deliveries) -> frozenset[int]:
        return draw(st.frozensets(st.integers(0, bound), max_size=max_size))

    return Plan(
        crash=draw(st.frozensets(st.integers(0, deliveries), min_size=1, max_size=4)),
        restart=some(3),
        duplicate=some(2),
        ack_kill=some(2),
        kill=some(3, 2 * steps + 1),
    )


@pytest.mark.parametrize("broker", BROKERS)
@settings(max_examples=30, deadline=None)
@given(ops_and_plan=programs.flatmap(lambda ops: st.tuples(st.just(ops), plans(ops))))
def test_interrupted_program_ends_like_uninterrupted(
    broker: Broker, ops_and_plan: tuple[list[dict[str, Any]], Plan]
) -> None:
    ops, plan = ops_and_plan
    expected = expected_outcome(ops)
    base = run_program(broker, ops).outcome
    assert_expected(base, expected)
    run = run_program(broker, ops, hook=plan.hook, kill_at=plan.kill)
    assert_same_end(base, run, expected)
    event(f"final status: {base.status}")
    for what in ("crash", "restart", "duplicate", "ack_kill"):
        event(f"{what}: {len([n for n in getattr(plan, what) if n < run.deliveries])}")
    event(f"body kills: {run.ledger.killed.total()}")


# --- the same interruptions, one at a time ---------------------------------------------------


def _envelope(delivery: Delivery) -> Envelope:
    return Envelope.from_bytes(delivery.body)


@pytest.mark.parametrize("broker", BROKERS)
def test_crash_on_first_delivery_of_a_step_message(broker: Broker) -> None:
    ops = number_steps([{"op": "call"}, {"op": "call"}, {"op": "fail", "caught": False}])
    base = run_program(broker, ops).outcome

    def hook(env: Harness, n: int, role: str, delivery: Delivery) -> None:
        e = _envelope(delivery)
        if e.type == "step" and e.position == 0 and delivery.deliveries == 1:
            raise Crash("killed after receiving the first step message")

    run = run_program(broker, ops, hook=hook)
    assert_same_end(base, run, expected_outcome(ops))
    assert run.outcome.status == "compensated" and run.outcome.undone == ["s2", "s1"]
    # The lost delivery never ran the body; the redelivery ran it once, knowing it was in doubt.
    assert run.ledger.seen[0] == ("do", "s1", 1, True)
    assert run.ledger.runs["do:s1"] == 1 and run.ledger.charges[f"{RUN_ID}/0/do"] == "s1"


@pytest.mark.parametrize("broker", BROKERS)
def test_crash_on_the_engines_step_result_message(broker: Broker) -> None:
    ops = number_steps([{"op": "call"}, {"op": "flaky", "failures": 1}, {"op": "raise"}])
    base = run_program(broker, ops).outcome
    crashed: list[int] = []

    def hook(env: Harness, n: int, role: str, delivery: Delivery) -> None:
        if role == "engine" and _envelope(delivery).type == "step_result" and not crashed:
            crashed.append(n)
            raise Crash("engine killed before committing the step result")

    run = run_program(broker, ops, hook=hook)
    assert crashed, "no step_result message was seen"
    assert_same_end(base, run, expected_outcome(ops))
    assert run.outcome.status == "compensated" and run.outcome.undone == ["s2", "s1"]
    # The worker had committed its attempt: the redelivered result did not run the step again.
    assert run.ledger.runs == base.runs and run.ledger.runs["do:s1"] == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_restart_in_the_middle_of_a_gather(broker: Broker) -> None:
    gather = {"op": "gather", "ctx": False, "steps": [{"op": "call"}] * 3}
    ops = number_steps([{"op": "call"}, gather, {"op": "sleep", "seconds": 3600}, {"op": "call"}])
    base = run_program(broker, ops).outcome
    results: list[int] = []

    def hook(env: Harness, n: int, role: str, delivery: Delivery) -> None:
        e = _envelope(delivery)
        if e.type == "step_result" and e.position in (1, 2, 3):
            results.append(n)
            if len(results) == 2:  # one member of the gather recorded, two outstanding
                env.restart()

    run = run_program(broker, ops, hook=hook)
    assert len(results) == 3
    assert_same_end(base, run, expected_outcome(ops))
    assert run.outcome.status == "completed"
    assert run.outcome.output == [
        "done:s1",
        ["done:s2", "done:s3", "done:s4"],
        None,
        "done:s5",
    ]


@pytest.mark.parametrize("broker", BROKERS)
def test_kill_after_the_effect_before_the_commit(broker: Broker) -> None:
    gather = {"op": "gather", "ctx": True, "steps": [{"op": "call"}, {"op": "call"}]}
    ops = number_steps([{"op": "call"}, gather, {"op": "raise"}])
    base = run_program(broker, ops).outcome
    # Invocation 0 charges s1; 1 charges s2 and dies before its attempt commits; 2 charges s3;
    # 3 is s2 again (in doubt, same idempotency key); 4-6 refund s3, s2, s1 and 4 dies too.
    run = run_program(broker, ops, kill_at=frozenset({1, 4}))
    assert run.kills == 2
    assert_same_end(base, run, expected_outcome(ops))
    ledger = run.ledger
    assert run.outcome.status == "compensated"
    assert ledger.seen[1] == ("do", "s2", 1, False) and ledger.seen[3] == ("do", "s2", 1, True)
    assert ledger.runs["do:s2"] == 2 and ledger.charges == {
        f"{RUN_ID}/0/do": "s1",
        f"{RUN_ID}/1/do": "s2",
        f"{RUN_ID}/2/do": "s3",
    }
    assert ledger.killed == {"do:s2": 1, f"undo:{run.outcome.undone[0]}": 1}
    assert run.outcome.undone[-1] == "s1" and len(ledger.refunds) == 3


@pytest.mark.parametrize("broker", BROKERS)
def test_duplicated_messages_and_kill_before_ack_run_nothing_twice(broker: Broker) -> None:
    ops = number_steps([{"op": "call"}, {"op": "flaky", "failures": 1}, {"op": "raise"}])
    base = run_program(broker, ops).outcome
    plan = Plan(
        crash=frozenset(),
        restart=frozenset(),
        duplicate=frozenset(range(0, 30, 2)),  # every other message is delivered twice
        ack_kill=frozenset(range(1, 30, 4)),  # memory broker: redelivered after the commit
        kill=frozenset(),
    )
    run = run_program(broker, ops, hook=plan.hook)
    assert_same_end(base, run, expected_outcome(ops))
    assert run.kills == len([n for n in plan.ack_kill if n < run.deliveries])
    # Every repeat found its message in the inbox: no step body ran a second time.
    assert run.ledger.runs == base.runs
