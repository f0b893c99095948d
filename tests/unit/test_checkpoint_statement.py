"""The one statement of a checkpoint on PostgreSQL (``sagaloop.store.checkpoint``) reads its
JSON document once. A ``json`` value is text: each ``->>`` on it parses all of it again, so a
field read per inserted row cost a checkpoint of n messages n parses of the n messages (the
first checkpoint of a 256-step fan-out took twice as long as the separate writes)."""

from __future__ import annotations

import re

from sagaloop.store.checkpoint import _FUSED


def test_the_document_is_read_in_its_own_cte_only() -> None:
    head, sep, rest = re.split(r"\b(i AS \()", _FUSED, maxsplit=1)
    assert sep, "the statement's CTE p is no longer followed by the inbox insert i"
    assert "%(p)s::json AS j" in head
    assert re.findall(r"\bj\s*->", rest) == [], "a CTE after p reads the whole document again"
    # what the later CTEs expand row by row is p's own column, the array alone
    assert "json_array_elements(p.events)" in rest
    assert "json_array_elements(p.messages)" in rest
    assert "json_array_elements(p.published)" in rest  # the relay's pending deletes
    assert "json_array_elements(p.settles)" in rest  # the message's own row
    # each delete reaches its rows by an array of ids computed once, not one built per row
    assert "x.id = ANY(ARRAY(SELECT id FROM dk))" in rest
    assert "x.id = ANY(ARRAY(SELECT id FROM sk))" in rest
