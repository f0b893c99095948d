"""Configuration, read only here (the composition root) and at service start-up."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sagaloop.errors import DeclarationError, SagaloopError

if TYPE_CHECKING:
    from sagaloop.sagas.app import App

logger = logging.getLogger(__name__)


class SettingError(ValueError):
    """A setting that does not fit: ``field`` (``lease``), the ``value`` given, and why."""

    def __init__(self, field: str, value: Any, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.value = value
        self.message = message


@dataclasses.dataclass(frozen=True)
class Settings:
    """The ``SAGALOOP_...`` environment variables (their names in any case), read by
    :meth:`read`: plain Python, so that reading them imports nothing (``sagaloop --help`` and
    the commands that do not run saga code start in well under 0.3 s, issue 26)."""

    database_url: str = "sqlite:///sagaloop.db"
    """SQLAlchemy URL of the store. The embedded default is a SQLite file in the current folder."""
    broker_url: str = "database"
    """``database`` (the outbox table is the queue), ``memory`` (one process only), an
    ``amqp://`` URL of RabbitMQ or a ``redis://`` URL of Redis (``--broker-url``)."""
    lease: float = 60.0
    """Seconds a claimed message stays invisible to other consumers (over 0, at most 86,400);
    a worker renews it every third of that while a step runs, so only a dead worker's
    messages are redelivered."""
    namespace: str = "sagaloop"
    """RabbitMQ: the exchange, and the prefix of every queue name."""
    queue_type: Literal["quorum", "classic"] = "quorum"
    retention_days: float = 7.0
    """Finished runs and inbox rows older than this (over 0) are deleted by the engine."""
    activation_deadline: float = 2.0
    """CPU seconds (over 0, at most 3,600) saga code may run without reaching an ``await``
    before its run is parked."""
    crash_at: str = ""
    """Test only: crash points to arm (see sagaloop.runtime.crashpoints)."""
    app: str | None = None
    """The app to load, as ``module`` or ``module:attribute``."""
    log_format: Literal["text", "json"] = "text"
    """Log lines on stderr as text, or as one JSON object each (``--log-format``; any case)."""
    verbose: int = 0
    """1: sagaloop's DEBUG lines; 2: the drivers' too (``-v``, ``-v -v``; 0 or more)."""

    @classmethod
    def read(
        cls, given: dict[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """The settings: ``given`` (the command line's, by field name) over the environment
        (``SAGALOOP_<FIELD>``, in any case), over the defaults. SettingError for a value that
        does not fit its field."""
        given = given or {}
        env = {k.upper(): v for k, v in (os.environ if environ is None else environ).items()}
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            variable = f"SAGALOOP_{field.name.upper()}"
            if field.name in given:
                values[field.name] = _parsed(field.name, given[field.name])
            elif variable in env:
                values[field.name] = _parsed(field.name, env[variable])
        return cls(**values)


_NUMBERS: dict[str, tuple[type[int] | type[float], float, float | None]] = {
    "lease": (float, 0.0, 86_400.0),
    "retention_days": (float, 0.0, None),
    "activation_deadline": (float, 0.0, 3600.0),
    "verbose": (int, -1.0, None),
}
"""A number's type, the value it must be over, and the one it may be at most."""
_CHOICES = {"queue_type": ("quorum", "classic"), "log_format": ("text", "json")}


def _parsed(field: str, value: Any) -> Any:
    """``value`` (a string from the environment, or the command line's value) as ``field``
    holds it; SettingError if it does not fit."""
    if field in _NUMBERS:
        kind, over, at_most = _NUMBERS[field]
        try:
            number = kind(value)
        except (TypeError, ValueError):
            what = "an integer" if kind is int else "a number"
            raise SettingError(field, value, f"should be {what}") from None
        if not number > over or math.isnan(number):
            least = "0 or more" if kind is int else f"greater than {over:g}"
            raise SettingError(field, value, f"should be {least}")
        if at_most is not None and number > at_most:
            raise SettingError(field, value, f"should be at most {at_most:g}")
        return number
    if field in _CHOICES:
        word = value.lower() if field == "log_format" and isinstance(value, str) else value
        if word not in _CHOICES[field]:
            choices = " or ".join(repr(c) for c in _CHOICES[field])
            raise SettingError(field, value, f"should be {choices}")
        return word
    return value


def load_app(spec: str) -> App:
    """Import ``module`` or ``module:attribute`` (or ``path/to/file.py[:attribute]``) and return
    the App it names. A file is imported as the module named after it, with its folder first on
    ``sys.path`` (so the engine and the workers, given the same path, import the same module)."""
    from sagaloop.sagas.app import App  # pydantic's models: loaded with the app, not for --help

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module_name, _, attr = spec.partition(":")
    what = f"app module {module_name!r}"
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        what = f"app file {module_name!r}"
        module_name = _from_path(module_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise DeclarationError(f"cannot import {what}: {e}") from e
    except SagaloopError:
        raise  # a declaration error: its message says what is wrong
    except Exception as e:  # the module raised: say where, keep the traceback for -v
        logger.debug("importing %s failed", what, exc_info=True)
        raise DeclarationError(
            f"cannot import {what}: {_raised(e)} (-v shows the traceback)"
        ) from e
    if attr:
        app = getattr(module, attr, None)
        if not isinstance(app, App):
            raise DeclarationError(f"{spec!r} is not a sagaloop App")
        return app
    apps = [v for v in vars(module).values() if isinstance(v, App)]
    if len(apps) != 1:
        raise DeclarationError(
            f"module {module_name!r} defines {len(apps)} Apps: name one as {module_name}:ATTRIBUTE"
        )
    return apps[0]


def _raised(e: Exception) -> str:
    """``e`` in one line, with where it was raised (a syntax error names its line itself)."""
    text = " ".join(str(e).split()) or "no message"
    if isinstance(e, SyntaxError):
        return f"{type(e).__name__}: {text}"
    frames = traceback.extract_tb(e.__traceback__)
    where = f", raised at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {text}{where}"


def _from_path(path: str) -> str:
    """The module name of the app file ``path``, its folder put first on ``sys.path``."""
    file = Path(path)
    if file.suffix != ".py":
        raise DeclarationError(f"{path!r}: an app file's name ends in .py")
    if not file.is_file():
        raise DeclarationError(f"{path!r}: no such file (run from the folder it is relative to)")
    folder = str(file.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return file.stem
