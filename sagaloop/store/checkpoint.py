"""The hot path's writes (the store's ``RunStore.write_checkpoint``): on PostgreSQL, one
statement.

A message's transaction writes its inbox row, its run's conditional update, the run's new
events and the messages it sends. Sent one by one that is four round trips, and four times
SQLAlchemy's cost of executing a statement. On PostgreSQL they are one statement of writable
CTEs, each part guarded by the one before (``WHERE EXISTS`` on its ``RETURNING``), so a
duplicate still writes nothing and a conflict writes no run, and the result says which: the
inbox insert's row count and the update's are returned. Its text is fixed (rows travel as
arrays, ``unnest``), so psycopg prepares it once per connection, and it is executed below
SQLAlchemy's statement layer (``exec_driver_sql``) on the transaction's own connection. Large
values go to the payload table first, as each separate write does. Elsewhere (SQLite) the same
writes are the separate calls.
"""

from __future__ import annotations

import json
from typing import Any

from sagaloop.engine.history import number
from sagaloop.engine.ports import Checkpoint, RunStore, Written
from sagaloop.store import payloads
from sagaloop.store.core import SqlTx, conn_of
from sagaloop.store.inbox import SqlInbox
from sagaloop.store.queue import SqlOutbox, inserted
from sagaloop.store.runs import SqlRuns

_FUSED = """\
WITH i AS (
  INSERT INTO sagaloop_inbox (consumer, message_id, result, at)
  SELECT %(consumer)s, %(message_id)s, %(result)s, %(now)s WHERE %(with_inbox)s
  ON CONFLICT DO NOTHING RETURNING 1
), r AS (
  UPDATE sagaloop_runs SET status = %(status)s, output = %(output)s, error = %(error)s,
    reason = %(reason)s, last_seq = %(last_seq)s, processed_seq = %(processed_seq)s,
    updated_at = %(updated_at)s
  WHERE %(with_run)s AND run_id = %(run_id)s AND last_seq = %(base_seq)s
    AND (NOT %(with_inbox)s OR EXISTS (SELECT 1 FROM i))
  RETURNING 1
), e AS (
  INSERT INTO sagaloop_history (run_id, seq, kind, pos, name, data, at)
  SELECT %(run_id)s, v.seq, v.kind, v.pos, v.name, v.data, %(events_at)s
  FROM unnest(%(e_seq)s::int[], %(e_kind)s::text[], %(e_pos)s::int[], %(e_name)s::text[],
    %(e_data)s::text[]) AS v(seq, kind, pos, name, data)
  WHERE EXISTS (SELECT 1 FROM r)
), o AS (
  INSERT INTO sagaloop_outbox
    (queue, message_id, body, available_at, claimed_until, claim_token, deliveries, created_at)
  SELECT v.queue, v.message_id, v.body, v.available_at, v.claimed_until, v.claim_token,
    v.deliveries, %(now)s
  FROM unnest(%(o_queue)s::text[], %(o_message_id)s::text[], %(o_body)s::bytea[],
    %(o_available_at)s::timestamptz[], %(o_claimed_until)s::timestamptz[],
    %(o_claim_token)s::text[], %(o_deliveries)s::int[])
    WITH ORDINALITY AS v(queue, message_id, body, available_at, claimed_until, claim_token,
    deliveries, n)
  WHERE CASE WHEN %(with_run)s THEN EXISTS (SELECT 1 FROM r)
    ELSE NOT %(with_inbox)s OR EXISTS (SELECT 1 FROM i) END
  ORDER BY v.n
  RETURNING id, claim_token
)
SELECT (SELECT count(*) FROM i), (SELECT count(*) FROM r),
  ARRAY(SELECT id FROM o WHERE claim_token IS NOT NULL ORDER BY id)
"""
"""Ids come from the outbox's sequence in the order rows are inserted (``ORDER BY v.n``), so
the claimed rows' ids, sorted, are in the order of their rows."""


class SqlCheckpoints(SqlRuns, SqlInbox, SqlOutbox, RunStore):
    def write_checkpoint(self, tx: Any, checkpoint: Checkpoint) -> Written:
        """On PostgreSQL one statement (see the module); elsewhere the separate writes."""
        cp = checkpoint
        if self.dialect == "postgresql":
            return self._fused(tx, cp)
        if cp.inbox is not None and not self.inbox_put(tx, *cp.inbox, cp.now):
            return Written.DUPLICATE
        if cp.run is not None:
            if not self.save_run(tx, cp.run, if_last_seq=cp.base_seq):
                return Written.CONFLICT
            at = cp.events_at or cp.now
            self.append_events(tx, cp.run.run_id, cp.base_seq, cp.events, at)
        self.enqueue(tx, cp.messages, cp.now)
        return Written.WRITTEN

    def _fused(self, tx: SqlTx, cp: Checkpoint) -> Written:
        conn, now, offload = conn_of(tx), cp.now, payloads.Offloader()
        params: dict[str, Any] = {"now": now, "with_inbox": cp.inbox is not None}
        consumer, message_id, result = cp.inbox or ("", "", None)
        if cp.inbox is not None:
            result = offload.value(payloads.inbox_owner(consumer, message_id), result)
        params.update(consumer=consumer, message_id=message_id, result=_json(result))
        params.update(_run_params(cp, offload))
        rows = self.outbox_rows(tx, cp.messages, now, offload)
        for column in _OUTBOX_COLUMNS:
            params["o_" + column] = [r.get(column) for r in rows]
        offload.flush(conn, now)
        added, saved, claimed_ids = conn.exec_driver_sql(_FUSED, params).one()
        if not added and cp.inbox is not None:
            return Written.DUPLICATE
        if not saved and cp.run is not None:
            return Written.CONFLICT
        inserted(tx, rows, claimed_ids)
        return Written.WRITTEN


def _run_params(cp: Checkpoint, offload: payloads.Offloader) -> dict[str, Any]:
    """The parameters of the run's update and of its events (no run: an update of none)."""
    run, at = cp.run, cp.events_at or cp.now
    if run is None:
        values: dict[str, Any] = dict.fromkeys(_RUN_COLUMNS)
        values.update(with_run=False, run_id="", base_seq=0, events_at=at)
        return values | {"e_" + k: [] for k in ("seq", "kind", "pos", "name", "data")}
    events = number(cp.base_seq, cp.events, at)
    return {
        "with_run": True,
        "run_id": run.run_id,
        "base_seq": cp.base_seq,
        "status": run.status,
        "output": _json(offload.value(run.run_id, run.output)),
        "error": _json(run.error),
        "reason": run.reason,
        "last_seq": run.last_seq,
        "processed_seq": run.processed_seq,
        "updated_at": run.updated_at,
        "events_at": at,
        "e_seq": [e.seq for e in events],
        "e_kind": [e.kind for e in events],
        "e_pos": [e.pos for e in events],
        "e_name": [e.name for e in events],
        "e_data": [_json(offload.data(run.run_id, e.data)) for e in events],
    }


_RUN_COLUMNS = ("status", "output", "error", "reason", "last_seq", "processed_seq", "updated_at")
_OUTBOX_COLUMNS = (
    "queue",
    "message_id",
    "body",
    "available_at",
    "claimed_until",
    "claim_token",
    "deliveries",
)


def _json(value: Any) -> str | None:
    """As ``tables.JSONText`` stores it."""
    return None if value is None else json.dumps(value, separators=(",", ":"))
