"""Issue 26: the console's Workers page against real ``engine`` and ``worker`` processes on
RabbitMQ and PostgreSQL, built as ``sagaloop ui`` builds it: each process from the registry
with what it consumes, the depth of each queue read from RabbitMQ, the run whose step waits
on a queue nobody consumes (Temporal's "no pollers"), and a killed worker judged not alive
once its row goes stale (the registry's 15 s)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient
from system import System, eventually

from sagaloop.cli.common import Obj
from sagaloop.cli.ui import console

pytestmark = pytest.mark.integration


@pytest.fixture
def page(system: System, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The console as ``sagaloop ui`` serves it with the system's settings."""
    for name, value in system.env.items():
        if name.startswith("SAGALOOP_"):
            monkeypatch.setenv(name, value)
    yield TestClient(console(Obj(), system.client, None, None), base_url="http://127.0.0.1")


def processes(html: str) -> dict[str, str]:
    """Process name -> alive (yes/no)."""
    return dict(re.findall(r'<tr class="process" data-name="([^"]+)" data-alive="([^"]+)"', html))


def depths(html: str) -> dict[str, str]:
    return dict(re.findall(r'<tr class="queue" data-queue="([^"]+)" data-depth="([^"]+)"', html))


def test_workers_and_queues_from_the_registry_and_rabbitmq(
    system: System, page: TestClient
) -> None:
    system.engine()
    worker = system.worker(queues="other")  # `work` forgotten
    system.wait_ready()
    system.wait_ready("worker")
    run_id = system.client.start("sequence", ["a"])

    def shown() -> str | None:
        html = page.get("/workers").text
        ok = f"/run?id={run_id}" in html and depths(html).get("itapp.steps.work") == "1"
        return html if ok else None

    html = eventually(shown, timeout=60, what="the run stranded on queue work, its step counted")
    live = processes(html)
    name = next(n for n in live if n.startswith("worker@") and n.endswith(f":{worker.pid}"))
    assert live[name] == "yes" and sum(v == "yes" for v in live.values()) == 2, live
    row = html[html.index(f'data-name="{name}"') :].split("</tr>")[0]
    assert "<code>itapp.steps.other</code>" in row, "what it consumes"
    queues = depths(html)
    assert queues["itapp.steps.other"] == "0" and queues["itapp.engine"] == "0", queues
    work = html[html.index('data-queue="itapp.steps.work"') :].split("</tr>")[0]
    assert "no live process" in work
    assert "no live process consumes queue(s) itapp.steps.work" in html
    assert "not the age of its oldest message" in html, "what RabbitMQ cannot tell"
    assert "no live process consumes queue &#39;work&#39;" in html, "the run's why, as status"

    system.kill(worker)
    eventually(
        lambda: processes(page.get("/workers").text).get(name) == "no",
        timeout=60,
        what="the killed worker judged not alive",
    )
    html = page.get("/workers").text
    other = html[html.index('data-queue="itapp.steps.other"') :].split("</tr>")[0]
    assert "no live process" in other, "its queue has no consumer left"
