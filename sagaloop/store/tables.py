"""The tables, as SQLAlchemy Core. Payloads (inputs, results, LLM transcripts) are JSON text
kept out of every index."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Dialect,
    Double,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    text,
)
from sqlalchemy import DateTime as _DateTime


class UTCDateTime(TypeDecorator[datetime]):
    # Aware UTC datetimes in, aware UTC datetimes out, on every dialect.

    impl = _DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to sagaloop's store")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class JSONText(TypeDecorator[Any]):
    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        return None if value is None else json.dumps(value, separators=(",", ":"))

    def process_result_value(self, value: str | None, dialect: Dialect) -> Any:
        return None if value is None else json.loads(value)


metadata = MetaData()
ID = String(200)
BigId = BigInteger().with_variant(Integer, "sqlite")

schema_version = Table(
    "sagaloop_schema",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("version", Integer, nullable=False),
)

runs = Table(
    "sagaloop_runs",
    metadata,
    Column("run_id", ID, primary_key=True),
    Column("app", ID, nullable=False),
    Column("saga", ID, nullable=False),
    Column("status", String(32), nullable=False),
    Column("input", JSONText),
    Column("output", JSONText),
    Column("error", JSONText),
    Column("reason", Text),
    Column("last_seq", Integer, nullable=False, default=0),
    Column("processed_seq", Integer, nullable=False, default=0),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Index("sagaloop_runs_status", "status", "updated_at"),
    Index("sagaloop_runs_saga", "saga", "status"),
    # the start backlog (processed_seq = 0) and the runs an engine's start window counts
    Index("sagaloop_runs_app", "app", "status", "processed_seq"),
    # the runs listing's orders and keyset cursors, and its live poll's max(updated_at)
    Index("sagaloop_runs_updated", "updated_at", "run_id"),
    Index("sagaloop_runs_created", "created_at", "run_id"),
)
# the listing's run id prefix search (LIKE 'prefix%') whatever the database's collation
Index(
    "sagaloop_runs_id_pattern", runs.c.run_id, postgresql_ops={"run_id": "varchar_pattern_ops"}
).ddl_if(dialect="postgresql")

history = Table(
    "sagaloop_history",
    metadata,
    Column("run_id", ID, primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("kind", String(40), nullable=False),
    Column("pos", Integer),
    Column("name", ID),
    Column("data", JSONText, nullable=False),
    Column("at", UTCDateTime, nullable=False),
)

timers = Table(
    "sagaloop_timers",
    metadata,
    # The app of the run: an engine fires only its own app's timers.
    Column("app", ID, nullable=False, server_default=""),
    Column("run_id", ID, primary_key=True),
    Column("pos", Integer, primary_key=True, autoincrement=False),
    Column("kind", String(16), primary_key=True),
    Column("fire_at", UTCDateTime, nullable=False),
    Column("attempt", Integer, nullable=False, default=0),
    Index("sagaloop_timers_due", "app", "fire_at"),
)

schedules = Table(
    "sagaloop_schedules",
    metadata,
    # A schedule of an app: declared in code (``origin`` 'code', written by its engines) or
    # added at run time ('cli'). ``next_tick`` is the next tick to fire: stored, so that an
    # engine that was down catches up on what it missed.
    Column("app", ID, primary_key=True),
    Column("name", ID, primary_key=True),
    Column("saga", ID, nullable=False),
    Column("spec", String(300), nullable=False),
    Column("input", JSONText),
    Column("catch_up", String(16), nullable=False),
    Column("paused", Boolean, nullable=False, default=False),
    Column("origin", String(16), nullable=False),
    Column("next_tick", UTCDateTime, nullable=False),
    Column("last_tick", UTCDateTime),
    Column("last_run_id", ID),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("note", Text),  # why it was paused (version 11)
)

outbox = Table(
    "sagaloop_outbox",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("queue", ID, nullable=False),
    Column("message_id", ID, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("available_at", UTCDateTime, nullable=False),
    Column("claimed_until", UTCDateTime),
    Column("claim_token", String(64)),
    Column("deliveries", Integer, nullable=False, default=0),
    Column("created_at", UTCDateTime, nullable=False),
    Index("sagaloop_outbox_ready", "queue", "available_at"),
)

inbox = Table(
    "sagaloop_inbox",
    metadata,
    Column("consumer", String(100), primary_key=True),
    Column("message_id", ID, primary_key=True),
    Column("result", JSONText),
    Column("at", UTCDateTime, nullable=False),
    Index("sagaloop_inbox_at", "at"),
)

dead_letters = Table(
    "sagaloop_dead_letters",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("queue", ID, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("reason", Text, nullable=False),
    Column("at", UTCDateTime, nullable=False),
)


payloads = Table(
    "sagaloop_payloads",
    metadata,
    Column("run_id", ID, primary_key=True),
    # sha256 of the value's JSON text: the reference that messages and history carry.
    Column("hash", String(64), primary_key=True),
    # The JSON text, zlib-compressed.
    Column("data", LargeBinary, nullable=False),
    # Bytes of the JSON text before compression.
    Column("size", BigId, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)
"""Large values (step arguments and results, saga inputs and outputs, event data) of a run,
kept out of messages and history rows; deleted with their run."""

secrets = Table(
    "sagaloop_secrets",
    metadata,
    Column("name", String(100), primary_key=True),
    Column("value", LargeBinary, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)
"""Secrets that sagaloop's processes share through the database (the key that signs internal
messages on a broker outside the database)."""

processes = Table(
    "sagaloop_processes",
    metadata,
    # ``role@host:pid``.
    Column("name", ID, primary_key=True),
    Column("app", ID, nullable=False),
    Column("role", String(32), nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    # Refreshed every few seconds while the process runs.
    Column("seen_at", UTCDateTime, nullable=False),
    # Why the process is unhealthy (a dead consumer thread, a stalled activation), or NULL.
    Column("problem", Text),
    Column("stopped_at", UTCDateTime),
    # The attempts it abandoned past their timeouts whose threads still run (JSON list of
    # {step, run_id, position, attempt, since}), or NULL: no problem, but worth knowing.
    Column("abandoned", JSONText),
    # The queues it consumes (JSON list of full names: ``<app>.engine``, ``<app>.steps.<q>``,
    # ``<app>/local``), and those its app declares for steps (what some process must consume).
    Column("queues", JSONText),
    Column("app_queues", JSONText),
    # Starts the claim token of every outbox row it claims (``<token>.<random>``): a dead
    # process's claims are released by this prefix. NULL once they were taken over.
    Column("token", String(64)),
    # Where it runs, to prove it dead: {hostname, machine, pid, start} (``runtime.takeover``).
    Column("host", JSONText),
)
"""The services that run (or ran recently): what ``sagaloop health`` reports on."""

rate_limits = Table(
    "sagaloop_rate_limits",
    metadata,
    Column("key", ID, primary_key=True),
    # The earliest start the next reservation may get, in seconds since the epoch (UTC).
    Column("next_free", Double, nullable=False),
)
"""One row per rate-limit key: the "next free slot" of a GCRA limiter with no burst (see
``limits.py``)."""

rate_holds = Table(
    "sagaloop_rate_holds",
    metadata,
    # The inbox key of the step message that was given back to its queue.
    Column("message_id", ID, primary_key=True),
    Column("key", ID, nullable=False),
    # The start slot it holds, in seconds since the epoch.
    Column("slot", Double, nullable=False),
    # Whether an earlier delivery may have run the attempt (carried to the next delivery).
    Column("in_doubt", Boolean, nullable=False),
    # How often the message was given back for its rate limit, in all.
    Column("give_backs", Integer, nullable=False),
    # 0 when given back; each delivery that takes the hold adds 1 (1: it follows a give-back).
    Column("turn", Integer, nullable=False),
    Column("at", UTCDateTime, nullable=False),
)
"""The slots that rate-limited step messages hold while given back to their queue."""

APPROVALS_OPEN = "status IN ('escalated', 'pending')"
"""The open approvals (``sagas.approvals.OPEN_STATUSES``, sorted), as SQL: the predicate of
``sagaloop_approvals_page``, which a query repeats word for word to use it."""

approvals = Table(
    "sagaloop_approvals",
    metadata,
    Column("run_id", ID, primary_key=True),
    Column("call_id", ID, primary_key=True),
    Column("app", ID, nullable=False),
    Column("saga", ID, nullable=False),
    # pending, escalated, approved, denied or expired: the status the run last published.
    Column("status", String(16), nullable=False),
    # The request as the run last published it (sagas.approvals.ApprovalRequest).
    Column("request", JSONText, nullable=False),
    # Random, made when the request is first recorded: an answer names it, so no answer can
    # be written before its request exists.
    Column("request_id", String(64), nullable=False),
    Column("requested_at", UTCDateTime, nullable=False),
    # The message id of the answer that won (one per request), and what it said.
    Column("answer_id", ID),
    Column("answer", JSONText),
    Column("updated_at", UTCDateTime, nullable=False),
    # The open ones (a page of them, and the console's poll), in the order they are listed:
    # read in order, never sorted. Partial: the statuses are literals in its predicate and in
    # the query (``status IN (...)`` over several values cannot give ``requested_at``'s order).
    Index(
        "sagaloop_approvals_page",
        "app",
        "requested_at",
        "run_id",
        "call_id",
        postgresql_where=text(APPROVALS_OPEN),
        sqlite_where=text(APPROVALS_OPEN),
    ),
)
"""The approvals runs asked for (``ctx.approval``), written in the activation's transaction
that published them: the pending ones are listed page by page from here, and an answer claims
its request here, so that one answer wins even while no engine runs."""

concurrency_slots = Table(
    "sagaloop_concurrency_slots",
    metadata,
    Column("app", ID, primary_key=True),
    Column("saga", ID, primary_key=True),
    Column("key", ID, primary_key=True),
    # 0 .. limit - 1: the primary key lets one run hold each slot; a second claimant's insert
    # writes nothing and its activation is prepared again.
    Column("slot", Integer, primary_key=True),
    Column("run_id", ID, nullable=False, unique=True),
    Column("claimed_at", UTCDateTime, nullable=False),
)
"""The slots of run-concurrency keys (``@app.saga(concurrency=...)``): claimed in the
transaction that starts the run's saga code, released in the one that records its end."""

concurrency_waiters = Table(
    "sagaloop_concurrency_waiters",
    metadata,
    # The order in which the runs joined the queue: it breaks ties of ``started_at``.
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("run_id", ID, nullable=False, unique=True),
    Column("app", ID, nullable=False),
    Column("saga", ID, nullable=False),
    Column("key", ID, nullable=False),
    # When the run was started (its run's created_at): the queue's order.
    Column("started_at", UTCDateTime, nullable=False),
    Index("sagaloop_concurrency_waiters_key", "app", "saga", "key", "started_at", "id"),
)
"""The runs queued for a slot of their key (``at_limit="queue"``): recorded, their saga code
not started."""

subscriptions = Table(
    "sagaloop_subscriptions",
    metadata,
    Column("app", ID, primary_key=True),
    Column("name", ID, primary_key=True),
    # The event's key, or "" for every key of the name (a key is 1 to 200 characters).
    Column("key", ID, primary_key=True),
    Column("run_id", ID, primary_key=True),
    Index("sagaloop_subscriptions_run", "run_id"),
)
"""Which runs a published event reaches (``Client.publish_event``): a row per run and
``(name, key)`` it subscribed to (``ctx.subscribe``) or waits on (``ctx.wait_for_event(name,
key=..., match=...)``), written in the transaction that records the subscription or the wait
and deleted in the one that ends it (the run's end deletes all of its rows)."""
debounced = Table(
    "sagaloop_debounced",
    metadata,
    # The open window of a debounced saga's key: the run it will start (its id chosen by the
    # window's first start), with the last start's input, at ``due_at``. ``starts`` counts the
    # starts it gathered: the engine that starts the run deletes the row only as it read it.
    Column("app", ID, primary_key=True),
    Column("saga", ID, primary_key=True),
    Column("key", ID, primary_key=True),
    Column("run_id", ID, nullable=False, unique=True),
    Column("input", JSONText),
    Column("first_at", UTCDateTime, nullable=False),
    Column("last_at", UTCDateTime, nullable=False),
    Column("due_at", UTCDateTime, nullable=False),
    Column("starts", Integer, nullable=False),
    Index("sagaloop_debounced_due", "app", "due_at"),
)
"""The debounced starts not yet started as a run (``@app.saga(debounce=...)``)."""
