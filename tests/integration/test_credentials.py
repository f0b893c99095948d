"""A server that refuses sagaloop's credentials stops a service at once: the real RabbitMQ
with a wrong password or a missing virtual host, the real PostgreSQL with a role or a database
that does not exist. One line says what was refused and which setting to check, the exit status
is 78, no line of pika is printed and no password either. (The shared PostgreSQL trusts local
logins, so a wrong password is classified by a unit test, tests/unit/test_logs.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from sagaloop.store.sql import SqlStore
from sagaloop.testing import services

pytestmark = pytest.mark.integration

APP = """
from sagaloop import App, SagaContext, StepContext

app = App("credentials")


@app.step()
def noop(ctx: StepContext) -> None:
    return None


@app.saga(name="noop")
async def call_noop(ctx: SagaContext) -> None:
    await ctx.call(noop)
"""


def serve(tmp_path: Path, role: list[str], **settings: str) -> tuple[int, str, float]:
    (tmp_path / "credentials_app.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env.update(settings)
    began = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "sagaloop", *role, "--app", "credentials_app"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode, out.stderr, time.monotonic() - began


def sqlite(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'credentials.db'}"
    store = SqlStore(url)
    store.upgrade()
    store.close()
    return url


def assert_one_line(stderr: str, *expected: str, password: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "CRITICAL" in lines[0] and all(e in lines[0] for e in expected), lines[0]
    assert "pika" not in stderr and password not in stderr


def test_rabbitmq_refusing_the_password_or_the_vhost_stops_the_service(
    tmp_path: Path, rabbitmq_url: str
) -> None:
    url = sa.make_url(rabbitmq_url)
    password = f"wrong-{uuid.uuid4().hex[:8]}"
    wrong = url.set(password=password).render_as_string(hide_password=False)
    code, stderr, took = serve(
        tmp_path, ["engine"], SAGALOOP_DATABASE_URL=sqlite(tmp_path), SAGALOOP_BROKER_URL=wrong
    )
    assert code == 78 and took < 30, stderr
    assert_one_line(
        stderr,
        "engine: cannot connect to the broker amqp://",
        ":***@",
        "the user name or password was refused; check SAGALOOP_BROKER_URL",
        password=password,
    )
    vhost = f"missing-{uuid.uuid4().hex[:8]}"
    code, stderr, _ = serve(
        tmp_path,
        ["worker", "--queue", "default"],
        SAGALOOP_DATABASE_URL=sqlite(tmp_path),
        SAGALOOP_BROKER_URL=url.set(database=vhost).render_as_string(hide_password=False),
    )
    assert code == 78, stderr
    assert_one_line(stderr, f"the virtual host {vhost!r} does not exist", password=password)


def test_postgresql_without_the_role_or_the_database_stops_the_service(tmp_path: Path) -> None:
    server = sa.make_url(services.postgres_url())
    role, database = f"nobody_{uuid.uuid4().hex[:8]}", f"missing_{uuid.uuid4().hex[:8]}"
    password = f"pw-{uuid.uuid4().hex[:8]}"
    no_role = server.set(username=role, password=password).render_as_string(hide_password=False)
    code, stderr, took = serve(tmp_path, ["engine"], SAGALOOP_DATABASE_URL=no_role)
    assert code == 78 and took < 30, stderr
    assert_one_line(
        stderr,
        "engine: cannot connect to the database postgresql://",
        f"the role {role!r} does not exist; check SAGALOOP_DATABASE_URL",
        password=password,
    )
    no_database = server.set(database=database).render_as_string(hide_password=False)
    code, stderr, _ = serve(
        tmp_path, ["--log-format", "json", "dev"], SAGALOOP_DATABASE_URL=no_database
    )
    assert code == 78, stderr
    assert_one_line(stderr, f"the database {database!r} does not exist", password=password)
