"""Configuration, read only here (the composition root) and at service start-up."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sagaloop.errors import DeclarationError, SagaloopError

if TYPE_CHECKING:
    from sagaloop.sagas.app import App

logger = logging.getLogger(__name__)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SAGALOOP_", extra="ignore")

    database_url: str = "sqlite:///sagaloop.db"
    """SQLAlchemy URL of the store. The embedded default is a SQLite file in the current folder."""
    broker_url: str = "database"
    """``database`` (the outbox table is the queue), ``memory`` (one process only), an
    ``amqp://`` URL of RabbitMQ or a ``redis://`` URL of Redis (``--broker-url``)."""
    lease: float = Field(default=60.0, gt=0, le=86_400)
    """Seconds a claimed message stays invisible to other consumers; a worker renews it every
    third of that while a step runs, so only a dead worker's messages are redelivered."""
    namespace: str = "sagaloop"
    """RabbitMQ: the exchange, and the prefix of every queue name."""
    queue_type: Literal["quorum", "classic"] = "quorum"
    retention_days: float = Field(default=7.0, gt=0)
    """Finished runs and inbox rows older than this are deleted by the engine."""
    activation_deadline: float = Field(default=2.0, gt=0, le=3600)
    """CPU seconds saga code may run without reaching an ``await`` before its run is parked."""
    crash_at: str = ""
    """Test only: crash points to arm (see sagaloop.runtime.crashpoints)."""
    app: str | None = None
    """The app to load, as ``module`` or ``module:attribute``."""
    log_format: Literal["text", "json"] = "text"
    """Log lines on stderr as text, or as one JSON object each (``--log-format``)."""
    verbose: int = Field(default=0, ge=0)
    """1: sagaloop's DEBUG lines; 2: the drivers' too (``-v``, ``-v -v``)."""

    @field_validator("log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


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
