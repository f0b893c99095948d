"""The model provider of the provider-outage tests (tests/chaos/test_provider_outage_dev.py and
tests/integration/test_provider_outage_processes.py): the OpenAI-compatible server of
tests/unit/openai_server.py as a process of its own, scripted for tests/chaos/provider_app.py's
agent (turn 0 books the trip, turn 1 answers), which a test makes fail and asks what it
received."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from tests.unit.openai_server import call, reply

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.chaos.provider_app"
SCRIPT = [reply(tool_calls=[call("c1", "book", {"trip": "lisbon"})]), reply("Booked Lisbon.")]


class Provider:
    """``python -m tests.unit.openai_server`` on a free port, serving :data:`SCRIPT`."""

    def __init__(self, tmp: Path) -> None:
        script = tmp / "script.json"
        script.write_text(json.dumps(SCRIPT))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.openai_server", "--port", "0", "--script", script],
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().decode().strip()
        """The base URL of the OpenAI API (``.../v1``): the app's ``MODEL_URL``."""
        self.base = self.url.removesuffix("/v1")

    def fail(self, turn: int, status: int | None) -> None:
        """Answer the requests of ``turn`` with HTTP ``status`` (None: answer again)."""
        data = json.dumps({"turn": turn, "status": status}).encode()
        urllib.request.urlopen(urllib.request.Request(self.base + "/_fail", data=data), timeout=10)

    def failed(self, turn: int) -> int:
        """How many requests of ``turn`` got a failure."""
        with urllib.request.urlopen(self.base + "/_failed", timeout=10) as response:
            counts: dict[str, int] = json.load(response)
        return counts.get(str(turn), 0)

    def answered(self, prompt: str) -> list[int]:
        """The turns of the requests answered that hold the user message ``prompt``, in order."""
        with urllib.request.urlopen(self.base + "/_requests", timeout=10) as response:
            requests: list[dict[str, Any]] = json.load(response)
        asked = {"role": "user", "content": prompt}
        return [
            r["turn"] for r in requests if any(m.items() >= asked.items() for m in r["messages"])
        ]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
