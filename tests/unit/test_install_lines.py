"""Every install line works as written. sagaloop is not on a package index yet, so
``pip install 'sagaloop[ui]'`` finds nothing: the docs, the examples and the messages of the code
install from a checkout (``pip install -e '.[ui]'``), a built wheel or a git URL, and an error
for a missing extra names the command that fits how the running copy was installed."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from sagaloop.extras import command_for, install_command

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
VERSION = PYPROJECT["project"]["version"]
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "examples").rglob("*.py")),
    *sorted((ROOT / "examples").rglob("*.md")),
    *(p for p in sorted((ROOT / "sagaloop").rglob("*.py")) if p.name != "extras.py"),
    ROOT / "docker-compose.yml",
]  # sagaloop/extras.py names the index's form: the command when sagaloop came from one
# a `pip install` and its arguments, up to the end of the code span, string, line or command
PIP_INSTALL = re.compile(r"pip install ([^`\n\"&;|)]*)")
FROM_AN_INDEX = re.compile(r"^sagaloop(\[[^\]]*\])?([<>=!~].*)?$")
WHEEL = re.compile(r"sagaloop-([\w.]+)-py3-none-any\.whl")


def install_lines() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        for match in PIP_INSTALL.finditer(path.read_text()):
            found.append((f"{path.relative_to(ROOT)}", match.group(1).strip()))
    return found


def test_no_line_installs_sagaloop_from_an_index() -> None:
    offenders = []
    for where, args in install_lines():
        try:
            words = shlex.split(args)
        except ValueError:  # a quote closed on the next line: read the words as they are
            words = args.replace("'", " ").split()
        if any(FROM_AN_INDEX.match(word) for word in words):
            offenders.append(f"{where}: pip install {args}")
    assert not offenders, "\n".join(offenders)


def test_every_extra_a_line_names_exists() -> None:
    named = {
        (where, extra.strip())
        for where, args in install_lines()
        for group in re.findall(r"(?:\.|sagaloop|\.whl|/app)\[([^\]]+)\]", args)
        for extra in group.split(",")
    }
    assert named, "no install line names an extra"
    unknown = sorted(f"{where}: {extra}" for where, extra in named if extra not in EXTRAS)
    assert not unknown, unknown


def test_the_wheel_the_docs_name_is_the_one_make_dist_builds() -> None:
    versions = {
        (path.name, version)
        for path in SOURCES
        for version in WHEEL.findall(path.read_text())
        if version != VERSION
    }
    assert not versions, f"the wheel of {VERSION} is the one built: {sorted(versions)}"


@pytest.mark.parametrize(
    ("direct_url", "expected"),
    [
        (
            {"url": "file:///srv/my%20app/sagaloop", "dir_info": {"editable": True}},
            "pip install -e '/srv/my app/sagaloop[ui]'",
        ),
        ({"url": "file:///src/sagaloop", "dir_info": {}}, "pip install '/src/sagaloop[ui]'"),
        (
            {
                "url": "file:///tmp/dist/sagaloop-0.1.0-py3-none-any.whl",
                "archive_info": {"hashes": {"sha256": "00"}},
            },
            "pip install 'sagaloop[ui] @ file:///tmp/dist/sagaloop-0.1.0-py3-none-any.whl'",
        ),
        (
            {
                "url": "https://git.example.com/team/sagaloop.git",
                "vcs_info": {"vcs": "git", "commit_id": "f8365a1", "requested_revision": "main"},
            },
            "pip install 'sagaloop[ui] @ git+https://git.example.com/team/sagaloop.git@f8365a1'",
        ),
        (None, "pip install 'sagaloop[ui]'"),
    ],
    ids=["editable", "folder", "wheel", "git", "index"],
)
def test_the_command_follows_how_sagaloop_was_installed(
    direct_url: dict[str, object] | None, expected: str
) -> None:
    command = command_for("ui", checkout=None, direct_url=direct_url)
    assert command == expected
    requirement = shlex.split(command)[-1]
    if " @ " in requirement:  # pip reads it as a PEP 508 requirement with a URL
        assert Requirement(requirement).extras == {"ui"}


def test_a_checkout_installs_itself_editable() -> None:
    assert command_for("mcp", checkout=Path("/w/sagaloop"), direct_url=None) == (
        "pip install -e '/w/sagaloop[mcp]'"
    )
    # this test runs from a checkout, wherever the venv's editable install points
    assert install_command("mcp") == f"pip install -e '{ROOT}[mcp]'"


@pytest.mark.parametrize(
    ("blocked", "module", "says", "extra"),
    [
        ("starlette", "sagaloop.ui", "the console needs starlette", "ui"),
        ("pydantic_ai", "sagaloop.agents.pydantic_ai", "SagaAgent needs", "pydantic-ai"),
        ("agents", "sagaloop.agents.openai_agents", "SagaRunner needs agents", "openai-agents"),
    ],
)
def test_a_missing_extra_names_the_command(
    blocked: str, module: str, says: str, extra: str
) -> None:
    """The error of a module whose extra is missing, in a process where it cannot be imported."""
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert says in out.stdout, out.stdout
    assert install_command(extra) in out.stdout, out.stdout


def test_the_redis_broker_without_redis_names_the_command() -> None:
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "from sagaloop.brokers.kombu import KombuBroker\n"
        "try:\n"
        "    KombuBroker('redis://127.0.0.1:1/0')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "the Redis broker needs redis" in out.stdout, out.stdout
    assert install_command("redis") in out.stdout, out.stdout
