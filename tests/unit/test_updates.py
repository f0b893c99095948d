"""Updates (``ctx.on_update``, ``Client.update``): a message whose handler's result or error is
answered to its sender; a validator that refuses it before anything is recorded; applied at
most once per ``update_id`` and answered the same on every send, also after the run continued
as new; refused by a run that ended; replayed deterministically."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from pydantic import BaseModel

from sagaloop import App, SagaContext, StepContext, UpdateFailedError, UpdateRefusedError
from sagaloop.cli.main import cli
from sagaloop.engine import history as h
from sagaloop.engine.messages import engine_queue
from sagaloop.engine.updates import CARRIED
from sagaloop.errors import NonDeterminismError, ValidationError
from sagaloop.testing import Harness, replay

DAY = timedelta(days=1)


class Deposit(BaseModel):
    amount: int


app = App("updates")


@app.step()
def fetch_rate(ctx: StepContext, currency: str) -> float:
    return {"EUR": 1.5, "GBP": 2.0}[currency]


@app.saga(name="account")
async def account(ctx: SagaContext) -> dict[str, Any]:
    balance = [0]
    closed: list[bool] = []
    lock = asyncio.Lock()

    def not_negative(d: Deposit) -> None:
        if d.amount <= 0:
            raise ValueError(f"a deposit is positive, not {d.amount}")

    def deposit(d: Deposit) -> int:
        balance[0] += d.amount
        return balance[0]

    def withdraw(amount: int) -> int:
        if amount > balance[0]:
            raise RuntimeError(f"insufficient funds: {balance[0]} < {amount}")
        balance[0] -= amount
        return balance[0]

    async def deposit_foreign(d: dict[str, Any]) -> int:
        async with lock:
            rate = await ctx.call(fetch_rate, d["currency"])
            balance[0] += int(d["amount"] * rate)
            return balance[0]

    def close(_: Any) -> str:
        closed.append(True)
        return "closing"

    ctx.on_update("deposit", deposit, validator=not_negative, model=Deposit)
    ctx.on_update("withdraw", withdraw)
    ctx.on_update("deposit_foreign", deposit_foreign)
    ctx.on_update("close", close)
    await ctx.wait_condition(lambda: bool(closed) and ctx.all_handlers_finished())
    return {"balance": balance[0]}


@pytest.fixture(params=[False, True], ids=["replay", "cache"])
def env(request: pytest.FixtureRequest) -> Harness:
    return Harness(app, cache=request.param)


def kinds(env: Harness, run_id: str) -> list[str]:
    return [e.kind for e in env.history(run_id) if e.kind.startswith("update_")]


def test_update_returns_what_its_handler_returned(env: Harness) -> None:
    run_id = env.start(account)
    env.run_until_idle()
    assert env.update(run_id, "deposit", {"amount": 10}) == 10
    assert env.update(run_id, "deposit", {"amount": 5}) == 15
    assert env.update(run_id, "deposit_foreign", {"currency": "EUR", "amount": 10}) == 30
    assert env.update(run_id, "withdraw", 20) == 10
    assert env.update(run_id, "close") == "closing"
    env.run_until_idle()
    assert env.result(run_id) == {"balance": 10}
    assert kinds(env, run_id) == ["update_accepted", "update_completed"] * 5
    replay(app, env.history(run_id), run_id=run_id)


def test_a_validator_refuses_before_anything_is_recorded(env: Harness) -> None:
    run_id = env.start(account)
    env.run_until_idle()
    with pytest.raises(UpdateRefusedError, match="a deposit is positive, not -3") as e:
        env.update(run_id, "deposit", {"amount": -3})
    assert e.value.error.type == "ValueError"
    with pytest.raises(UpdateRefusedError, match="amount"):  # does not fit the model
        env.update(run_id, "deposit", {"amount": "lots"})
    assert kinds(env, run_id) == ["update_refused", "update_refused"]
    assert env.update(run_id, "deposit", {"amount": 4}) == 4  # nothing was applied
    env.update(run_id, "close")
    env.run_until_idle()
    assert env.result(run_id) == {"balance": 4}
    replay(app, env.history(run_id), run_id=run_id)


def test_a_handler_that_raises_fails_the_update_not_the_run(env: Harness) -> None:
    run_id = env.start(account)
    env.run_until_idle()
    with pytest.raises(UpdateFailedError, match="insufficient funds: 0 < 7") as e:
        env.update(run_id, "withdraw", 7)
    assert not isinstance(e.value, UpdateRefusedError)
    error = e.value
    assert (error.error.type, error.run_id, error.name) == ("RuntimeError", run_id, "withdraw")
    # an async handler whose step fails for good, after its retries (time moves on)
    sent = env.send_update(run_id, "deposit_foreign", {"currency": "XXX", "amount": 1})
    env.run_until_idle()
    with pytest.raises(UpdateFailedError, match="KeyError") as e:
        env.update(run_id, "deposit_foreign", update_id=sent)
    assert e.value.error.type == "StepFailedError"
    assert env.update(run_id, "deposit", {"amount": 2}) == 2
    env.update(run_id, "close")
    env.run_until_idle()
    assert env.result(run_id) == {"balance": 2}


def test_an_update_without_a_handler_is_refused(env: Harness) -> None:
    run_id = env.start(account)
    env.run_until_idle()
    with pytest.raises(UpdateRefusedError, match="no handler for update 'rename'"):
        env.update(run_id, "rename", "x")


def test_the_same_update_id_is_applied_once_and_answered_the_same(env: Harness) -> None:
    run_id = env.start(account)
    env.run_until_idle()
    assert env.update(run_id, "deposit", {"amount": 10}, update_id="d-1") == 10
    assert env.update(run_id, "deposit", {"amount": 10}, update_id="d-1") == 10
    # sent twice before the engine took either (a client that timed out and retried)
    env.send_update(run_id, "deposit", {"amount": 1}, update_id="d-2")
    env.send_update(run_id, "deposit", {"amount": 1}, update_id="d-2")
    assert env.update(run_id, "deposit", {"amount": 1}, update_id="d-2") == 11
    with pytest.raises(UpdateFailedError, match="insufficient"):
        env.update(run_id, "withdraw", 50, update_id="w-1")
    with pytest.raises(UpdateFailedError, match="insufficient"):  # the same answer
        env.update(run_id, "withdraw", 50, update_id="w-1")
    assert kinds(env, run_id) == ["update_accepted", "update_completed"] * 3
    env.update(run_id, "close")
    env.run_until_idle()
    assert env.result(run_id) == {"balance": 11}


def test_a_duplicate_that_reaches_the_engine_as_another_message_is_ignored(
    env: Harness,
) -> None:
    """Another message id (a publisher that chose its own) with an update id already
    accepted: the run's state, not only the inbox, keeps it from being applied twice."""
    run_id = env.start(account)
    env.run_until_idle()
    env.queues = [engine_queue(app.name)]  # the step of the handler waits
    env.send_update(run_id, "deposit_foreign", {"currency": "GBP", "amount": 3}, update_id="f")
    env.run_until_idle()
    env.client._send(
        env.client._message(
            "update",
            run_id,
            {"name": "deposit_foreign", "data": {"currency": "GBP", "amount": 3}, "update_id": "f"},
            message_id="another",
        ),
        live=True,
    )
    env.run_until_idle()
    assert (
        "answering update 'f': its handler runs (ctx.on_update)" in env.status(run_id).waiting_for
    )
    env.queues = None
    assert env.update(run_id, "deposit_foreign", update_id="f") == 6
    assert not any("answering" in line for line in env.status(run_id).waiting_for)
    assert kinds(env, run_id) == ["update_accepted", "update_completed"]


def test_an_update_to_a_finished_run_is_refused(env: Harness) -> None:
    run_id = env.start(account)
    env.run_until_idle()
    assert env.update(run_id, "deposit", {"amount": 1}, update_id="before") == 1
    env.update(run_id, "close")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    with pytest.raises(UpdateRefusedError, match=r"the run has ended \(completed\)"):
        env.update(run_id, "deposit", {"amount": 1})
    assert env.update(run_id, "deposit", {"amount": 1}, update_id="before") == 1  # answered


def test_an_update_to_a_cancelled_run_is_refused(env: Harness) -> None:
    run_id = env.start(account)
    env.run_until_idle()
    env.cancel(run_id)
    env.run_until_idle()
    with pytest.raises(UpdateRefusedError, match="has ended"):
        env.update(run_id, "deposit", {"amount": 1})


def test_a_validator_that_issues_a_command_refuses_the_update() -> None:
    bad = App("updates-bad-validator")

    @bad.saga(name="s")
    async def s(ctx: SagaContext) -> None:
        def publish(value: Any) -> None:
            if value == 1:
                ctx.publish("seen", value)

        ctx.on_update("u", lambda v: v, validator=publish)
        await ctx.sleep(DAY)

    env = Harness(bad)
    run_id = env.start(s)
    env.run_until_idle(skip_time=False)
    with pytest.raises(UpdateRefusedError, match="validator of update 'u' issued a command"):
        env.update(run_id, "u", 1)
    assert env.update(run_id, "u", 2) == 2
    assert env.get_published(run_id, "seen") is None
    env.run_until_idle()
    replay(bad, env.history(run_id), run_id=run_id)


def test_registration_is_checked() -> None:
    bad = App("updates-registration")

    async def validator(v: Any) -> None:
        pass

    @bad.saga(name="twice")
    async def twice(ctx: SagaContext) -> None:
        ctx.on_update("u", lambda v: v)
        ctx.on_update("u", lambda v: v)

    @bad.saga(name="async-validator")
    async def async_validator(ctx: SagaContext) -> None:
        ctx.on_update("u", lambda v: v, validator=validator)

    env = Harness(bad)
    for saga, match in ((twice, "already has a handler"), (async_validator, "not async")):
        run_id = env.start(saga)
        env.run_until_idle()
        assert env.get(run_id).status == "failed"
        assert match in str(env.get(run_id).error)
    with pytest.raises(ValidationError, match="update name"):
        env.update(run_id, "", 1)


looper = App("updates-continue-as-new")


@looper.saga(name="counter")
async def counter(ctx: SagaContext, total: int) -> int:
    state = {"total": total, "adds": 0}

    def add(n: int) -> int:
        state["total"] += n
        state["adds"] += 1
        return state["total"]

    ctx.on_update("add", add)
    ctx.on_update("stop", lambda _: state.update(adds=-1))
    await ctx.wait_condition(lambda: state["adds"] != 0)
    if state["adds"] > 0:
        ctx.continue_as_new(state["total"])
    return state["total"]


@pytest.mark.parametrize("cache", [False, True], ids=["replay", "cache"])
def test_answers_survive_continue_as_new(cache: bool) -> None:
    env = Harness(looper, cache=cache)
    run_id = env.start(counter, 0)
    env.run_until_idle()
    assert env.update(run_id, "add", 5, update_id="a") == 5
    env.run_until_idle()  # continued as new
    started = [e for e in env.history(run_id) if e.kind == h.RUN_STARTED]
    assert started[0].data["epoch"] == 1 and started[0].data["updates"] == {"a": {"result": 5}}
    assert env.update(run_id, "add", 5, update_id="a") == 5  # answered, not applied again
    assert env.update(run_id, "add", 2, update_id="b") == 7
    env.run_until_idle()
    assert env.update(run_id, "add", 5, update_id="a") == 5  # still, two histories later
    env.update(run_id, "stop")
    env.run_until_idle()
    assert env.result(run_id) == 7


def test_only_the_latest_answers_are_carried() -> None:
    from sagaloop.engine.state import RunState
    from sagaloop.engine.updates import carried

    st = RunState("r")
    st.updates = {str(i): {"result": i} for i in range(CARRIED + 5)}
    st.updates["running"] = None
    kept = carried(st)
    assert len(kept) == CARRIED and "0" not in kept and "5" not in kept and "6" in kept
    assert kept["running"]["error"]["type"] == "UpdateAbandoned"


slow = App("updates-slow-handler")


@slow.saga(name="s")
async def slow_saga(ctx: SagaContext) -> None:
    async def wait_a_day(_: Any) -> str:
        await ctx.sleep(DAY)
        return "waited"

    ctx.on_update("wait", wait_a_day)
    await ctx.sleep(7 * DAY)


@pytest.mark.parametrize("cache", [False, True], ids=["replay", "cache"])
def test_an_update_whose_run_ends_before_its_handler_does_fails(cache: bool) -> None:
    env = Harness(slow, cache=cache)
    run_id = env.start(slow_saga)
    env.run_until_idle(skip_time=False)
    update_id = env.send_update(run_id, "wait")
    env.run_until_idle(skip_time=False)
    env.cancel(run_id)
    env.run_until_idle(skip_time=False)
    with pytest.raises(UpdateFailedError, match=r"the run ended \(cancelled\)") as e:
        env.update(run_id, "wait", update_id=update_id)
    assert not isinstance(e.value, UpdateRefusedError)  # it was accepted: maybe applied


def test_a_replay_without_the_handler_of_an_accepted_update_is_refused() -> None:
    env = Harness(app)
    run_id = env.start(account)
    env.run_until_idle()
    env.update(run_id, "withdraw", 0)
    history = env.history(run_id)
    changed = App("updates")  # the same saga, its withdraw handler removed

    @changed.saga(name="account")
    async def account_changed(ctx: SagaContext) -> None:
        ctx.on_update("deposit", lambda d: d)
        await ctx.wait_condition(lambda: False)

    with pytest.raises(NonDeterminismError, match="update 'withdraw' accepted"):
        replay(changed, history, run_id=run_id)
    replay(app, history, run_id=run_id)  # the code that recorded it replays


def test_the_cli_sends_an_update_and_prints_its_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)
    env = Harness(app, url=url)
    run_id = env.start(account)
    env.run_until_idle()
    assert env.update(run_id, "deposit", {"amount": 3}, update_id="d") == 3
    with pytest.raises(UpdateFailedError):
        env.update(run_id, "withdraw", 9, update_id="w")

    def cli_update(*args: str) -> Result:
        return CliRunner().invoke(cli, ["update", run_id, *args], catch_exceptions=False)

    answered = cli_update("deposit", "--data", '{"amount": 3}', "--update-id", "d")
    assert (answered.exit_code, answered.output) == (0, "3\n")  # read, not applied again
    failed = cli_update("withdraw", "--data", "9", "--update-id", "w")
    assert failed.exit_code == 1 and "insufficient funds: 3 < 9" in failed.output
    waiting = cli_update("deposit", "--data", '{"amount": 1}', "--timeout", "0")
    assert waiting.exit_code == 1 and "no answer yet" in waiting.output
    env.clock.set(datetime.now(UTC))  # the CLI queued it at the real time: due now
    assert env.update(run_id, "close") == "closing"
    env.run_until_idle()
    refused = cli_update("deposit", "--data", '{"amount": 1}')
    assert refused.exit_code == 1 and "was refused" in refused.output
    assert env.result(run_id) == {"balance": 4}  # the update left waiting was applied
