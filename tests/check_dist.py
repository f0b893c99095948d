"""Check what ``make dist`` built: ``python tests/check_dist.py dist`` exits 1 and names each
problem when the sdist or the wheel in ``dist`` lacks a file of the package (a template, a static
file, ``py.typed``, a subpackage without ``__init__.py``: setuptools leaves out, silently, what
``[tool.setuptools.package-data]`` or the package finder does not name), carries a file from
outside it, or has metadata that does not say what ``pyproject.toml`` says (name, version,
Python, licence, extras, dependencies, the ``sagaloop`` command).

``tests/unit/test_wheel_install.py`` runs the same check on the wheel it builds."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sagaloop"
SDIST_EXTRA = ("pyproject.toml", "README.md", "PKG-INFO")


def package_files(root: Path) -> set[str]:
    """The files of the package in the source tree ``root`` (``sagaloop/...``): git's list in a
    checkout (untracked files are not part of it), else every file but bytecode."""
    if (root / ".git").exists():
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--", PACKAGE],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return {name for name in listed if (root / name).is_file()}
    return {
        path.relative_to(root).as_posix()
        for path in (root / PACKAGE).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def wheel_problems(wheel: Path, root: Path) -> list[str]:
    """What is wrong with ``wheel`` built from ``root``."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    version = project["version"]
    info = f"{PACKAGE}-{version}.dist-info"
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    problems += [f"{wheel.name} lacks {name}" for name in sorted(package_files(root) - names)]
    problems += [
        f"{wheel.name} carries {name}, from outside the package"
        for name in sorted(names)
        if name.split("/")[0] not in (PACKAGE, info)
    ]
    problems += [
        f"{wheel.name} carries bytecode {name}"
        for name in sorted(names)
        if "__pycache__" in name or name.endswith(".pyc")
    ]
    problems += metadata_problems(metadata, project, wheel.name)
    if f"{PACKAGE} = {PACKAGE}.cli.main:main" not in entry_points:
        problems.append(f"{wheel.name}: no `sagaloop` command in entry_points.txt")
    return problems


def metadata_problems(metadata: Message, project: dict[str, object], where: str) -> list[str]:
    """What the core metadata ``metadata`` says otherwise than ``project``."""
    get, get_all = metadata.get, metadata.get_all
    expected = {
        "Name": PACKAGE,
        "Version": project["version"],
        "Requires-Python": project["requires-python"],
        "License-Expression": project["license"],
        "Description-Content-Type": "text/markdown",
    }
    problems = [
        f"{where}: {field} is {get(field)!r}, not {value!r}"
        for field, value in expected.items()
        if get(field) != value
    ]
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    missing = set(extras) - set(get_all("Provides-Extra") or [])
    if missing:
        problems.append(f"{where}: extras {sorted(missing)} not provided")
    requires = get_all("Requires-Dist") or []
    dependencies = project["dependencies"]
    assert isinstance(dependencies, list)
    count = len(dependencies) + sum(len(v) for v in extras.values())
    if len(requires) != count:
        problems.append(f"{where}: {len(requires)} Requires-Dist, pyproject.toml names {count}")
    if len(get("Description") or str(metadata.get_payload()) or "") < 100:
        problems.append(f"{where}: no long description (the README)")
    return problems


def sdist_problems(sdist: Path, root: Path) -> list[str]:
    """What is wrong with ``sdist`` built from ``root``."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    top = f"{PACKAGE}-{project['version']}"
    with tarfile.open(sdist) as tf:
        names = {m.name.removeprefix(f"{top}/") for m in tf.getmembers() if m.isfile()}
        pkg_info = tf.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        metadata = Parser().parsestr(pkg_info.read().decode())
    wanted = package_files(root) | set(SDIST_EXTRA)
    problems = [f"{sdist.name} lacks {name}" for name in sorted(wanted - names)]
    return problems + metadata_problems(metadata, project, sdist.name)


def problems(dist: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the sdist and the wheel in ``dist``, built from ``root``."""
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    wheel = dist / f"{PACKAGE}-{version}-py3-none-any.whl"
    sdist = dist / f"{PACKAGE}-{version}.tar.gz"
    found = sorted(p.name for p in dist.iterdir())
    if not wheel.exists() or not sdist.exists():
        return [f"{dist} holds {found}, not {sdist.name} and {wheel.name}"]
    return wheel_problems(wheel, root) + sdist_problems(sdist, root)


def main() -> int:
    dist = Path(sys.argv[1] if len(sys.argv) > 1 else "dist")
    found = problems(dist)
    for problem in found:
        print(f"check_dist: {problem}", file=sys.stderr)
    if not found:
        print(f"check_dist: {', '.join(sorted(p.name for p in dist.iterdir()))}: complete")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
