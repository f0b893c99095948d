"""The in-process lane of an app (see ``sagaloop.runtime.local``): the outbox rows of its
``local=True`` steps, served by its engine processes from the database, whatever the broker.

The lane is the database broker's hand-over (``sagaloop.brokers.database``) applied to one
queue whose rows are always held (``DatabaseBroker.hold``), with its own lease and look cadence:

- **hand-over** (the hot path): the store writes a row already claimed by the process that
  committed it (for ``LOCAL_LEASE``, renewed while the step runs) and hands it to the lane in
  memory after the commit; a commit wakes one of the lane's threads (``SqlCore.nudge``). A row
  held past half its lease (every thread busy) has its claim extended when it is taken, as
  the broker's rows have: dropping it would leave the step to wait out its claim;
- **recovery**: the lane claims from the database the rows nobody holds (their engine died and
  their claim ran out or a takeover released it, or they were given back), looking at most
  every ``poll`` seconds (at least ``LOOK_EVERY``), one thread at a time, and at once when a
  commit of this process gave rows back.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta

from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine.messages import local_queue
from sagaloop.engine.ports import Clock, Handoff, QueuedMessage
from sagaloop.store.sql import SqlStore

LOCAL_LEASE = timedelta(seconds=15)
"""How long an in-process step's row stays claimed by the engine running it (renewed every
third of it while the step runs): how long the step of an engine that died waits before another
engine of the app runs it again."""


LOOK_EVERY = 1.0
"""The least time between two looks of an engine at the database for in-process steps."""


class LocalLane(DatabaseBroker):
    """The in-process lane of an app as a queue: a database broker that holds every row of
    ``queue`` this process writes (rows handed over in memory first, else rows claimed from
    the database, looked for every ``poll`` seconds, at least ``LOOK_EVERY``, by one of the
    threads). What differs from the app's broker is only its queue, its lease and its
    cadence."""

    def __init__(
        self,
        store: SqlStore,
        app: str,
        *,
        clock: Clock | None = None,
        lease: timedelta = LOCAL_LEASE,
        poll: float = 0.1,
    ) -> None:
        # Rows are handed over at once; the database holds only those of a dead engine (or
        # given back), which wait for their claim to run out anyway: no need to look often.
        self.queue = local_queue(app)
        poll_interval = max(poll, LOOK_EVERY)
        super().__init__(
            store, lease=lease, clock=clock, poll_interval=poll_interval, hold=[self.queue]
        )


class Handoffs:
    """What the store hands over after a commit, split by queue: the in-process lane's rows to
    the lane (claimed for its lease), the others to the relay, or, without a relay, to the
    database broker (``broker``: the store's own, whose consumers in this process take the rows
    of the queues they wait on; rows of other queues are written unclaimed, for any process)."""

    def __init__(
        self,
        lane: LocalLane | None,
        relay: Handoff | None,
        *,
        owner: str | None = None,
        broker: DatabaseBroker | None = None,
    ) -> None:
        self.lane = lane
        self.relay = relay
        self.broker = broker if relay is None else None
        fresh = f"{owner}.{uuid.uuid4().hex}" if owner else uuid.uuid4().hex
        self.token = relay.token if relay is not None else fresh

    def lease_for(self, queue: str) -> timedelta | None:
        if self.lane is not None and queue == self.lane.queue:
            return self.lane.lease_for(queue)  # always its lease: the lane holds its rows
        if self.relay is not None:
            return self.relay.lease_for(queue)
        return self.broker.lease_for(queue) if self.broker is not None else None

    def take(self, rows: Sequence[QueuedMessage]) -> None:
        lane = self.lane.queue if self.lane is not None else None
        local = [r for r in rows if r.queue == lane]
        if local and self.lane is not None:
            self.lane.take(local)
        if len(local) < len(rows):
            others = self.relay if self.relay is not None else self.broker
            if others is not None:
                others.take([r for r in rows if r.queue != lane])
