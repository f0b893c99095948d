"""The broker contract suite: the behaviour every :class:`~sagaloop.engine.ports.Broker` must
show, written once and run against each implementation (memory, database, and yours).

Run it by subclassing :class:`BrokerContract` in a test module under a name that starts with
``Test`` and providing a ``harness`` fixture that returns a fresh :class:`BrokerUnderTest` for
each test::

    import pytest
    from sagaloop.testing import VirtualClock
    from sagaloop.testing.contracts import BrokerContract, BrokerUnderTest

    class TestMyBroker(BrokerContract):
        @pytest.fixture
        def harness(self, tmp_path):
            clock = VirtualClock()
            lease = timedelta(seconds=30)
            store = SqlStore("sqlite:///" + str(tmp_path / "db.sqlite"))
            store.upgrade()
            broker = MyBroker(..., clock=clock, lease=lease)
            yield BrokerUnderTest(
                broker=broker,
                clock=clock,
                lease=lease,
                store=store,
                dead_letters=lambda: my_dead_letters(broker),
                reopen=lambda: MyBroker(..., clock=clock, lease=lease),  # or None
            )
            broker.close()
            store.close()

The fixture interface (:class:`BrokerUnderTest`):

``broker``
    The broker under test, fresh for each test (or at least with no message on any queue whose
    name starts with ``contract-``; every test uses new, randomly named queues).
``clock``
    The :class:`~sagaloop.testing.VirtualClock` the broker computes leases and delays from. The
    tests move it forward; nothing else should.
``lease``
    The lease the broker was built with: an unacknowledged delivery is redelivered once the
    clock has moved past it.
``store``
    A :class:`~sagaloop.store.sql.SqlStore` (schema upgraded) whose transactions the tests pass
    to ``Delivery.settle``. For a broker that settles in the database this must be the store
    the broker uses.
``dead_letters``
    Returns every dead letter so far as ``(queue, body, reason)`` tuples, oldest first.
``reopen``
    Builds another broker over the same durable storage (as a restarted process would), or
    None when the broker is not durable; the durability test is skipped then. Brokers it
    returns are closed by the test; anything else it opens is the fixture's to clean up.

Time: leases and ``retry_later`` delays are measured on the virtual clock, while the
``timeout`` of ``receive`` is in real seconds. A test waits at most :attr:`wait_timeout` real
seconds for a message that must arrive and :attr:`quiet_timeout` for one that must not;
override them in the subclass for a broker on a remote server.

A consumer consumes the canonical way: it settles the delivery inside a committed store
transaction, then acks it (``with store.transaction() as tx: d.settle(tx)`` then ``d.ack()``).
A broker that settles in the database does its work in ``settle`` (which raises a
:class:`~sagaloop.errors.BrokerError` when the lease was lost); one that does not, in ``ack``.

The assertions carry their own messages, so the suite reads well without pytest's assertion
rewriting; call ``pytest.register_assert_rewrite("sagaloop.testing.contracts")`` in a
``conftest.py`` for more detail.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta

from sagaloop.brokers.dead_letters import UNSIGNED_MARK, DeadLetter, DeadLetters
from sagaloop.engine.ports import Broker, Delivery
from sagaloop.errors import BrokerError
from sagaloop.store.sql import SqlStore
from sagaloop.testing.harness import VirtualClock

__all__ = ["BrokerContract", "BrokerUnderTest", "receive_exactly"]


@dataclasses.dataclass
class BrokerUnderTest:
    """What a ``harness`` fixture gives the contract tests (see the module docstring)."""

    broker: Broker
    clock: VirtualClock
    lease: timedelta
    store: SqlStore
    dead_letters: Callable[[], list[tuple[str, bytes, str]]]
    reopen: Callable[[], Broker] | None = None

    @property
    def margin(self) -> timedelta:
        """How far short of, or past, a deadline the tests move the clock."""
        return min(self.lease / 10, timedelta(seconds=1))


class _Rollback(Exception):
    """Raised inside a store transaction to roll it back."""


def receive_exactly(
    broker: Broker, queues: Sequence[str], n: int, timeout: float, *, max_messages: int = 10
) -> list[Delivery]:
    """Exactly ``n`` deliveries from ``queues``, received in as many calls as needed; fails
    (AssertionError) if fewer come within ``timeout`` seconds, or a call returns more than it
    was asked for."""
    out: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"expected {n} deliveries, got {len(out)} in time"
        batch = broker.receive(queues, min(max_messages, n - len(out)), remaining)
        assert len(batch) <= n - len(out), "receive returned more than max_messages"
        out.extend(batch)
    return out


class BrokerContract:
    """The contract tests. Subclass it as ``TestXxx`` and provide a ``harness`` fixture."""

    wait_timeout: float = 5.0
    """Real seconds to wait for a message that must arrive."""
    quiet_timeout: float = 0.05
    """Real seconds to wait for a message that must not arrive."""

    # --- helpers -----------------------------------------------------------------------------

    @staticmethod
    def queues(h: BrokerUnderTest, n: int = 1) -> list[str]:
        """``n`` new queues, declared on the broker."""
        names = [f"contract-{uuid.uuid4().hex[:12]}-{i}" for i in range(n)]
        h.broker.declare(names)
        return names

    def receive(
        self, h: BrokerUnderTest, queues: Sequence[str], n: int, *, max_messages: int = 10
    ) -> list[Delivery]:
        """Exactly ``n`` deliveries (:func:`receive_exactly`, within ``wait_timeout``)."""
        return receive_exactly(h.broker, queues, n, self.wait_timeout, max_messages=max_messages)

    def receive_one(self, h: BrokerUnderTest, queue: str) -> Delivery:
        return self.receive(h, [queue], 1)[0]

    def assert_quiet(self, h: BrokerUnderTest, queues: Sequence[str], why: str) -> None:
        got = h.broker.receive(queues, 10, self.quiet_timeout)
        bodies = [d.body for d in got]
        assert got == [], f"{why}, but received {bodies!r}"

    def leased(self, h: BrokerUnderTest, body: bytes = b"m") -> tuple[str, Delivery]:
        """A new queue with one message, published and received (so leased)."""
        (q,) = self.queues(h)
        h.broker.publish([(q, body)])
        return q, self.receive_one(h, q)

    def back_after(
        self,
        h: BrokerUnderTest,
        q: str,
        after: timedelta,
        body: bytes,
        deliveries: int | None = None,
        *,
        quiet_before: str | None = None,
    ) -> Delivery:
        """Move the clock ``after`` and a margin on: ``body`` comes back from ``q`` (as its
        delivery number ``deliveries``, when given). With ``quiet_before``, first check that
        nothing comes back a margin short of ``after`` (the message saying why)."""
        if quiet_before is None:
            h.clock.advance(after + h.margin)
        else:
            h.clock.advance(after - h.margin)
            self.assert_quiet(h, [q], quiet_before)
            h.clock.advance(2 * h.margin)
        d = self.receive_one(h, q)
        assert d.body == body, f"{d.body!r} came back, not {body!r}"
        if deliveries is not None:
            assert d.deliveries == deliveries, f"delivery counted {d.deliveries}, not {deliveries}"
        return d

    def assert_quiet_past_lease(self, h: BrokerUnderTest, queues: Sequence[str], why: str) -> None:
        """Past the lease, nothing comes from ``queues``."""
        h.clock.advance(h.lease + h.margin)
        self.assert_quiet(h, queues, why)

    @staticmethod
    def consume(h: BrokerUnderTest, d: Delivery) -> None:
        """Settle in a committed transaction, then ack (the canonical way)."""
        with h.store.transaction() as tx:
            d.settle(tx)
        d.ack()

    # --- publish and receive -----------------------------------------------------------------

    def test_publish_then_receive_preserves_body(self, harness: BrokerUnderTest) -> None:
        h = harness
        (q,) = self.queues(h)
        bodies = [b'{"type":"step"}', bytes(range(256)), b" padded\r\n", "caf\u00e9".encode()]
        h.broker.publish([(q, b) for b in bodies])
        got = self.receive(h, [q], len(bodies))
        assert sorted(d.body for d in got) == sorted(bodies), "bodies changed on the way"
        assert all(isinstance(d.body, bytes) for d in got), "a body is not bytes"
        assert [d.deliveries for d in got] == [1] * len(bodies), "first delivery must count 1"
        for d in got:
            self.consume(h, d)

    def test_fifo_within_a_queue(self, harness: BrokerUnderTest) -> None:
        h = harness
        (q,) = self.queues(h)
        bodies = [f"m{i:02}".encode() for i in range(12)]
        for b in bodies[:4]:  # one publish per message, then one batch
            h.broker.publish([(q, b)])
        h.broker.publish([(q, b) for b in bodies[4:]])
        got: list[bytes] = []
        for _ in bodies:
            d = self.receive_one(h, q)
            got.append(d.body)
            self.consume(h, d)
        assert got == bodies, f"out of order: {got!r}"

    def test_max_messages_is_honoured(self, harness: BrokerUnderTest) -> None:
        h = harness
        (q,) = self.queues(h)
        bodies = [f"m{i}".encode() for i in range(5)]
        h.broker.publish([(q, b) for b in bodies])
        first = self.receive(h, [q], 1, max_messages=1)
        batch = h.broker.receive([q], 2, self.wait_timeout)
        assert 1 <= len(batch) <= 2, f"asked for at most 2, got {len(batch)}"
        rest = self.receive(h, [q], len(bodies) - 1 - len(batch))
        got = first + batch + rest
        assert sorted(d.body for d in got) == bodies, "messages lost or duplicated"
        for d in got:
            self.consume(h, d)
        self.assert_quiet(h, [q], "every message was consumed")

    def test_receive_returns_empty_after_timeout(self, harness: BrokerUnderTest) -> None:
        h = harness
        (q,) = self.queues(h)
        start = time.monotonic()
        got = h.broker.receive([q], 10, 0.05)
        elapsed = time.monotonic() - start
        assert got == [], f"an empty queue gave {[d.body for d in got]!r}"
        assert elapsed < 1.0, f"receive(timeout=0.05) took {elapsed:.2f} s"

    def test_receive_wakes_up_for_a_message_published_while_waiting(
        self, harness: BrokerUnderTest
    ) -> None:
        h = harness
        (q,) = self.queues(h)
        timer = threading.Timer(0.05, h.broker.publish, args=([(q, b"late")],))
        timer.start()
        try:
            start = time.monotonic()
            got = h.broker.receive([q], 10, self.wait_timeout)
            elapsed = time.monotonic() - start
        finally:
            timer.join()
        assert [d.body for d in got] == [b"late"], "the message published during the wait"
        assert elapsed < self.wait_timeout, "receive waited out its timeout despite a message"
        self.consume(h, got[0])

    def test_queues_are_isolated(self, harness: BrokerUnderTest) -> None:
        h = harness
        qa, qb, qc = self.queues(h, 3)
        h.broker.publish([(qa, b"a1"), (qb, b"b1"), (qa, b"a2"), (qb, b"b2")])
        from_a = self.receive(h, [qa], 2)
        assert sorted(d.body for d in from_a) == [b"a1", b"a2"], "queue a gave another's message"
        self.assert_quiet(h, [qa, qc], "queue a is drained and queue c never had a message")
        from_b = self.receive(h, [qb], 2)
        assert sorted(d.body for d in from_b) == [b"b1", b"b2"], "queue b gave another's message"
        for d in from_a + from_b:
            self.consume(h, d)

    # --- leases, acks and settling -----------------------------------------------------------

    def test_unacked_delivery_is_redelivered_after_the_lease(
        self, harness: BrokerUnderTest
    ) -> None:
        q, first = self.leased(harness)
        assert first.deliveries == 1
        self.assert_quiet(harness, [q], "the message is leased")
        quiet = "the lease has not expired yet"
        again = self.back_after(harness, q, harness.lease, b"m", 2, quiet_before=quiet)
        self.consume(harness, again)

    def test_ack_after_settle_removes_the_message_for_good(self, harness: BrokerUnderTest) -> None:
        h = harness
        (q,) = self.queues(h)
        h.broker.publish([(q, b"done"), (q, b"kept")])
        done, kept = self.receive(h, [q], 2)
        assert (done.body, kept.body) == (b"done", b"kept")
        self.consume(h, done)
        self.consume(h, self.back_after(h, q, h.lease, b"kept"))  # and not b"done": it was consumed
        self.assert_quiet_past_lease(h, [q], "both messages were consumed")

    def test_settle_in_a_rolled_back_transaction_keeps_the_message(
        self, harness: BrokerUnderTest
    ) -> None:
        h = harness
        q, first = self.leased(h)
        try:
            with h.store.transaction() as tx:
                first.settle(tx)
                raise _Rollback
        except _Rollback:
            pass
        # no ack: the processing did not commit
        self.assert_quiet(h, [q], "the lease has not expired yet")
        self.consume(h, self.back_after(h, q, h.lease, b"m", 2))
        self.assert_quiet_past_lease(h, [q], "the redelivered message was consumed")

    def test_retry_later_brings_the_message_back_after_the_delay(
        self, harness: BrokerUnderTest
    ) -> None:
        h = harness
        q, d = self.leased(h)
        quiet = "the retry delay has not passed yet"

        short = h.lease / 2  # back before the lease would have expired
        d.retry_later(short)
        self.assert_quiet(h, [q], "retry_later must wait for its delay")
        d = self.back_after(h, q, short, b"m", 2, quiet_before=quiet)

        long = 2 * h.lease  # not back when the lease would have expired
        d.retry_later(long)
        self.assert_quiet_past_lease(h, [q], "the retry delay is longer than the lease")
        d = self.back_after(h, q, long - h.lease - h.margin, b"m", 3, quiet_before=quiet)
        self.consume(h, d)

    def test_dead_letter_removes_and_records_the_reason(self, harness: BrokerUnderTest) -> None:
        h = harness
        before = len(h.dead_letters())
        body = b"\x00not json"
        q, d = self.leased(h, body)
        d.dead_letter("not JSON: poison")
        dead = h.dead_letters()
        assert dead[before:] == [(q, body, "not JSON: poison")], f"dead letters: {dead!r}"
        self.assert_quiet_past_lease(h, [q], "the message was dead-lettered")

    def _stale_consume(self, h: BrokerUnderTest, stale: Delivery) -> None:
        """Consume a delivery whose lease was lost: settle may refuse with a BrokerError (and
        roll the transaction back); the ack after it must then be ignored."""
        try:
            with h.store.transaction() as tx:
                stale.settle(tx)
        except BrokerError:
            pass
        stale.ack()

    def _lose_lease(self, h: BrokerUnderTest) -> tuple[str, Delivery, Delivery]:
        """A new queue whose one message was leased (``stale``), then leased again past the
        lease (``current``)."""
        q, stale = self.leased(h)
        return q, stale, self.back_after(h, q, h.lease, b"m", 2)

    def test_stale_ack_leaves_the_new_claim_in_place(self, harness: BrokerUnderTest) -> None:
        h = harness
        q, stale, _current = self._lose_lease(h)
        self._stale_consume(h, stale)
        self.assert_quiet(h, [q], "the second consumer still holds the message")
        # The second consumer dies too: the message must still exist (the stale ack did not
        # delete it) and come back.
        self.consume(h, self.back_after(h, q, h.lease, b"m", 3))

    def test_stale_ack_does_not_break_the_new_consumers_ack(self, harness: BrokerUnderTest) -> None:
        h = harness
        q, stale, current = self._lose_lease(h)
        self._stale_consume(h, stale)
        self.consume(h, current)  # must not raise: this consumer holds the lease
        self.assert_quiet_past_lease(h, [q], "the second consumer consumed the message")

    # --- managing dead letters (DeadLetters) -------------------------------------------------

    def test_dead_letters_are_listed_resent_and_purged(self, harness: BrokerUnderTest) -> None:
        """For a broker that implements :class:`~sagaloop.brokers.dead_letters.DeadLetters`:
        ids that stay put while others go, a resend that delivers the body unchanged to its
        queue with the trust it had (a public message may gain it: its trust is unused), and
        purges. A purge of all runs only when the test's dead letters were the only ones."""
        h = harness
        broker = h.broker
        if not isinstance(broker, DeadLetters):
            import pytest

            pytest.skip("the broker does not implement DeadLetters")
        (q,) = self.queues(h)
        before = {d.id for d in broker.list_dead_letters()}
        bodies = [
            b'{"type":"event","run_id":"contract-r0","message_id":"contract-m0"}',
            b'{"type":"step","run_id":"contract-r1","message_id":"contract-m1"}',
            b"\x00not json",
            b'{"type":"event","run_id":"contract-r3","message_id":"contract-m3"}',
        ]
        reasons = [
            "contract: no such saga",
            f"step message 'contract-m1' {UNSIGNED_MARK} (contract)",
            "not JSON: contract",
            "contract: no such run",
        ]
        h.broker.publish([(q, b) for b in bodies])
        got = self.receive(h, [q], len(bodies))
        assert [d.body for d in got] == bodies, "out of order"
        trusted = [d.trusted for d in got]
        for d, reason in zip(got, reasons, strict=True):
            d.dead_letter(reason)

        def mine() -> list[DeadLetter]:
            return [d for d in broker.list_dead_letters() if d.id not in before]

        letters = mine()
        listed = [(d.queue, d.body, d.reason) for d in letters]
        assert listed == list(zip([q] * 4, bodies, reasons, strict=True)), f"listed {listed!r}"
        assert len({d.id for d in letters}) == 4 and all(d.id for d in letters), "ids not unique"
        assert all(d.at is not None for d in letters), "a dead letter has no time"
        described = [(d.message_id, d.message_type, d.run_id, d.size) for d in letters[:2]]
        assert described == [
            ("contract-m0", "event", "contract-r0", len(bodies[0])),
            ("contract-m1", "step", "contract-r1", len(bodies[1])),
        ], described
        assert broker.find_dead_letter(letters[2].id) == letters[2], "find by id"
        assert broker.find_dead_letter("contract-no-such-id") is None
        assert broker.count_dead_letters() == len(before) + 4

        resent = broker.resend_dead_letters([letters[0].id, letters[1].id])
        assert [d.id for d in resent] == [letters[0].id, letters[1].id], "resent other ones"
        back = self.receive(h, [q], 2)
        assert [d.body for d in back] == bodies[:2], "the resent bodies, unchanged"
        assert back[0].trusted or not trusted[0], "a resent message lost its trust"
        assert back[1].trusted == trusted[1], "an internal message changed its trust"
        for d in back:
            self.consume(h, d)
        assert [d.id for d in mine()] == [letters[2].id, letters[3].id], "ids changed"
        assert broker.resend_dead_letters(["contract-no-such-id"]) == []

        assert broker.purge_dead_letters([letters[2].id]) == 1
        assert [d.id for d in mine()] == [letters[3].id]
        if before:
            assert broker.purge_dead_letters([letters[3].id]) == 1
        else:
            assert broker.purge_dead_letters() == 1
            assert broker.list_dead_letters() == [] and broker.count_dead_letters() == 0
        self.assert_quiet_past_lease(h, [q], "only the resent dead letters came back")

    # --- durability and concurrency ----------------------------------------------------------

    def test_unacked_message_survives_a_reopen(self, harness: BrokerUnderTest) -> None:
        h = harness
        if h.reopen is None:
            import pytest

            pytest.skip("the broker is not durable (reopen is None)")
        (q,) = self.queues(h)
        h.broker.publish([(q, b"in-flight"), (q, b"waiting")])
        in_flight = self.receive(h, [q], 1, max_messages=1)[0]
        assert in_flight.body == b"in-flight"
        # The process dies without acking; another one starts over the same storage.
        other = h.reopen()
        try:
            other.declare([q])
            waiting = other.receive([q], 10, self.wait_timeout)
            assert [d.body for d in waiting] == [b"waiting"], "the unclaimed message, once"
            assert waiting[0].deliveries == 1
            self.consume(h, waiting[0])
            h.clock.advance(h.lease + h.margin)
            again = other.receive([q], 10, self.wait_timeout)
            assert [d.body for d in again] == [b"in-flight"], "the leased message after expiry"
            assert again[0].deliveries == 2, f"redelivery counted {again[0].deliveries}, not 2"
            self.consume(h, again[0])
            h.clock.advance(h.lease + h.margin)
            gone = other.receive([q], 10, self.quiet_timeout)
            assert gone == [], "both messages were consumed"
        finally:
            other.close()

    def test_two_threads_receive_every_message_exactly_once(self, harness: BrokerUnderTest) -> None:
        h = harness
        (q,) = self.queues(h)
        bodies = [f"m{i:03}".encode() for i in range(200)]
        received: list[tuple[bytes, int]] = []
        errors: list[BaseException] = []
        lock = threading.Lock()
        deadline = time.monotonic() + 4 * self.wait_timeout

        def consumer() -> None:
            try:
                while time.monotonic() < deadline:
                    with lock:
                        if len(received) >= len(bodies) or errors:
                            return
                    for d in h.broker.receive([q], 10, 0.05):
                        self.consume(h, d)
                        with lock:
                            received.append((d.body, d.deliveries))
            except BaseException as e:
                with lock:
                    errors.append(e)

        threads = [threading.Thread(target=consumer, name=f"consumer-{i}") for i in range(2)]
        for t in threads:
            t.start()
        for i in range(0, len(bodies), 50):  # published while the consumers run
            h.broker.publish([(q, b) for b in bodies[i : i + 50]])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        got = sorted(b for b, _ in received)
        duplicates = len(got) - len(set(got))
        assert duplicates == 0, f"{duplicates} messages were received twice"
        assert got == bodies, f"{len(bodies) - len(got)} messages were not received in time"
        assert {n for _, n in received} == {1}, "a message was redelivered within its lease"
        self.assert_quiet_past_lease(h, [q], "every message was consumed")
