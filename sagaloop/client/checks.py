"""The client refuses, before anything is written, what the engine would refuse after: it
checks with the engine's own rules (the Envelope's fields, Envelope.from_bytes and the
converters' encode_value), so a run is never written whose start the engine dead-letters."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pydantic_core
from pydantic import BaseModel

from sagaloop.engine.messages import MAX_MESSAGE_BYTES, Envelope
from sagaloop.errors import MessageError, ValidationError
from sagaloop.sagas.convert import Converter, encode_value


def check_text(
    value: str, what: str, model: type[BaseModel] = Envelope, field: str = "run_id"
) -> str:
    """``value`` if the engine's ``model.field`` accepts it (for ids and names: 1 to 200
    characters of text that UTF-8 can encode, without NUL), else one ValidationError line."""
    try:
        model.__pydantic_validator__.validate_assignment(model.model_construct(), field, value)
    except pydantic.ValidationError as e:
        shown = repr(value)
        shown = shown if len(shown) <= 50 else shown[:45] + "...'"
        error = e.errors()[0]
        reason = (
            "it holds invalid UTF-8 or a lone surrogate"
            if error["type"] == "string_unicode"
            else error["msg"].removeprefix("Value error, ")
        )
        raise ValidationError(
            f"{what} must be 1 to 200 characters of valid UTF-8 text, without NUL: "
            f"{shown} is refused ({reason})"
        ) from e
    return value


def to_json(value: Any, converter: Converter, what: str) -> Any:
    """``value`` as the JSON that is stored and sent: valid for ``converter``'s type and
    storable. NaN and Infinity are refused even where pydantic would quietly write null."""
    try:
        plain = pydantic_core.to_jsonable_python(value, inf_nan_mode="constants")
    except (pydantic_core.PydanticSerializationError, ValueError):
        pass  # not JSON-like at all: the converter says why
    else:
        encode_value(plain, what=what)
    return converter.to_json(value, what=what)


def check_message(env: Envelope) -> None:
    """Refuse, before anything is written, a message that consumers would dead-letter: its bytes
    are read back as the engine reads them."""
    try:
        body = env.to_bytes()
    except pydantic_core.PydanticSerializationError as e:
        raise ValidationError(f"the {env.type} message of run {env.run_id!r}: {e}") from e
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValidationError(
            f"the {env.type} message of run {env.run_id!r} would be {len(body)} bytes, over the "
            f"limit of {MAX_MESSAGE_BYTES}: keep large payloads out of messages (store them "
            "and pass a reference)"
        )
    try:
        Envelope.from_bytes(body)
    except MessageError as e:
        raise ValidationError(f"the engine would refuse the {env.type} message: {e}") from e


def same_json(a: Any, b: Any) -> bool:
    """Whether two JSON values are equal as JSON (key order aside)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
