"""The tutorial's app and commands as the page gives them (docs/tutorial.md): the Python blocks
of its sections 1 to 4, which make ``refunds.py``, and the command lines of its section 6.
``tests/chaos/test_tutorial_runs.py`` runs them from the checkout,
``tests/unit/test_wheel_install.py`` from the built wheel."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"


def section(number: int) -> str:
    text = TUTORIAL.read_text()
    start = text.index(f"\n## {number}.")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def app_code() -> str:
    """The source of ``refunds.py``: sections 1 to 4's Python blocks."""
    return "\n\n".join(b for n in (1, 2, 3, 4) for b in blocks(section(n), "python"))


def commands() -> list[list[str]]:
    """Section 6's commands, split as a shell would: ``sagaloop dev`` first."""
    found = [
        shlex.split(line)
        for block in blocks(section(6), "bash")
        for line in block.splitlines()
        if line.strip()
    ]
    assert found[0][:2] == ["sagaloop", "dev"], found[0]
    return found
