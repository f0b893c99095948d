"""``sagaloop list`` pages by keyset cursor: ``--search`` (a run id prefix), ``--input`` (the
input's text), ``--sort``, and a full page prints the cursor of the next one, which ``--after``
takes; the table itself is as before."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from click.testing import CliRunner

from sagaloop.cli.main import cli
from sagaloop.engine.ports import RunRecord
from sagaloop.store.sql import SqlStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def database(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'list.db'}"
    store = SqlStore(url)
    store.upgrade()
    with store.transaction() as tx:
        for i in range(5):
            at = T0 + timedelta(seconds=i)
            run = RunRecord(f"order-{i}", "shop", "refund", "completed", {"city": "Oslo"}, at, at)
            assert store.create_run(tx, run)
        at = T0 + timedelta(seconds=9)
        run = RunRecord("other-1", "shop", "refund", "failed", {"city": "Rome"}, at, at)
        assert store.create_run(tx, run)
    store.close()
    return url


def listed(url: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["list", "--database-url", url, *args])
    assert result.exit_code == 0, result.output
    return result.output


def ids(output: str) -> list[str]:
    return re.findall(r"^((?:order|other)-\d)\b", output, re.M)


def test_list_walks_pages_with_the_printed_cursor(tmp_path: Path) -> None:
    url = database(tmp_path)
    first = listed(url, "--search", "order-", "--limit", "2")
    assert ids(first) == ["order-4", "order-3"]
    cursor = re.search(r"^next page: --after (\S+)$", first, re.M)
    assert cursor, first
    second = listed(url, "--search", "order-", "--limit", "2", "--after", cursor.group(1))
    assert ids(second) == ["order-2", "order-1"]
    walked = json.loads(listed(url, "--search", "order-", "--limit", "3", "--json"))
    rest = json.loads(
        listed(url, "--search", "order-", "--limit", "3", "--json", "--after", walked["next"])
    )
    assert [r["run_id"] for r in walked["runs"] + rest["runs"]] == [
        f"order-{i}" for i in (4, 3, 2, 1, 0)
    ]
    assert "next" not in rest, "a page that is not full has no next"


def test_list_searches_input_and_sorts(tmp_path: Path) -> None:
    url = database(tmp_path)
    assert ids(listed(url, "--input", "rome")) == ["other-1"]
    assert ids(listed(url, "--sort", "created", "--limit", "2")) == ["order-0", "order-1"]
    whole = listed(url)
    assert ids(whole)[0] == "other-1" and "next page" not in whole
    assert "completed: 5, failed: 1 (total 6)" in whole, "the counts line as before"


def test_a_cursor_of_another_order_is_refused_in_one_line(tmp_path: Path) -> None:
    url = database(tmp_path)
    first = listed(url, "--limit", "1")
    cursor = re.search(r"--after (\S+)", first)
    assert cursor
    result = CliRunner().invoke(
        cli, ["list", "--database-url", url, "--sort", "created", "--after", cursor.group(1)]
    )
    assert result.exit_code != 0 and "same order" in result.output
