"""The inbox (the store's ``InboxStore`` role): a row per (consumer, message) processed, with
its result, inserted in the transaction that processed the message."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sagaloop.engine.ports import InboxStore
from sagaloop.store import payloads
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, conn_of


class SqlInbox(SqlCore, InboxStore):
    def inbox_get(self, tx: Any, consumer: str, message_id: str) -> tuple[bool, Any]:
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
