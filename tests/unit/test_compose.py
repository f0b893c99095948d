"""docker-compose.yml cannot run here (no Docker engine); keep it true to the example app."""

import re
from pathlib import Path

from examples.refund_agent.app import app

ROOT = Path(__file__).resolve().parents[2]


def test_compose_worker_consumes_every_queue_of_the_example() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    queues = re.search(r"--queue ([\w,.-]+)", text)
    assert queues is not None
    assert sorted(queues.group(1).split(",")) == app.queues
    assert "--app examples.refund_agent.app" in text
    for service in ("postgres:", "rabbitmq:", "engine:", "worker:"):
        assert f"\n  {service}" in text
