"""``sagaloop demo``: the refund agent of ``examples/refund_agent`` (a Pydantic AI agent run as a
saga) in real processes, killed with SIGKILL at the worst moment, a refund approved by a person,
and the invariants checked from outside the engine.

Everything happens in a fresh temporary folder (removed at the end) on the embedded default
(SQLite); the ``sagaloop dev`` processes are started as children and killed in any case.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import click

import sagaloop
from sagaloop.agents.budgets import USAGE_KEY
from sagaloop.cli.approvals import approvals_text
from sagaloop.cli.render import timeline_text
from sagaloop.client import Client
from sagaloop.client.timeline import Timeline
from sagaloop.engine import history as h
from sagaloop.engine.state import FINAL_STATUSES
from sagaloop.store.sql import SqlStore

ROOT = Path(sagaloop.__file__).resolve().parent.parent
APP_MODULE = "examples.refund_agent.app"
APP_NAME = "refunds"
SAGA = "refund-dispute"
MODEL_STEP = "agent__refunds__model_request"
APPROVER = "maria"
LEASE_S = 2
POLL_S = 0.2
REPLY_DELAY_S = 1.0

DISPUTE_1: dict[str, Any] = {
    "dispute_id": "D-1001",
    "customer_id": "cus_ada",
    "transaction_id": "txn_5001",
    "amount_cents": 12999,
    "reason": "wireless headphones never arrived",
}
DISPUTE_2: dict[str, Any] = {
    "dispute_id": "D-1002",
    "customer_id": "cus_grace",
    "transaction_id": "txn_5002",
    "amount_cents": 2500,
    "reason": "book arrived damaged (ledger-down)",
}
DISPUTE_3: dict[str, Any] = {
    "dispute_id": "D-1003",
    "customer_id": "cus_linus",
    "transaction_id": "txn_5003",
    "amount_cents": 48900,
    "reason": "standing desk arrived broken",
}
REPLY: dict[str, Any] = {
    "message": "The parcel never arrived; tracking stopped at the depot on 4 January."
}
REPLY_3: dict[str, Any] = {"message": "It arrived broken: one leg snapped off in the box."}


class _Refund(Protocol):
    refund_id: str
    reference: str
    amount_cents: int


class _Reversal(_Refund, Protocol):
    reversal_id: str


class _Provider(Protocol):
    """The part of examples/refund_agent/provider.py's PaymentProvider the demo reads."""

    def refunds(self, dispute_id: str | None = None) -> Sequence[_Refund]: ...
    def reversals(self, refund_id: str | None = None) -> Sequence[_Reversal]: ...


class _Mailbox(Protocol):
    def messages(self, dispute_id: str) -> list[str]: ...


class DemoFailed(click.ClickException):
    """The demo could not go on (a process died, a run did not get where it should)."""


def _heading(number: int, title: str) -> None:
    click.echo()
    click.secho(f"[{number}/{SECTIONS}] {title}", bold=True)


SECTIONS = 10


def _say(text: str) -> None:
    click.echo(f"      {text}")


def _indent(text: str, prefix: str = "      | ") -> str:
    return "\n".join(prefix + line if line else prefix.rstrip() for line in text.splitlines())


def _money(cents: int) -> str:
    return f"{cents / 100:.2f}"


class _Demo:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.t0 = time.monotonic()
        self.url = f"sqlite:///{tmp / 'sagaloop.db'}"
        self.provider_db = tmp / "provider.db"
        python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": self.url,
            "SAGALOOP_BROKER_URL": "database",
            "SAGALOOP_LEASE": str(LEASE_S),
            "REFUNDS_PROVIDER_DB": str(self.provider_db),
            "REFUNDS_PROVIDER_IDEMPOTENCY": "off",
            "PYTHONPATH": python_path,
        }
        self.env.pop("SAGALOOP_APP", None)
        self.env.pop("REFUNDS_MODEL", None)
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.store = SqlStore(self.url)
        self.store.upgrade()
        self.client = Client(self.store, APP_NAME)
        provider_module = importlib.import_module("examples.refund_agent.provider")
        self.provider: _Provider = provider_module.PaymentProvider(
            self.provider_db, idempotency=False
        )
        self.mailbox: _Mailbox = provider_module.Mailbox(self.provider_db)
        self.checks: list[tuple[str, bool]] = []

    # --- processes -----------------------------------------------------------------------------

    def start_dev(self, *, hang: bool) -> subprocess.Popen[bytes]:
        env = dict(self.env)
        if hang:
            env["REFUNDS_HANG_AFTER_ACCEPT"] = "1"
        else:
            env.pop("REFUNDS_HANG_AFTER_ACCEPT", None)
        log = self.tmp / f"dev-{len(self.procs) + 1}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sagaloop", "dev", "--app", APP_MODULE, "--poll", "0.05"],
                env=env,
                cwd=self.tmp,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append((proc, log))
        return proc

    def stop_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def _check_alive(self) -> None:
        proc, log = self.procs[-1]
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-20:]
            raise DemoFailed(
                f"the dev process exited with code {proc.returncode}; its last log lines:\n"
                + "\n".join(tail)
            )

    # --- watching a run ------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _line(self, text: str) -> None:
        click.echo(f"  {self.elapsed():6.1f} s  {text}")

    def watch(
        self,
        run_id: str,
        until: Callable[[Timeline], bool],
        what: str,
        *,
        seen: dict[Any, Any],
        timeout: float = 30.0,
    ) -> Timeline:
        """Poll the run's timeline and print one line per change until ``until`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            tl = self.client.status(run_id)
            self._print_changes(run_id, tl, seen)
            if until(tl):
                return tl
            if tl.status in FINAL_STATUSES or tl.status == "needs_attention":
                detail = f": {tl.error.get('message')}" if tl.error else ""
                raise DemoFailed(f"the run ended {tl.status} while waiting for {what}{detail}")
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL_S)

    def _print_changes(self, run_id: str, tl: Timeline, seen: dict[Any, Any]) -> None:
        history = self.client.history(run_id)
        answers = {
            ev.pos: _model_answer(ev.data["result"])
            for ev in history
            if ev.kind == h.STEP_COMPLETED and ev.name == MODEL_STEP
        }
        arrived = {ev.name for ev in history if ev.kind == h.EVENT_ARRIVED}
        rows: list[tuple[int, Any, str]] = []
        for line in tl.steps:
            note = ""
            if line.position in answers:
                note = f"  -> {answers[line.position]}"
            elif line.error and line.state in ("retrying", "failed"):
                note = f"  ({line.error})"
            state = f"{line.state}, {line.compensation}" if line.compensation else line.state
            key = (line.position, line.state, line.compensation)
            rows.append((line.position, key, f"{line.step:<18} {state}{note}"))
        for ev in history:
            if ev.kind == h.EVENT_WAITING and ev.pos is not None and ev.name:
                label, done, what = "wait_for_event", "event arrived", ev.name
                prompt = ev.data.get("prompt")
                if ev.name.startswith("approval:") and isinstance(prompt, dict):
                    label, done = "approval", "answered"
                    what = f"{prompt.get('approve')} (call {ev.name.partition(':')[2]})"
                state = done if ev.name in arrived else "waiting"
                rows.append((ev.pos, (ev.pos, state), f"{label:<18} {state}: {what}"))
        for pos, key, text in sorted(rows, key=lambda r: r[0]):
            if key not in seen:
                seen[key] = True
                self._line(f"#{pos:<2} {text}")
        if ("status", tl.status) not in seen:
            seen["status", tl.status] = True
            self._line(f"run is {tl.status}")

    # --- checks --------------------------------------------------------------------------------

    def check(self, what: str, ok: bool) -> None:
        self.checks.append((what, ok))

    def ledger_text(self, dispute_id: str) -> str:
        lines = []
        for r in self.provider.refunds(dispute_id):
            money = _money(r.amount_cents)
            lines.append(f"refund    {r.refund_id}  {money:>7}  reference {r.reference}")
            for v in self.provider.reversals(r.refund_id):
                lines.append(
                    f"reversal  {v.reversal_id}  {_money(v.amount_cents):>7}  reference "
                    f"{v.reference} (reverses {r.refund_id})"
                )
        return "\n".join(lines) or "(no refunds)"


def _model_answer(result: Any) -> str:
    """What a recorded model response says, in one line: the tools it calls (or the output it
    gives: ask_customer, close) and its words."""
    parts = result.get("response", {}).get("parts", []) if isinstance(result, dict) else []
    words = " ".join(p["content"] for p in parts if p.get("part_kind") == "text").strip()
    calls = []
    for part in parts:
        if part.get("part_kind") == "tool-call":
            args = part.get("args")
            if isinstance(args, str):
                with contextlib.suppress(ValueError):
                    args = json.loads(args)
            outcome = args.get("outcome") if isinstance(args, dict) else None
            calls.append(f"{part['tool_name']} {outcome}" if outcome else part["tool_name"])
    return f"{', '.join(calls) or 'answers'}: {words}" if words else ", ".join(calls)


def _step(tl: Timeline, name: str) -> Any:
    return next((s for s in tl.steps if s.step == name), None)


def _run_demo(demo: _Demo) -> None:
    c = demo.client
    click.secho("sagaloop demo: an AI refund agent that survives kill -9", bold=True)
    _say(f"working folder {demo.tmp} (removed at the end)")
    _say(f"store {demo.url} (the embedded default: SQLite, no services)")
    _say("the agent is a Pydantic AI agent wrapped in SagaAgent: each model request and each")
    _say("tool call is a step of the run. Its model is an offline policy (a FunctionModel;")
    _say("REFUNDS_MODEL=openai:gpt-5 would ask a real one).")
    _say("the payment provider is a local fake with its own SQLite file, run WITHOUT idempotency")
    _say("keys: only sagaloop's reconcile can stop a second refund after a crash.")

    _heading(1, "Start `sagaloop dev` and a dispute")
    demo.start_dev(hang=True)
    _say(f"$ sagaloop dev --app {APP_MODULE}      (pid {demo.procs[-1][0].pid})")
    _say("  with REFUNDS_HANG_AFTER_ACCEPT=1: issue_refund will hang right after the provider")
    _say("  accepts the refund, so that we can kill the process at the worst moment")
    run1 = c.start(SAGA, DISPUTE_1, run_id="dispute-D-1001")
    _say(f"$ sagaloop start {SAGA} --run-id {run1} --input '{{...}}'")
    _say(
        f"  dispute D-1001: customer cus_ada wants {_money(DISPUTE_1['amount_cents'])} back: "
        f"{DISPUTE_1['reason']!r}"
    )

    _heading(2, "The agent works: each step as the timeline records it")
    _say(f"each model request is the step {MODEL_STEP}, numbered as `sagaloop status` does:")
    _say("its answer is recorded and never asked again; the tools it calls are the app's steps")
    seen1: dict[Any, Any] = {}
    tl = demo.watch(
        run1,
        lambda t: t.status == "waiting" and any("customer-reply" in w for w in t.waiting_for),
        "the run to wait for the customer's reply",
        seen=seen1,
    )

    _heading(3, "The run waits for the customer's reply")
    for w in tl.waiting_for:
        _say(f"why it waits: {w}")
    _say("the agent answered ask_customer; the saga sent the question and called")
    _say("ctx.wait_for_event('customer-reply', timeout=timedelta(days=2)).")
    _say("The timeout is a durable timer row: no process, thread or memory holds the run while")
    _say("it waits. We do not wait two days: we simulate the customer answering early by")
    _say(f"sending the event after {REPLY_DELAY_S:.0f} s.")
    time.sleep(REPLY_DELAY_S)
    c.send_event(run1, "customer-reply", REPLY)
    _say(f"$ sagaloop send-event {run1} customer-reply --data '{{\"message\": ...}}'")
    _say(f"  customer: {REPLY['message']!r}")

    def accepted(t: Timeline) -> bool:
        return bool(demo.provider.refunds("D-1001"))

    tl = demo.watch(run1, accepted, "the provider to accept the refund", seen=seen1)

    _heading(4, "SIGKILL at the worst moment")
    [refund] = demo.provider.refunds("D-1001")
    line = _step(tl, "issue_refund")
    before_state = line.state if line else "?"
    proc = demo.procs[-1][0]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _say(
        f"the provider's database shows refund {refund.refund_id} "
        f"({_money(refund.amount_cents)}) accepted,"
    )
    _say(f"while sagaloop's history still has issue_refund {before_state!r}: its result was")
    _say("never recorded. Now:")
    _say(f"$ kill -9 {proc.pid}      (exit code {proc.returncode})")
    demo.check(
        "dispute 1: the kill hit after the provider accepted and before the result was recorded",
        before_state in ("scheduled", "in doubt") and proc.returncode == -signal.SIGKILL,
    )
    for w in c.status(run1).waiting_for:
        _say(f"why it waits now: {w}")

    _heading(5, "A new `sagaloop dev` picks the run up")
    demo.start_dev(hang=False)
    _say(f"$ sagaloop dev --app {APP_MODULE}      (pid {demo.procs[-1][0].pid}, no hang)")
    _say(f"the killed attempt's message was leased for {LEASE_S} s (SAGALOOP_LEASE); when the")
    _say("lease expires it is delivered again, the attempt is in doubt, and the worker calls the")
    _say("step's reconcile (find_refund) before anything else: the refund it finds is recorded")
    _say("as the step's result, and issue_refund does not run a second time.")
    tl = demo.watch(run1, lambda t: t.status in FINAL_STATUSES, "dispute 1 to finish", seen=seen1)

    _heading(6, "Dispute 1: the timeline, and the provider's books")
    click.echo(_indent(timeline_text(tl)))
    click.echo()
    _say("payment provider, dispute D-1001:")
    click.echo(_indent(demo.ledger_text("D-1001")))
    _say("messages to the customer:")
    click.echo(_indent("\n".join(demo.mailbox.messages("D-1001")) or "(none)"))
    refunds1 = demo.provider.refunds("D-1001")
    line = _step(tl, "issue_refund")
    output = tl.output if isinstance(tl.output, dict) else {}
    demo.check("dispute 1: the run completed with outcome 'refunded'", tl.status == "completed")
    demo.check("dispute 1: exactly one refund at the provider", len(refunds1) == 1)
    demo.check(
        "dispute 1: issue_refund was reconciled, not issued again",
        line is not None and line.state == "reconciled",
    )
    demo.check(
        "dispute 1: the run's result names the provider's refund",
        output.get("outcome") == "refunded"
        and len(refunds1) == 1
        and output.get("refund_id") == refunds1[0].refund_id,
    )
    demo.check("dispute 1: no reversal", not demo.provider.reversals(refund.refund_id))

    _heading(7, "Dispute 2: the ledger refuses the posting, the refund is reversed")
    run2 = c.start(SAGA, DISPUTE_2, run_id="dispute-D-1002")
    _say(f"$ sagaloop start {SAGA} --run-id {run2} --input '{{...}}'")
    _say(
        f"  dispute D-1002: customer cus_grace wants {_money(DISPUTE_2['amount_cents'])} back: "
        f"{DISPUTE_2['reason']!r}"
    )
    _say("below 50.00 the rules need no statement, so the agent refunds at once and closes the")
    _say("dispute; then the ledger refuses the saga's posting for good (ApplicationError(...,")
    _say("non_retryable=True)), the saga fails, and the engine runs issue_refund's compensation,")
    _say("reverse_refund.")
    seen2: dict[Any, Any] = {}
    tl2 = demo.watch(run2, lambda t: t.status in FINAL_STATUSES, "dispute 2 to finish", seen=seen2)
    click.echo()
    click.echo(_indent(timeline_text(tl2)))
    click.echo()
    _say("payment provider, dispute D-1002:")
    click.echo(_indent(demo.ledger_text("D-1002")))
    refunds2 = demo.provider.refunds("D-1002")
    reversals2 = [v for r in refunds2 for v in demo.provider.reversals(r.refund_id)]
    demo.check("dispute 2: the run ended 'compensated'", tl2.status == "compensated")
    demo.check(
        "dispute 2: one refund and exactly one reversal of it",
        len(refunds2) == 1
        and len(reversals2) == 1
        and reversals2[0].refund_id == refunds2[0].refund_id,
    )
    line2 = _step(tl2, "issue_refund")
    demo.check(
        "dispute 2: the timeline shows issue_refund compensated",
        line2 is not None and line2.compensation == "compensated",
    )

    _heading(8, "Dispute 3: a refund above 200.00 waits for a person's approval")
    run3 = c.start(SAGA, DISPUTE_3, run_id="dispute-D-1003")
    _say(f"$ sagaloop start {SAGA} --run-id {run3} --input '{{...}}'")
    _say(
        f"  dispute D-1003: customer cus_linus wants {_money(DISPUTE_3['amount_cents'])} back: "
        f"{DISPUTE_3['reason']!r}"
    )
    _say("above 50.00 the rules want the customer's statement (this time the customer answers")
    _say("at once); above 200.00 a person approves the refund: the only tool that takes such an")
    _say("amount is issue_large_refund, given to the model with step_as_tool(issue_large_refund,")
    _say("requires_approval=True).")
    seen3: dict[Any, Any] = {}
    demo.watch(
        run3,
        lambda t: any("customer-reply" in w for w in t.waiting_for),
        "dispute 3 to wait for the customer's reply",
        seen=seen3,
    )
    c.send_event(run3, "customer-reply", REPLY_3)
    _say(f"$ sagaloop send-event {run3} customer-reply --data '{{\"message\": ...}}'")
    _say(f"  customer: {REPLY_3['message']!r}")
    demo.watch(run3, lambda t: bool(c.approvals(run3)), "dispute 3 to ask for approval", seen=seen3)
    _say("the model called issue_large_refund: the run waits for a person's answer")
    _say("(ctx.approval, a durable wait: no process is held). What a person sees and types:")
    pending = c.approvals(run3)
    _say("$ sagaloop approvals")
    click.echo(_indent(approvals_text(pending)))
    [request] = pending
    _say(f"asked: {request.action} {json.dumps(request.args)}")
    _say(f"why, in the model's words: {request.reason}")
    refunds_before = len(demo.provider.refunds("D-1003"))
    c.approve(run3, request.call_id, by=APPROVER)
    _say(f"$ sagaloop approve {run3} {request.call_id} --by {APPROVER}")
    _say(f"  approved: run {run3}, call {request.call_id}")
    tl3 = demo.watch(run3, lambda t: t.status in FINAL_STATUSES, "dispute 3 to finish", seen=seen3)
    click.echo()
    _say("payment provider, dispute D-1003:")
    click.echo(_indent(demo.ledger_text("D-1003")))
    refunds3 = demo.provider.refunds("D-1003")
    record = c.get_published(run3, f"approval:{request.call_id}")
    output3 = tl3.output if isinstance(tl3.output, dict) else {}
    demo.check(
        f"dispute 3: one approval asked, and approved once, by {APPROVER}",
        len(pending) == 1
        and isinstance(record, dict)
        and record.get("status") == "approved"
        and record.get("by") == APPROVER
        and not c.approvals(run3),
    )
    demo.check(
        "dispute 3: no refund before the approval, exactly one after it",
        refunds_before == 0 and len(refunds3) == 1,
    )
    demo.check(
        "dispute 3: the run completed 'refunded' with the provider's refund",
        tl3.status == "completed"
        and output3.get("outcome") == "refunded"
        and len(refunds3) == 1
        and output3.get("refund_id") == refunds3[0].refund_id,
    )

    _heading(9, "What each run used of its budget")
    _say("SagaAgent(..., budget=Budget(requests=20, on_exceed='wait')): a run that reaches it")
    _say("waits for a person to raise it. The adapter counts usage from the recorded model")
    _say("responses (a replay never counts twice) and publishes it (`sagaloop status` shows it):")
    for number, run_id in enumerate((run1, run2, run3), start=1):
        usage = c.get_published(run_id, USAGE_KEY)
        usage = usage if isinstance(usage, dict) else {}
        limit = (usage.get("budget") or {}).get("requests")
        requests = usage.get("requests")
        recorded = sum(
            1 for ev in c.history(run_id) if ev.kind == h.STEP_COMPLETED and ev.name == MODEL_STEP
        )
        _say(
            f"{run_id}  model requests {requests} of {limit}, tokens "
            f"{usage.get('input_tokens')} in / {usage.get('output_tokens')} out"
        )
        demo.check(
            f"dispute {number}: {recorded} model requests, as the history records them, "
            f"within the budget of {limit}",
            requests == recorded and isinstance(limit, int) and recorded <= limit,
        )


@click.command()
@click.option("--keep", is_flag=True, help="Keep the temporary folder (databases, logs).")
def demo(keep: bool) -> None:
    """Run the refund agent in real processes, kill one with SIGKILL at the worst moment, and
    check from the payment provider's books that the refund happened exactly once; then a
    refund reversed, and one approved by a person (about 10 s; leaves nothing behind)."""
    if not (ROOT / "examples" / "refund_agent" / "app.py").exists():
        raise click.ClickException(
            f"the demo runs examples/refund_agent from a sagaloop checkout, not found under "
            f"{ROOT}: run it from the repository (`make demo`)"
        )
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))  # this checkout's examples, not another `examples`
    tmp = Path(tempfile.mkdtemp(prefix="sagaloop-demo-"))
    demo_: _Demo | None = None
    try:
        demo_ = _Demo(tmp)
        try:
            _run_demo(demo_)
        finally:
            demo_.stop_all()
        _summary(demo_)
    finally:
        if demo_ is not None:
            demo_.store.close()
        if keep:
            click.echo(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _summary(demo_: _Demo) -> None:
    _heading(10, "Invariants, checked from outside the engine")
    for what, ok in demo_.checks:
        click.echo(f"      {'ok    ' if ok else 'FAILED'}  {what}")
    alive = [p.pid for p, _ in demo_.procs if p.poll() is None]
    click.echo(f"      {'ok    ' if not alive else 'FAILED'}  no process left running")
    failed = sum(not ok for _, ok in demo_.checks) + bool(alive)
    click.echo()
    if failed:
        raise click.ClickException(f"{failed} invariant(s) did not hold")
    click.echo(
        f"All {len(demo_.checks) + 1} invariants hold ({demo_.elapsed():.1f} s). One refund, "
        "issued once, despite kill -9; the failed dispute's refund reversed; the large refund "
        "issued once, after a person approved it."
    )
