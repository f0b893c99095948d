"""How the integration tests find their services (sagaloop.testing.services), without any."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sagaloop.testing import services


@pytest.fixture(autouse=True)
def forget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "_found", {})
    monkeypatch.delenv(services.DATABASE_ENV, raising=False)
    monkeypatch.delenv(services.BROKER_ENV, raising=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_the_env_var_wins_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(services.DATABASE_ENV, "postgresql://u:p@db.invalid/x")
    monkeypatch.setattr(services, "docker_answers", lambda: pytest.fail("probed docker"))
    assert services.postgres_url() == "postgresql://u:p@db.invalid/x"


def test_docker_comes_before_local_services(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "docker_answers", lambda: True)
    monkeypatch.setattr(services, "_rabbitmq_container", lambda: "amqp://from-container/")
    assert services.rabbitmq_url() == "amqp://from-container/"
    assert services.rabbitmq_url() == "amqp://from-container/", "found once per process"


def test_nothing_found_fails_with_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "docker_answers", lambda: False)
    port = _closed_port()
    monkeypatch.setattr(services, "LOCAL_POSTGRES", f"postgresql://postgres@127.0.0.1:{port}/p")
    monkeypatch.setattr(services, "LOCAL_RABBITMQ", f"amqp://guest:guest@127.0.0.1:{port}/")
    with pytest.raises(services.ServiceNotFoundError) as pg:
        services.postgres_url()
    assert services.DATABASE_ENV in str(pg.value) and "start PostgreSQL" in str(pg.value)
    with pytest.raises(services.ServiceNotFoundError) as mq:
        services.rabbitmq_url()
    assert services.BROKER_ENV in str(mq.value) and "start RabbitMQ" in str(mq.value)


def test_a_local_port_that_answers_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "docker_answers", lambda: False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"postgresql://postgres@127.0.0.1:{server.getsockname()[1]}/postgres"
        monkeypatch.setattr(services, "LOCAL_POSTGRES", url)
        assert services.postgres_url() == url


@pytest.fixture
def fake_docker(tmp_path: Path) -> Iterator[tuple[Path, list[bytes]]]:
    """A unix socket that answers each connection with the next canned reply."""
    path = tmp_path / "docker.sock"
    replies: list[bytes] = []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                if replies:
                    conn.sendall(replies.pop(0))

    threading.Thread(target=serve, daemon=True).start()
    yield path, replies
    server.close()


def test_docker_answers_only_a_real_ping(
    monkeypatch: pytest.MonkeyPatch, fake_docker: tuple[Path, list[bytes]], tmp_path: Path
) -> None:
    path, replies = fake_docker
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    replies.extend([b"HTTP/1.1 200 OK\r\n\r\nOK", b"HTTP/1.1 500 Internal Server Error\r\n\r\n"])
    assert services.docker_answers() is True
    assert services.docker_answers() is False, "an engine that errors does not answer"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'absent.sock'}")
    started = time.monotonic()
    assert services.docker_answers() is False
    assert time.monotonic() - started < 0.5, "a missing engine is detected quickly"


def test_importable_without_testcontainers() -> None:
    code = (
        "import sys; sys.modules['testcontainers'] = None; "
        "import sagaloop.testing.services as s; print(s.postgres_url.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
