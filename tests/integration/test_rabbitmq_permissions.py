"""Live streams and namespaces under the least-privilege permissions of docs/operations.md: a
user that may configure, write and read ``^<namespace>(\\..*)?$`` only, in a vhost of its own.

- ``sagaloop tail`` works: its reader's queue is named inside the namespace (a server-named
  ``amq.gen-...`` queue is refused by that pattern);
- no namespace's pattern matches another namespace's resources: a namespace may not hold a
  dot (``x`` and ``x.eu``: ``^x(\\..*)?$`` would match every queue of ``x.eu``), and a user of
  ``x`` can touch nothing of ``xeu`` nor of ``x-eu``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import pika
import pika.exceptions
import pytest
from click.testing import CliRunner

from sagaloop import App, SagaContext
from sagaloop.brokers.rabbitmq import RabbitBroker
from sagaloop.brokers.streams import RabbitStreams
from sagaloop.cli.main import cli
from sagaloop.errors import ValidationError
from sagaloop.testing import Harness

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def rabbitmqctl(*args: str) -> str:
    out = subprocess.run(["rabbitmqctl", *args], capture_output=True, timeout=60, text=True)
    assert out.returncode == 0, f"rabbitmqctl {' '.join(args)}: {out.stderr}"
    return out.stdout


def documented_pattern(namespace: str) -> str:
    """The services' line of docs/operations.md, for ``namespace``: its three patterns."""
    [line] = [
        x
        for x in DOCS.read_text().splitlines()
        if x.startswith("rabbitmqctl set_permissions") and " sagaloop " in x
    ]
    patterns = re.findall(r"'([^']*)'", line)
    assert len(patterns) == 3 and len(set(patterns)) == 1, line
    return patterns[0].replace("sagaloop", namespace)


@dataclass
class Vhost:
    name: str
    admin_url: str

    def user_url(self, namespace: str) -> str:
        """A new user of the vhost with exactly the documented permissions of ``namespace``."""
        user, password = f"u-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        rabbitmqctl("add_user", user, password)
        pattern = documented_pattern(namespace)
        rabbitmqctl("set_permissions", "-p", self.name, user, pattern, pattern, pattern)
        self.users.append(user)
        return self.admin_url.replace("guest:guest@", f"{user}:{password}@")

    users: list[str]


@pytest.fixture
def vhost(rabbitmq_url: str) -> Iterator[Vhost]:
    """A vhost of its own (guest administers it), deleted with its users at the end."""
    name = f"perm-{uuid.uuid4().hex[:8]}"
    assert "guest:guest@" in rabbitmq_url, "expected a broker URL with guest:guest"
    rabbitmqctl("add_vhost", name)
    rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    parts = urlsplit(rabbitmq_url)
    admin = f"{parts.scheme}://{parts.netloc}/{quote(name, safe='')}"
    v = Vhost(name, admin, [])
    try:
        yield v
    finally:
        for user in v.users:
            rabbitmqctl("delete_user", user)
        rabbitmqctl("delete_vhost", name)


def test_the_documented_pattern_is_the_one_tested() -> None:
    assert documented_pattern("ns") == r"^ns(\..*)?$"


def test_a_stream_reader_works_under_the_documented_permissions(vhost: Vhost) -> None:
    ns = f"s{uuid.uuid4().hex[:8]}"
    streams = RabbitStreams(vhost.user_url(ns), namespace=ns)
    try:
        reader = streams.subscribe("r-1")
        streams.publish("r-1", {"n": 1})
        got: list[object] = []
        for _ in range(40):
            got += reader.get(0.25)
            if got:
                break
        assert got == [{"n": 1}]
        reader.close()
    finally:
        streams.close()


APP = App("perm_tail")


@APP.saga(name="hello")
async def hello(ctx: SagaContext, name: str) -> str:
    return f"hello {name}"


def test_sagaloop_tail_works_under_the_documented_permissions(
    vhost: Vhost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    url = f"sqlite:///{tmp_path / 'tail.db'}"
    harness = Harness(APP, url=url)
    try:
        harness.start("hello", "ada", run_id="r-1")
        harness.run_until_idle()
    finally:
        harness.close()
    for name in [n for n in os.environ if n.startswith("SAGALOOP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)
    monkeypatch.setenv("SAGALOOP_BROKER_URL", vhost.user_url(ns))
    monkeypatch.setenv("SAGALOOP_NAMESPACE", ns)
    result = CliRunner().invoke(cli, ["tail", "r-1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "run_finished" in result.output or "saga_finished" in result.output, result.output


@pytest.mark.parametrize("namespace", ["x.eu", "amq", "amq.x", "x*", "", "x y", "ns/1"])
def test_a_namespace_another_ones_pattern_would_match_is_refused(
    vhost: Vhost, namespace: str
) -> None:
    with pytest.raises(ValidationError, match="namespace"):
        RabbitBroker(vhost.admin_url, namespace=namespace)
    with pytest.raises(ValidationError, match="namespace"):
        RabbitStreams(vhost.admin_url, namespace=namespace)


def test_the_cli_refuses_a_dotted_namespace_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vhost: Vhost
) -> None:
    for name in [n for n in os.environ if n.startswith("SAGALOOP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", f"sqlite:///{tmp_path / 'ns.db'}")
    monkeypatch.setenv("SAGALOOP_BROKER_URL", vhost.admin_url)
    monkeypatch.setenv("SAGALOOP_NAMESPACE", "x.eu")
    assert CliRunner().invoke(cli, ["db", "upgrade"]).exit_code == 0
    result = CliRunner().invoke(cli, ["health"], catch_exceptions=False)
    assert result.exit_code == 1
    assert "namespace 'x.eu'" in result.output and "Traceback" not in result.output


def test_a_user_of_one_namespace_cannot_touch_anothers(vhost: Vhost) -> None:
    ns = f"x{uuid.uuid4().hex[:6]}"
    others = [f"{ns}eu", f"{ns}-eu", f"{ns}_eu"]
    admin = RabbitBroker(vhost.admin_url, namespace=others[0], signing_key=b"k" * 32)
    try:
        admin.declare(["app.engine"])
    finally:
        admin.close()
    mine = RabbitBroker(vhost.user_url(ns), namespace=ns, signing_key=b"k" * 32)
    try:
        mine.declare(["app.engine"])  # its own: allowed
        mine.publish([("app.engine", b"{}")])
    finally:
        mine.close()
    connection = pika.BlockingConnection(pika.URLParameters(vhost.user_url(ns)))
    try:
        for other in others:
            for act in (
                lambda ch, o=other: ch.basic_get(f"{o}.app.engine"),
                lambda ch, o=other: ch.queue_purge(f"{o}.app.engine"),
                lambda ch, o=other: ch.basic_publish(o, "app.engine", b"{}"),
                lambda ch, o=other: ch.queue_declare(f"{o}.app.steps.q"),
            ):
                channel = connection.channel()
                with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="ACCESS_REFUSED"):
                    act(channel)
                    channel.basic_qos(prefetch_count=1)  # a round trip: see the close
    finally:
        if connection.is_open:
            connection.close()


def test_a_service_with_a_dotted_namespace_stops_at_once(vhost: Vhost, tmp_path: Path) -> None:
    """Not a broker that is down: the service says what to fix and exits, instead of retrying."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env.update(
        SAGALOOP_DATABASE_URL=f"sqlite:///{tmp_path / 'svc.db'}",
        SAGALOOP_BROKER_URL=vhost.admin_url,
        SAGALOOP_NAMESPACE="x.eu",
        PYTHONPATH=str(Path(__file__).resolve().parents[1] / "unit"),
    )
    done = subprocess.run(
        [sys.executable, "-m", "sagaloop", "dev", "--app", "mcp_sagas_app"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("Error:")]
    assert "namespace 'x.eu'" in line and "retrying" not in done.stderr, done.stderr
