"""The hot path's writes (the store's ``RunStore.write_checkpoint``): on PostgreSQL, one
statement.

A message's transaction writes its inbox row, its run's conditional update, the run's new
events and the messages it sends. Sent one by one that is four round trips, and four times
SQLAlchemy's cost of executing a statement. On PostgreSQL they are one statement of writable
CTEs, each part guarded by the one before (``WHERE EXISTS`` on its ``RETURNING``), so a
duplicate still writes nothing and a conflict writes no run, and the result says which: the
inbox insert's row count and the update's are returned. A run that does not exist yet (a
start no client recorded: ``Checkpoint.create``) is inserted instead of updated, under the same
guard; a row of its id is a conflict. Its text is fixed (its values travel
as one JSON parameter), so psycopg prepares it once per connection, and it runs below
SQLAlchemy's statement layer, on the transaction's own driver connection (``core.driver_row``:
through ``exec_driver_sql`` while anything listens to SQLAlchemy's events). As a
lone transaction's commit (``transaction(lone=True)``) it must commit all of its block or
nothing of it: ``_FUSED_LONE`` aborts where it would write a part, and runs again in a usual
transaction, whose caller rolls back what it must (a conflict, a lost lease). Large
values go to the payload table first, as each separate write does. Elsewhere (SQLite) the same
writes are the separate calls.

Two deletes of claimed rows ride in the same statement, unguarded (they do not depend on the
checkpoint's outcome; a conflict rolls the transaction back anyway):

- the published rows a relay left pending (``delete_later``): a busy process's checkpoints
  carry them, so its relay seldom needs a transaction of its own to delete them; if the
  transaction does not commit they are pending again (``SqlCore.transaction``);
- the rows the transaction settled before its checkpoint (``settle_claimed``, the message
  being processed: an in-process step's lane row). The statement returns the ids it deleted;
  a row no longer claimed with its token raises the settle's ``lost`` (the lease was lost),
  before anything else is said of the checkpoint. A settle no statement carried (SQLite, a
  plan written by separate calls, a settle after the checkpoint) is deleted at the commit
  (``core.flush_settles``), with the same rule.

Inside a savepoint (a transactional step's attempt, rolled back when a copy of its message
stored its reply first) the statement carries neither: rolling the savepoint back would undo
deletes the transaction counts as made.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy.exc import DBAPIError

from sagaloop.engine.history import number
from sagaloop.engine.ports import Checkpoint, RunRecord, RunStore, Written
from sagaloop.store import payloads
from sagaloop.store.core import Settle, SqlTx, conn_of, driver_row, lone_statement, reopen
from sagaloop.store.inbox import SqlInbox
from sagaloop.store.queue import SqlOutbox, inserted
from sagaloop.store.runs import SqlRuns

_FUSED = """\
WITH p AS (
  SELECT j->>'consumer' AS consumer, j->>'message_id' AS message_id, j->>'result' AS result,
    (j->>'now')::timestamptz AS now, j->>'run_id' AS run_id, (j->>'base_seq')::int AS base_seq,
    j->>'status' AS status, j->>'output' AS output, j->>'error' AS error, j->>'reason' AS reason,
    (j->>'last_seq')::int AS last_seq, (j->>'processed_seq')::int AS processed_seq,
    (j->>'updated_at')::timestamptz AS updated_at, (j->>'events_at')::timestamptz AS events_at,
    j->'events' AS events, j->'messages' AS messages, j->'published' AS published,
    j->'settles' AS settles, j->>'app' AS app, j->>'saga' AS saga, j->>'input' AS input,
    (j->>'created_at')::timestamptz AS created_at
  FROM (SELECT %(p)s::json AS j) AS d
), i AS (
  INSERT INTO sagaloop_inbox (consumer, message_id, result, at)
  SELECT consumer, message_id, result, now FROM p WHERE consumer IS NOT NULL
  ON CONFLICT DO NOTHING RETURNING 1
), c AS (
  INSERT INTO sagaloop_runs (run_id, app, saga, status, input, output, error, reason,
    last_seq, processed_seq, created_at, updated_at)
  SELECT run_id, app, saga, status, input, output, error, reason, last_seq, processed_seq,
    created_at, updated_at
  FROM p
  WHERE p.app IS NOT NULL AND (p.consumer IS NULL OR EXISTS (SELECT 1 FROM i))
  ON CONFLICT DO NOTHING RETURNING 1
), ru AS (
  UPDATE sagaloop_runs AS u SET status = p.status, output = p.output, error = p.error,
    reason = p.reason, last_seq = p.last_seq, processed_seq = p.processed_seq,
    updated_at = p.updated_at
  FROM p
  WHERE u.run_id = p.run_id AND u.last_seq = p.base_seq AND p.app IS NULL
    AND (p.consumer IS NULL OR EXISTS (SELECT 1 FROM i))
  RETURNING 1
), r AS (
  SELECT 1 FROM c UNION ALL SELECT 1 FROM ru
), e AS (
  INSERT INTO sagaloop_history (run_id, seq, kind, pos, name, data, at)
  SELECT run_id, (v->>0)::int, v->>1, (v->>2)::int, v->>3, v->>4, events_at
  FROM p, json_array_elements(p.events) AS v
  WHERE EXISTS (SELECT 1 FROM r)
), o AS (
  INSERT INTO sagaloop_outbox
    (queue, message_id, body, available_at, claimed_until, claim_token, deliveries, created_at)
  SELECT v->>0, v->>1, decode(v->>2, 'hex'), (v->>3)::timestamptz, (v->>4)::timestamptz,
    v->>5, (v->>6)::int, now
  FROM p, json_array_elements(p.messages) WITH ORDINALITY AS m(v, n)
  WHERE CASE WHEN run_id IS NOT NULL THEN EXISTS (SELECT 1 FROM r)
    ELSE consumer IS NULL OR EXISTS (SELECT 1 FROM i) END
  ORDER BY m.n
  RETURNING id, claim_token
), dk AS MATERIALIZED (
  SELECT k::bigint AS id, v->>0 AS token
  FROM p, json_array_elements(p.published) AS v, json_array_elements_text(v->1) AS k
), d AS (
  DELETE FROM sagaloop_outbox AS x
  WHERE x.id = ANY(ARRAY(SELECT id FROM dk)) AND (x.id, x.claim_token) IN (SELECT * FROM dk)
), sk AS MATERIALIZED (
  SELECT k::bigint AS id, v->>0 AS token
  FROM p, json_array_elements(p.settles) AS v, json_array_elements_text(v->1) AS k
), s AS (
  DELETE FROM sagaloop_outbox AS x
  WHERE x.id = ANY(ARRAY(SELECT id FROM sk)) AND (x.id, x.claim_token) IN (SELECT * FROM sk)
  RETURNING x.id
)
SELECT (SELECT count(*) FROM i), (SELECT count(*) FROM r),
  ARRAY(SELECT id FROM o WHERE claim_token IS NOT NULL ORDER BY id), ARRAY(SELECT id FROM s)
"""
"""Its one parameter is a JSON document (one parameter costs psycopg far less to adapt than
thirty), with JSON values as their texts, as ``tables.JSONText`` stores them, timestamps in ISO
format and bodies in hex. The document is read once, in ``p``: a ``json`` value is text, and
each ``->>`` on it parses all of it again, so a field read per event or per message made a
checkpoint of n messages cost n parses of n messages (a 256-step fan-out's first checkpoint).
Outbox ids come from the table's sequence in the order rows are inserted (``ORDER BY m.n``), so
the claimed rows' ids, sorted, are in the order of their rows. The deletes (``d``, ``s``) take
``[claim_token, [id, ...]]`` pairs, one per token, expanded once into (id, token) rows
(``dk``, ``sk``, materialized); a row is reached by ``id = ANY`` of their ids, an array computed
once (an index scan on a large table; a plan that filtered each row of a scan with an array
built from its token's JSON rebuilt it per row: 1 ms per checkpoint at 300 rows), then
matched on (id, token)."""


_FUSED_LONE = (
    _FUSED.rstrip()
    + """,
  1 / CASE WHEN (SELECT count(*) FROM s) < (SELECT count(*) FROM sk)
    OR (EXISTS (SELECT 1 FROM i) OR EXISTS (SELECT 1 FROM sk))
      AND NOT ((p.consumer IS NULL OR EXISTS (SELECT 1 FROM i))
        AND (p.run_id IS NULL OR EXISTS (SELECT 1 FROM r)))
    THEN 0 ELSE 1 END
FROM p
"""
)
"""The statement as its transaction's commit (``lone``), which must commit all of its block or
nothing of it. Its last column says it wrote a part: a settled row not deleted (the lease was
lost: nothing may commit), or its inbox row added or its settle made while the checkpoint is
not written (a conflict, whose inbox row alone would mark the message processed for good; a
settled duplicate, which a usual transaction lets its caller go on with, or roll back).
It divides by zero then (by a value the CTEs decide, so only when it runs): the
error aborts the statement, which was its own transaction (``PART_ABORTED``), and it runs again
as the first statement of a usual transaction, whose outcome is the usual one. Every other
outcome writes all (``WRITTEN``) or nothing but published rows' deletes (a duplicate or a
conflict with no settle): the block may go on."""
PART_ABORTED = "22012"  # division_by_zero


class SqlCheckpoints(SqlRuns, SqlInbox, SqlOutbox, RunStore):
    def write_checkpoint(self, tx: Any, checkpoint: Checkpoint) -> Written:
        """On PostgreSQL one statement (see the module); elsewhere the separate writes."""
        cp = checkpoint
        if self.dialect == "postgresql":
            return self._fused(tx, cp)
        if cp.inbox is not None and not self.inbox_put(tx, *cp.inbox, cp.now):
            return Written.DUPLICATE
        if cp.run is not None:
            if cp.create:
                if not self.create_run(tx, cp.run):
                    return Written.CONFLICT
            elif not self.save_run(tx, cp.run, if_last_seq=cp.base_seq):
                return Written.CONFLICT
            at = cp.events_at or cp.now
            self.append_events(tx, cp.run.run_id, cp.base_seq, cp.events, at)
        self.enqueue(tx, cp.messages, cp.now)
        return Written.WRITTEN

    def _fused(self, tx: SqlTx, cp: Checkpoint) -> Written:
        now, offload = cp.now, payloads.Offloader()
        doc: dict[str, Any] = {"now": _at(now)}
        if cp.inbox is not None:
            consumer, message_id, result = cp.inbox
            result = offload.value(payloads.inbox_owner(consumer, message_id), result)
            doc.update(consumer=consumer, message_id=message_id, result=_json(result))
        if cp.run is not None:
            doc.update(_run_fields(cp, cp.run, offload))
        rows = self.outbox_rows(tx, cp.messages, now, offload)
        doc["messages"] = [_outbox_fields(r) for r in rows]
        settles: list[Settle] = []
        if not tx.conn.in_nested_transaction():  # a savepoint rolled back would undo deletes
            doc["published"] = list(self.take_published(tx).items())
            settles, tx.settles = tx.settles, []
            doc["settles"] = [[s.claim_token, s.ids] for s in settles]
        if offload.rows:  # the payload rows first: a lone transaction begins here
            offload.flush(conn_of(tx), now)
        params = {"p": json.dumps(doc, separators=(",", ":"))}
        row = None
        lone = lone_statement(tx)  # the first write of a lone transaction: it commits it
        if lone is not None:
            try:
                row = driver_row(lone, _FUSED_LONE, params)
            except DBAPIError as e:
                if getattr(e.orig, "sqlstate", None) != PART_ABORTED:
                    raise
                reopen(tx)  # it wrote nothing: again, in a usual transaction
                lone = None
        if row is None:
            row = driver_row(conn_of(tx), _FUSED, params)
        added, saved, claimed_ids, settled = row[:4]
        _check_settled(settles, settled)
        written = Written.WRITTEN
        if not added and cp.inbox is not None:
            written = Written.DUPLICATE
        elif not saved and cp.run is not None:
            written = Written.CONFLICT
        if written is not Written.WRITTEN:
            if lone is not None:  # it wrote nothing of the block's: the block may go on
                reopen(tx)
            return written
        inserted(tx, rows, claimed_ids)
        return Written.WRITTEN


def _check_settled(settles: list[Settle], settled: list[int]) -> None:
    """Raise the ``lost`` of the first settle whose rows the statement did not all delete."""
    if len(settled) == sum(len(s.ids) for s in settles):
        return
    deleted = set(settled)
    for s in settles:
        if not deleted.issuperset(s.ids):
            raise s.lost


def _run_fields(cp: Checkpoint, run: RunRecord, offload: payloads.Offloader) -> dict[str, Any]:
    """The run's update and its events, as the statement's document holds them."""
    at = cp.events_at or cp.now
    created: dict[str, Any] = {}
    if cp.create:
        created = {
            "app": run.app,
            "saga": run.saga,
            "input": _json(offload.value(run.run_id, run.input)),
            "created_at": _at(run.created_at),
        }
    return {
        **created,
        "run_id": run.run_id,
        "base_seq": cp.base_seq,
        "status": run.status,
        "output": _json(offload.value(run.run_id, run.output)),
        "error": _json(run.error),
        "reason": run.reason,
        "last_seq": run.last_seq,
        "processed_seq": run.processed_seq,
        "updated_at": _at(run.updated_at),
        "events_at": _at(at),
        "events": [
            [e.seq, e.kind, e.pos, e.name, _json(offload.data(run.run_id, e.data))]
            for e in number(cp.base_seq, cp.events, at)
        ],
    }


def _outbox_fields(row: dict[str, Any]) -> list[Any]:
    until = row.get("claimed_until")
    return [
        row["queue"],
        row["message_id"],
        row["body"].hex(),
        _at(row["available_at"]),
        None if until is None else _at(until),
        row.get("claim_token"),
        row["deliveries"],
    ]


def _at(when: datetime) -> str:
    """``when`` in ISO format, its offset included (``tables.UTCDateTime`` refuses a naive
    datetime too: the session's time zone would decide what it means)."""
    if when.tzinfo is None:
        raise ValueError("naive datetime given to sagaloop's store")
    return when.isoformat()


def _json(value: Any) -> str | None:
    """As ``tables.JSONText`` stores it."""
    return None if value is None else json.dumps(value, separators=(",", ":"))
