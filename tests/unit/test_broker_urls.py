"""A RabbitMQ URL may list the nodes of a cluster: parsing the list, masking every password of
it, and the order in which the broker tries the hosts (round-robin, backoff after a full round)."""

from __future__ import annotations

import logging
import re
import socket
from datetime import timedelta

import pytest

from sagaloop._secrets import mask_url as mask_one
from sagaloop._secrets import passwords_of, scrub
from sagaloop.brokers._amqp import broker_urls, mask_url
from sagaloop.brokers.rabbitmq import RabbitBroker
from sagaloop.errors import BrokerError

LIST = "amqp://u:s3cret-one@h1:5672/vh,amqp://u:s3cret-two@h2:5673/vh"


def test_a_single_url_is_one_host() -> None:
    assert broker_urls("amqp://guest:guest@127.0.0.1:5672/") == [
        "amqp://guest:guest@127.0.0.1:5672/"
    ]


@pytest.mark.parametrize(
    "url",
    [
        LIST,
        LIST.replace(",", ";"),  # as kombu takes them
        LIST.replace(",", " , ") + " ",
        LIST.replace(",", ",\n"),
    ],
)
def test_commas_or_semicolons_separate_whole_urls(url: str) -> None:
    assert broker_urls(url) == [
        "amqp://u:s3cret-one@h1:5672/vh",
        "amqp://u:s3cret-two@h2:5673/vh",
    ]


def test_a_comma_inside_a_password_does_not_split() -> None:
    url = "amqp://u:a,b;c@h1:5672/,amqps://u:d,e@h2:5671/"
    assert broker_urls(url) == ["amqp://u:a,b;c@h1:5672/", "amqps://u:d,e@h2:5671/"]


def test_no_url_is_an_error() -> None:
    with pytest.raises(ValueError, match="no RabbitMQ URL"):
        broker_urls(" ")


def test_every_password_of_a_list_is_masked_and_every_host_kept() -> None:
    masked = mask_url(LIST)
    assert masked == "amqp://u:***@h1:5672/vh,amqp://u:***@h2:5673/vh"
    assert mask_url("amqp://u:a,b;c@h1:5672/,amqps://u:d,e@h2:5671/") == (
        "amqp://u:***@h1:5672/,amqps://u:***@h2:5671/"
    )
    # The one masking function of logs, errors and the CLI is that one.
    assert mask_one(LIST) == masked


def test_the_cli_scrubs_every_password_of_a_list_and_keeps_the_hosts() -> None:
    """A service's log line names the host it connected to; the scrubbing of its output must
    mask each password of a URL list, not take the whole list for one password."""
    text = "connected to RabbitMQ at amqp://u:***@h2:5673/vh (s3cret-two was refused before)"
    assert scrub(text, *passwords_of(LIST)) == (
        "connected to RabbitMQ at amqp://u:***@h2:5673/vh (*** was refused before)"
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens on it now


def test_the_broker_tries_each_host_in_turn_and_backs_off_after_a_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two hosts that refuse connections: the next host is tried at once, and the backoff
    (0.2 s, then 0.4 s...) comes only after both failed; the error names the whole list,
    passwords masked."""
    p1, p2 = closed_port(), closed_port()
    url = f"amqp://guest:pw-one@127.0.0.1:{p1}/,amqp://guest:pw-two@127.0.0.1:{p2}/"
    caplog.set_level(logging.DEBUG, logger="sagaloop.brokers.rabbitmq")
    with pytest.raises(BrokerError) as raised:
        RabbitBroker(url, connect_timeout=timedelta(seconds=1.2))
    assert "pw-" not in str(raised.value)
    assert f"127.0.0.1:{p1}/,amqp://guest:***@127.0.0.1:{p2}/" in str(raised.value)
    tries = re.findall(
        r"connecting to amqp://guest:\*\*\*@127\.0\.0\.1:(\d+)/ failed .*; trying "
        r"amqp://guest:\*\*\*@127\.0\.0\.1:(\d+)/ in ([0-9.]+) s",
        caplog.text,
    )
    assert [(int(a), int(b), float(d)) for a, b, d in tries[:4]] == [
        (p1, p2, 0.0),
        (p2, p1, 0.2),
        (p1, p2, 0.0),
        (p2, p1, 0.4),
    ]
    assert "pw-" not in caplog.text
