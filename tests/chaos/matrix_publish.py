"""The crash matrix's cells for published events (issue 25 item 1): the engine killed in the
middle of a fan-out (``engine.fanout_before_commit``: the deliveries and starts of a publish are
in the outbox, not committed), on both backends. After the restart the publish is processed
again: each run waiting on its key receives the event exactly once, a run waiting on another key
never does, and a saga declared ``on_event`` starts one run for a publish sent twice under one
id. The sagas are tests/integration/publish_app.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from matrix import EMBEDDED, LEASE, RABBIT, EmbeddedSystem, _env, start_role
from system import FINAL, System

from sagaloop.engine import history as h
from sagaloop.testing import eventually

APP = "publish_app"
POINT = "engine.fanout_before_commit"


@dataclasses.dataclass(frozen=True)
class PublishCell:
    """``point:nth`` armed in ``role`` (``dev`` on the embedded default) while events are
    published to waiting runs."""

    backend: str
    point: str
    nth: int
    role: str

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.point}:{self.nth}-publish-kills-{self.role}"


PUBLISH_CELLS = [
    PublishCell(EMBEDDED, POINT, 1, "dev"),  # the first fan-out: order.paid to w1 and w2
    PublishCell(RABBIT, POINT, 1, "engine"),
    PublishCell(EMBEDDED, POINT, 2, "dev"),  # the second: order.placed, which starts a run
    PublishCell(RABBIT, POINT, 2, "engine"),
]


def make_publish_system(cell: PublishCell, tmp: Path, broker_url: str | None) -> System:
    if cell.backend == EMBEDDED:
        return EmbeddedSystem(tmp, lease=LEASE, app=APP)
    assert broker_url is not None
    system = System(tmp, broker_url, lease=LEASE, app=APP)
    system.env["PYTHONPATH"] = _env()["PYTHONPATH"]
    return system


def _arrived(system: System, run_id: str) -> list[object]:
    return [e.data["data"] for e in system.client.history(run_id) if e.kind == h.EVENT_ARRIVED]


def drive_and_check_publish(cell: PublishCell, system: System) -> None:
    client = system.client
    proc = start_role(system, cell.role, SAGALOOP_CRASH_AT=f"{cell.point}:{cell.nth}")
    system.wait_ready(cell.role)
    for run_id, order in (("w1", "K"), ("w2", "K"), ("w3", "OTHER")):
        client.start("waiter", order, run_id=run_id)

    def waiting() -> bool:
        runs = [client.store.get_run(r) for r in ("w1", "w2", "w3")]
        return all(run is not None and run.status == "waiting" for run in runs)

    eventually(waiting, 60, f"the runs to wait\n{system.logs()}")
    client.publish_event("order.paid", {"amount": 5}, key="K", event_id="pay-1")
    if cell.nth == 2:  # the first fan-out commits, the second (a start by event) is killed
        eventually(lambda: _arrived(system, "w1") and _arrived(system, "w2"), 60, "delivery")
        client.publish_event("order.placed", {"id": 9}, event_id="placed-9")
    System.wait_killed_by_crash_point(proc)
    if cell.nth == 1:  # rolled back whole: nobody received it yet
        assert _arrived(system, "w1") == _arrived(system, "w2") == []
    else:
        assert client.store.get_run("placed-9") is None

    start_role(system, cell.role)  # the publish comes back to the restarted engine
    system.wait_ready(cell.role)
    client.publish_event("order.placed", {"id": 9}, event_id="placed-9")  # a retry: no 2nd run
    statuses = system.wait_final(["w1", "w2", "placed-9"])
    assert set(statuses.values()) == {"completed"}, f"{statuses}\n{system.logs()}"
    assert _arrived(system, "w1") == _arrived(system, "w2") == [{"amount": 5}]  # exactly once
    assert _arrived(system, "w3") == []  # another key: never delivered
    w3 = client.store.get_run("w3")
    assert w3 is not None and w3.status == "waiting" and w3.status not in FINAL
    assert [r.run_id for r in client.list(saga="on_order")] == ["placed-9"]
    assert client.result("placed-9", timeout=0) == {"id": 9}
    if isinstance(system, EmbeddedSystem):
        assert system.store.dead_letters() == []
    else:
        assert system.dead_letter_count() == 0
