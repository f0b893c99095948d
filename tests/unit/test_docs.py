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


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_a_page_is_one_document(page: Path) -> None:
    """A page starts with its title and says each paragraph once: a scripted edit gone wrong
    (docs/ui.md was once its own paragraph repeated 7,591 times, with no block left to run)
    fails here, not only in a reader's eyes."""
    text = page.read_text()
    assert text.startswith("# "), f"{page.name} does not start with its title"
    outside_code = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    paragraphs = [p.strip() for p in outside_code.split("\n\n") if len(p.strip()) > 200]
    repeated = {p[:80] for p in paragraphs if paragraphs.count(p) > 1}
    assert not repeated, f"{page.name} repeats paragraphs: {sorted(repeated)[:3]}"


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
