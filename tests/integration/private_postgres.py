"""A private PostgreSQL server for tests that stop, restart or break the database, so that the
shared one is never disturbed: its own data directory (under a temporary folder), port and
socket directory, trust authentication, up in about a second.

PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` OS user
(through ``runuser``); as any other user it runs as that user. The binaries are taken from
``$SAGALOOP_PG_BIN``, else the newest ``/usr/lib/postgresql/*/bin``, else ``pg_config``.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

__all__ = ["PrivatePostgres"]


def _bin_dir() -> Path:
    if env := os.environ.get("SAGALOOP_PG_BIN"):
        return Path(env)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    if pg_config := shutil.which("pg_config"):
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True)
        return Path(out.stdout.strip())
    raise RuntimeError(
        "no PostgreSQL server binaries (initdb, pg_ctl) found: install PostgreSQL "
        "(Debian: `apt-get install postgresql`) or set SAGALOOP_PG_BIN to their directory"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PrivatePostgres:
    """``initdb`` once, then ``start``/``stop``/``restart`` with ``pg_ctl``; ``close`` stops the
    server and deletes its files. Usable as a context manager."""

    def __init__(self, *, port: int | None = None, bin_dir: Path | None = None) -> None:
        self.bin = bin_dir or _bin_dir()
        self.port = port or free_port()
        self.root = Path(tempfile.mkdtemp(prefix="sagaloop-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:  # the server's user must own its files
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    @property
    def url(self) -> str:
        """The URL of the ``postgres`` database (create your own with ``fresh_database``)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str, timeout: float = 60) -> None:
        command = [str(self.bin / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(
            command, cwd=self.root, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}\n"
                f"server log:\n{log}"
            )

    def _pg_ctl(self, action: str, *args: str) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl", action, "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", *args
        )

    def start(self) -> None:
        self._pg_ctl("start")

    def stop(self, mode: str = "fast") -> None:
        """``fast`` ends sessions (clients see an admin shutdown), ``immediate`` is a crash."""
        self._pg_ctl("stop", "-m", mode)

    def restart(self, mode: str = "fast") -> None:
        self._pg_ctl("restart", "-m", mode)

    def running(self) -> bool:
        pid = self.data / "postmaster.pid"
        return pid.exists()

    def close(self) -> None:
        try:
            if self.running():
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
