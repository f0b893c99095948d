"""Payload conversion: Python values <-> JSON, validated with pydantic from annotations.

Nothing is pickled: every input, result and event payload is stored as JSON and validated
against the declared type when it is read back. Every value sagaloop produces (saga inputs and
outputs, step arguments and results) also passes :func:`encode_value`, so that a value that could
not be stored or sent fails where it was produced, with a reason, instead of later in a
transaction that would fail the same way on every attempt.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import typing
from collections.abc import Callable
from typing import Any

import pydantic
import pydantic_core

from sagaloop.errors import DeclarationError, UnencodableError, ValidationError

JSON = Any  # a JSON-compatible value: dict, list, str, int, float, bool or None

MAX_VALUE_BYTES = 32 * 1024 * 1024
"""The largest value (its compact UTF-8 JSON) that sagaloop stores and sends: a saga input or
output, a step argument or result. Large values travel by reference to the payload table; one
above this limit fails the step or saga that produced it."""
MAX_VALUE_DEPTH = 100
"""Objects and arrays nested deeper than this are refused in a value (a message may nest 128
levels, its envelope included)."""
_KEEP_NAN = pydantic.ConfigDict(ser_json_inf_nan="constants")
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def encode_value(data: JSON, *, what: str) -> bytes:
    """The compact UTF-8 JSON of ``data``; else :class:`~sagaloop.errors.UnencodableError` (a
    ValidationError) naming ``what`` and why it cannot be stored or sent: an integer over
    Python's digit limit, NaN or Infinity, a string holding a lone surrogate (text cut inside a
    character), nesting deeper than MAX_VALUE_DEPTH, or more than MAX_VALUE_BYTES. It costs one
    ``json.dumps`` of the value (about 50 µs for 2 KB)."""
    try:
        text = _ENCODER.encode(data)
        encoded = text.encode()
    except UnicodeEncodeError as e:
        raise UnencodableError(_surrogate(what, e)) from e
    except RecursionError as e:
        raise UnencodableError(f"{what} cannot be stored: nested too deeply") from e
    except (TypeError, ValueError) as e:  # NaN/Infinity, an int over the digit limit
        reason = str(e)
        if "Out of range float" in reason:
            reason = "NaN and Infinity are not JSON; send null or a string instead"
        elif "integer string conversion" in reason:
            reason = (
                "an integer has more digits than Python converts to text "
                f"({sys.get_int_max_str_digits()}); send it as a string"
            )
        raise UnencodableError(f"{what} cannot be stored as JSON: {reason}") from e
    if len(encoded) > MAX_VALUE_BYTES:
        raise UnencodableError(
            f"{what} cannot be stored: {len(encoded)} bytes of JSON is over the limit of "
            f"{MAX_VALUE_BYTES} bytes; store it elsewhere and pass a reference"
        )
    if text.count("[") + text.count("{") > MAX_VALUE_DEPTH and _depth(data) > MAX_VALUE_DEPTH:
        raise UnencodableError(
            f"{what} cannot be stored: nested deeper than {MAX_VALUE_DEPTH} levels"
        )
    return encoded


def _surrogate(what: str, e: UnicodeEncodeError) -> str:
    bad = e.object[e.start : e.end].encode("unicode_escape").decode()
    return (
        f"{what} cannot be stored: a string holds the lone surrogate '{bad}' (text cut inside "
        "a character?); repair it first, e.g. text.encode('utf-8', 'replace').decode()"
    )


def _depth(data: JSON) -> int:
    """How deeply objects and arrays nest in ``data`` (a scalar: 0)."""
    deepest = 0
    stack: list[tuple[JSON, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, depth)
            stack.extend((item, depth + 1) for item in value)
    return deepest


class Converter:
    """Validates and converts one declared type."""

    __slots__ = ("_adapter", "annotation")

    def __init__(self, annotation: Any) -> None:
        self.annotation = annotation
        self._adapter: pydantic.TypeAdapter[Any]
        try:  # keep NaN and Infinity as they are, for encode_value to refuse them
            self._adapter = pydantic.TypeAdapter(annotation, config=_KEEP_NAN)
        except pydantic.PydanticUserError:  # a model, dataclass or TypedDict: its own config
            self._adapter = pydantic.TypeAdapter(annotation)

    def to_json(self, value: Any, *, what: str) -> JSON:
        try:
            # Validate first so that a wrong Python value fails here, not on the reader's side.
            checked = self._adapter.validate_python(value)
            data = self._adapter.dump_python(checked, mode="json")
        except (pydantic.ValidationError, pydantic_core.PydanticSerializationError) as e:
            raise ValidationError(
                f"{what} is not a valid {_name(self.annotation)}: {_short(e)}"
            ) from e
        except UnicodeEncodeError as e:  # pydantic met a lone surrogate (in a key)
            raise UnencodableError(_surrogate(what, e)) from e
        encode_value(data, what=what)
        return data

    def json_schema(self) -> dict[str, Any] | None:
        """The type's JSON Schema, or None if it has none."""
        try:
            return self._adapter.json_schema()
        except (pydantic.PydanticUserError, TypeError, ValueError):
            return None

    def from_json(self, data: JSON, *, what: str) -> Any:
        try:
            return self._adapter.validate_python(data)
        except pydantic.ValidationError as e:
            raise ValidationError(
                f"{what} is not a valid {_name(self.annotation)}: {_short(e)}"
            ) from e


def _short(e: Exception) -> str:
    """A one-line summary of a pydantic error."""
    if isinstance(e, pydantic.ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, x['loc'])) or 'value'}: {x['msg']}" for x in e.errors()[:5]
        )
    return str(e).splitlines()[0]


ANY = Converter(Any)


def _name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or repr(annotation)


class Signature:
    """The converters of a function's parameters after the context, and of its result."""

    def __init__(self, fn: Callable[..., Any], *, what: str, skip: int = 1) -> None:
        try:
            hints = typing.get_type_hints(fn)
        except Exception as e:  # unresolvable forward reference
            raise DeclarationError(f"{what}: cannot resolve annotations: {e}") from e
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        if len(params) < skip:
            raise DeclarationError(f"{what} must take a context as its first parameter")
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise DeclarationError(f"{what}: *args and **kwargs are not supported")
        self.params = params[skip:]
        self.inspect_signature = sig.replace(parameters=self.params)
        self.converters = {p.name: Converter(hints.get(p.name, Any)) for p in self.params}
        self.result = Converter(hints.get("return", Any))

    def args_to_json(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, what: str) -> JSON:
        try:
            bound = self.inspect_signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ValidationError(f"{what}: {e}") from e
        bound.apply_defaults()
        return {
            name: self.converters[name].to_json(value, what=f"{what} argument {name!r}")
            for name, value in bound.arguments.items()
        }

    @functools.cached_property
    def _schema(self) -> dict[str, Any] | None:
        fields: dict[str, Any] = {
            p.name: (self.converters[p.name].annotation, ... if p.default is p.empty else None)
            for p in self.params
        }
        try:
            model = pydantic.create_model(
                "arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields
            )
            return model.model_json_schema()
        except (pydantic.PydanticUserError, TypeError, ValueError):
            return None

    def args_schema(self) -> dict[str, Any] | None:
        """The JSON Schema of the arguments as an object (None if a type has none)."""
        return self._schema

    def args_from_json(self, data: JSON, *, what: str) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise ValidationError(f"{what}: arguments must be a JSON object")
        unknown = set(data) - set(self.converters)
        if unknown:
            raise ValidationError(f"{what}: unexpected arguments {sorted(unknown)}")
        out: dict[str, Any] = {}
        for p in self.params:
            if p.name in data:
                out[p.name] = self.converters[p.name].from_json(
                    data[p.name], what=f"{what} argument {p.name!r}"
                )
            elif p.default is p.empty:
                raise ValidationError(f"{what}: missing argument {p.name!r}")
        return out
