"""The wheel alone carries sagaloop: built from the package's sources as ``make dist`` builds it,
installed on its own, it runs ``sagaloop --help`` and the tutorial's saga on the embedded SQLite
default, from a folder outside the checkout.

How, and why this way. The test downloads nothing, and what it proves is that the *wheel* holds
every file sagaloop needs (a template, a static file or a subpackage left out of it is the
classic packaging defect), not that pip can resolve the dependencies from an index:

- build: ``pyproject.toml``, ``README.md`` and ``sagaloop/`` copied to a fresh folder, then
  ``python -m build --no-isolation`` there, as ``make dist`` runs it: the sdist, then the wheel
  from the unpacked sdist, so a file the sdist lacks is missing from the wheel too. The build
  backend is this environment's (``setuptools>=77``, ``build`` and ``twine``: the dev extra);
  nothing is written into the checkout. ``tests/check_dist.py`` then checks both files
  against the sources and ``twine check --strict`` their metadata;
- install: ``pip install --no-deps --no-index --target T`` the wheel: T holds sagaloop as the
  wheel has it and nothing else. The dependencies are this environment's: its interpreter
  runs with ``PYTHONPATH=T``, so ``import sagaloop`` finds T before this environment's own
  (editable) sagaloop, which the test asserts. A fresh virtual environment would have to get
  the dependencies from an index (a download) or from wheels built of this environment's
  packages (minutes), and would prove nothing more about the wheel;
- run: ``T/bin/sagaloop`` (the wheel's console script) with ``--help``, then the tutorial's
  section 6 as written (``sagaloop dev``, ``start``, ``send-event``, ``status``) on its
  sections 1 to 4 saved as ``refunds.py``, in a folder of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sagaloop.testing import eventually
from tests.check_dist import problems
from tests.tutorial import app_code, commands

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "sagaloop")


def copy_sources(to: Path) -> Path:
    to.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(source, to / name, ignore=ignore)
        else:
            shutil.copy2(source, to / name)
    return to


def build(sources: Path, out: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(sources)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        "python -m build failed (the dev extra carries build and setuptools>=77: run make)\n"
        + done.stdout[-3000:]
        + done.stderr[-3000:]
    )


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel of the checkout's sources."""
    base = tmp_path_factory.mktemp("dist")
    build(copy_sources(base / "src"), base / "dist")
    return base / "dist"


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The folder the wheel alone is installed into (``--target``)."""
    target = tmp_path_factory.mktemp("target")
    (wheel,) = dist.glob("*.whl")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(
        [*pip, "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    yield target


def environment(target: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env["PYTHONPATH"] = str(target)
    return env


def test_the_sdist_and_the_wheel_carry_every_file_and_their_metadata(dist: Path) -> None:
    found = problems(dist, ROOT)
    assert not found, "\n".join(found)
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(dist.iterdir()))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_check_finds_a_file_the_build_leaves_out(tmp_path: Path) -> None:
    """Data files ``package-data`` does not name (a template that is not ``*.html``, a file
    beside the modules): setuptools builds without them and says nothing; the check names them."""
    sources = copy_sources(tmp_path / "src")
    (sources / "sagaloop" / "schema.json").write_text("{}")
    (sources / "sagaloop" / "ui" / "templates" / "_row.jinja").write_text("<tr></tr>")
    build(sources, tmp_path / "dist")
    found = problems(tmp_path / "dist", sources)
    (wheel,) = (path.name for path in (tmp_path / "dist").glob("*.whl"))
    for name in ("sagaloop/schema.json", "sagaloop/ui/templates/_row.jinja"):
        assert f"{wheel} lacks {name}" in found, found


def test_the_installed_wheel_runs_help_and_the_tutorials_saga(
    installed: Path, tmp_path: Path
) -> None:
    env = environment(installed)
    where = subprocess.run(
        [sys.executable, "-c", "import sagaloop; print(sagaloop.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(installed), where
    script = installed / "bin" / "sagaloop"

    def sagaloop(args: list[str]) -> str:
        assert args[0] == "sagaloop", args
        done = subprocess.run(
            [str(script), *args[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (args, done.stderr)
        return done.stdout

    assert "Usage: sagaloop" in sagaloop(["sagaloop", "--help"])

    (tmp_path / "refunds.py").write_text(app_code())
    dev_command, start, *rest = commands()
    log = tmp_path / "dev.log"
    with log.open("wb") as stderr:
        dev = subprocess.Popen(
            [str(script), *dev_command[1:]],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        eventually(lambda: "dev: app" in log.read_text(), 60, "sagaloop dev to start")
        run_id = sagaloop(start).strip()
        assert run_id == "dispute-D-1001"

        def status() -> dict[str, object]:
            data: dict[str, object] = json.loads(sagaloop(["sagaloop", "status", run_id, "--json"]))
            return data

        eventually(lambda: status()["status"] == "waiting", 60, "the wait for the customer")
        for command in rest:
            if command[1] != "status":
                sagaloop(command)
        eventually(lambda: status()["status"] == "completed", 60, "the refund")
        output = status()["output"]
        assert isinstance(output, dict) and output["outcome"] == "refunded", output
    finally:
        dev.terminate()
        dev.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_a_missing_extra_names_the_wheel_it_came_from(installed: Path, dist: Path) -> None:
    """An error for a missing extra, from the wheel's install, names that wheel with the extra:
    ``pip install 'sagaloop[ui] @ file:///.../sagaloop-0.1.0-py3-none-any.whl'``."""
    code = "from sagaloop.extras import install_command; print(install_command('ui'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=installed.parent,
        env=environment(installed),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    (wheel,) = dist.glob("*.whl")
    assert out == f"pip install 'sagaloop[ui] @ {wheel.as_uri()}'", out
