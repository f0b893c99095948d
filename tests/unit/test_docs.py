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


TEST_REF = re.compile(r"`(tests/[\w/]+\.py|[A-Z]\w*)?(?:::(\w+))?`")
CONTRACTS = [
    ROOT / "sagaloop/testing/contracts.py",
    *ROOT.glob("sagaloop/testing/store_contract/*.py"),
]


def test_every_test_the_guarantees_page_names_exists() -> None:
    """A guarantee is only as good as the test named as its proof: every `tests/...py::name`
    (`::name`: a test of the file named just before it; `StoreContract::name`: of a contract
    suite) on the page must exist."""
    missing: list[str] = []
    current: list[Path] = []
    for match in TEST_REF.finditer((ROOT / "docs" / "guarantees.md").read_text()):
        where, name = match.groups()
        if where and where.startswith("tests/"):
            current = [ROOT / where]
            if not current[0].exists():
                missing.append(where)
                continue
        elif where:
            current = CONTRACTS
        if name and current:
            pattern = re.compile(rf"^\s*(async )?def {name}\b", re.M)
            if not any(pattern.search(f.read_text()) for f in current if f.exists()):
                missing.append(f"{current[0].relative_to(ROOT)}::{name}")
    assert not missing, missing
