"""No piece of a password reaches the output, however the password is written: raw (not
percent-encoded) ``@ % : / # ?`` in it, in a list of URLs split by ``,`` or ``;``, or as a
``?password=`` parameter; ``health`` quotes the driver's error about the URL, and that error
quotes the piece of the password the driver took for a port."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_env import cli_database, run

from sagaloop._secrets import mask_url, passwords_of, scrub
from sagaloop.brokers import _amqp
from sagaloop.store import connect

PASSWORDS = ["%41/Qzv", "Qz/%41", "Q%41#Xkv", "Q@z:%41/Xk", "%41%42", "Qz;%41,Xk", "Q"]


def pieces(password: str) -> list[str]:
    """What must not be shown: the password, and every piece of it between separators."""
    return [p for p in re.split(r"[/#?:@;,]+", password) if p] + [password]


def lists(password: str) -> list[str]:
    one = f"amqp://u:{password}@127.0.0.1:5672/"
    two = "amqp://guest:guest@127.0.0.1:5673/"
    return [one, f"{one},{two}", f"{two};{one}", f"{two} , {one}"]


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cli_database(tmp_path, monkeypatch, "masking_app", "")


@pytest.mark.parametrize("password", PASSWORDS)
def test_health_shows_no_piece_of_a_raw_password(
    cli: None, monkeypatch: pytest.MonkeyPatch, password: str
) -> None:
    for url in lists(password):
        monkeypatch.setenv("SAGALOOP_BROKER_URL", url)
        for args in (["health"], ["health", "--json"]):
            result = run(*args)
            assert result.exit_code == 1
            shown = result.output
            if "--json" in args:
                shown += json.loads(result.output)["broker"]
            for piece in pieces(password):
                assert re.search(rf"(?<![A-Za-z0-9]){re.escape(piece)}", shown) is None, (
                    piece,
                    url,
                    shown,
                )


@pytest.mark.parametrize("password", PASSWORDS)
def test_the_driver_quoting_a_piece_is_scrubbed(password: str) -> None:
    for piece in pieces(password):
        text = f"Port could not be cast to integer value as '{piece}'"
        assert scrub(text, *passwords_of(",".join(lists(password)))) == (
            "Port could not be cast to integer value as '***'"
        )


def test_query_string_passwords_in_every_form_are_masked() -> None:
    for url in (
        "amqp://h/?password=Se%41cret&x=1",
        "amqp://h/?x=1&PASSWORD=Se@cret",
        "amqp://h/;amqp://h2/?password=Se:cret",
        "postgresql://h/db?user=u&password=Se%41cret",
    ):
        masked = mask_url(url)
        assert "Se" not in masked and "cret" not in masked, masked


def test_there_is_one_masking_function() -> None:
    assert _amqp.mask_url is mask_url
    assert connect.mask_url is mask_url


def test_every_password_parameter_is_masked_and_known() -> None:
    for url in (
        "postgresql://u@h/db?sslpassword=Zq7%41kk",
        "postgresql://u@h/db?sslmode=require&SSLPASSWORD=Zq7%41kk",
        "amqp://h/?passwd=Zq7%41kk",
        "amqp://h/?x=1;pwd=Zq7%41kk",
    ):
        masked = mask_url(url)
        assert "Zq7" not in masked and "kk" not in masked, masked
    # a driver that quotes a piece of a parameter's password is scrubbed of it too
    url = "amqp://u@h1/?password=Zq7%41kk,amqp://u:pw@h2/"
    assert scrub("bad value 'Zq7%41kk' and 'Zq7A'", *passwords_of(url)) == (
        "bad value '***' and '***'"
    )
    text = "host=h sslpassword=Zq7 password = 'a b' user=u"
    assert scrub(text) == "host=h sslpassword=*** password = *** user=u"


def test_the_cli_knows_the_database_urls_password_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sagaloop.cli.common import Obj

    monkeypatch.setenv("SAGALOOP_DATABASE_URL", "postgresql://u:p%41ss@h/db?sslpassword=Kx9z")
    monkeypatch.setenv("SAGALOOP_BROKER_URL", "database")
    assert Obj().scrub("key 'Kx9' of 'p%41ss' is Kx9z") == "key '***' of '***' is ***"
