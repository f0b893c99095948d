"""The inbox (the store's ``InboxStore`` role): a row per (consumer, message) processed, with
its result, inserted in the transaction that processed the message."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sagaloop.engine.ports import InboxStore
from sagaloop.store import payloads
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, conn_of

_INBOX_GET = "SELECT result FROM sagaloop_inbox WHERE consumer = %s AND message_id = %s"
"""The inbox read outside a transaction on PostgreSQL (``SqlCore._fetch_one``)."""


class SqlInbox(SqlCore, InboxStore):
    def inbox_get(self, tx: Any, consumer: str, message_id: str) -> tuple[bool, Any]:
        if tx is None and self.dialect == "postgresql":  # the hot read: before a step runs
            read = self._fetch_one(_INBOX_GET, (consumer, message_id), (t.inbox.c.result,))
            if read is None:
                return False, None
            if not payloads.marked(read["result"]):
                return True, read["result"]
        q = self._sql.inbox_get
        params = {"key_consumer": consumer, "key_message_id": message_id}
        owner = payloads.inbox_owner(consumer, message_id)
        with self._in(tx) as conn:
            row = conn.execute(q, params).first()
            return (True, payloads.resolve_value(conn, owner, row[0])) if row else (False, None)

    def inbox_put(self, tx: Any, consumer: str, message_id: str, result: Any, at: datetime) -> bool:
        offload = payloads.Offloader()
        result = offload.value(payloads.inbox_owner(consumer, message_id), result)
        offload.flush(conn_of(tx), at)
        values = {"consumer": consumer, "message_id": message_id, "result": result, "at": at}
        return self._insert_ignore(conn_of(tx), t.inbox, values)
