"""Folders are the architecture and arrows point inward: sagas <- engine <- client and the
adapters (store, brokers, outbox) <- runtime <- cli. Checked on the import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sagaloop"
DRIVERS = ("sqlalchemy", "psycopg", "kombu", "redis", "pika", "sqlite3", "prometheus_client")

# layer -> packages (inside sagaloop) it must not import
FORBIDDEN = {
    "sagas": ("engine", "store", "brokers", "outbox", "cli", "testing", "observability"),
    "engine": (
        "store",
        "brokers",
        "outbox",
        "cli",
        "testing",
        "observability",
        "runtime",
        "client",
        "agents",
        "ui",
        "mcp_server",
    ),
    # starts, signals and reads runs without saga code running and without the runtime
    "client": ("runtime", "store", "brokers", "cli", "testing"),
    "runtime": ("cli", "testing"),
    "store": ("brokers", "outbox", "cli", "testing", "observability"),
    "outbox": ("store", "brokers", "cli", "testing", "observability"),
    "brokers": ("cli", "testing", "outbox", "observability"),
    # reads the store at scrape time; a broker only through a duck-typed method
    "observability": ("brokers", "outbox", "cli", "testing"),
}
DRIVER_FREE = ("sagas", "engine", "outbox")

# The modules left at the old paths of what moved to runtime/ and client/, which import from
# the new place; they go in the next release, and this list with them.
SHIMS = frozenset(
    {
        "engine/admission.py",
        "engine/aio.py",
        "engine/client.py",
        "engine/crashpoints.py",
        "engine/local.py",
        "engine/runtime.py",
        "engine/serving.py",
        "engine/slots.py",
        "engine/steps.py",
        "engine/tracing.py",
        "engine/timeline.py",
    }
)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_inward(layer: str) -> None:
    offenders = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in SHIMS:
            continue
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "sagaloop" and len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if layer in DRIVER_FREE and parts[0] in DRIVERS:
                offenders.append(f"{path.relative_to(PACKAGE)} imports the driver {name}")
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_violations(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import sqlalchemy\nfrom sagaloop.store.sql import SqlStore\n")
    assert {"sqlalchemy", "sagaloop.store.sql"} <= imports_of(bad)


def test_importing_sagaloop_does_no_io_and_loads_no_driver() -> None:
    import subprocess
    import sys

    code = (
        "import sys, sagaloop, sagaloop.sagas; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{DRIVERS!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_exempt_modules_are_only_shims(shim: str) -> None:
    text = (PACKAGE / shim).read_text()
    assert "this name is kept for one release" in text
    assert not [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
