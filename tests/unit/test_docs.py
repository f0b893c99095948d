"""Every Python block in README.md and docs/ runs. Blocks of one file share a namespace, in
order, like a reader following the page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NEEDS_SERVICES = "# needs: rabbitmq and a running engine"  # run by tests/integration/


def blocks(page: Path) -> list[str]:
    """The page's Python blocks that run without services."""
    return [b for b in BLOCK.findall(page.read_text()) if not b.startswith(NEEDS_SERVICES)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for number, block in enumerate(blocks(page), start=1):
        code = compile(block, f"{page.name} block {number}", "exec", dont_inherit=True)
        exec(code, namespace)


def test_readme_has_blocks() -> None:
    assert blocks(ROOT / "README.md")
