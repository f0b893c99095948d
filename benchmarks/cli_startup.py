"""How long the ``sagaloop`` command takes to start (issue 26): the wall time, best of N fresh
processes, of commands that run no saga code, against ``python -c pass`` (the interpreter's own
start, which no CLI can go under).

    python -m benchmarks.cli_startup [--runs 5]

Nothing is started nor connected to: ``--help`` stops before any command opens the store, and
``list`` (which does) is measured against the embedded SQLite default in a scratch folder.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

COMMANDS: dict[str, Sequence[str]] = {
    "sagaloop --help": ("-m", "sagaloop", "--help"),
    "sagaloop status --help": ("-m", "sagaloop", "status", "--help"),
    "sagaloop list --help": ("-m", "sagaloop", "list", "--help"),
    "sagaloop approve --help": ("-m", "sagaloop", "approve", "--help"),
    "sagaloop fork --help": ("-m", "sagaloop", "fork", "--help"),
    "sagaloop schema": ("-m", "sagaloop", "schema"),
    "sagaloop list (SQLite)": ("-m", "sagaloop", "list"),
}


def best_of(args: Sequence[str], runs: int, cwd: str) -> float:
    """The shortest wall time of ``runs`` runs of ``python ARGS``, in seconds."""
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run(
            [sys.executable, *args], cwd=cwd, stdout=subprocess.DEVNULL, check=True, env=_env()
        )
        times.append(time.perf_counter() - began)
    return min(times)


def _env() -> dict[str, str]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": here if not path else f"{here}{os.pathsep}{path}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as scratch:
        best_of(("-m", "sagaloop", "db", "upgrade"), 1, scratch)  # the SQLite that list reads
        floor = best_of(("-c", "pass"), runs, scratch)
        print(f"{'python -c pass':28} {floor:6.3f} s")
        for name, args in COMMANDS.items():
            took = best_of(args, runs, scratch)
            print(f"{name:28} {took:6.3f} s  ({took / floor:4.1f}x python -c pass)")


if __name__ == "__main__":
    main()
