"""Payload conversion: Python values <-> JSON, validated with pydantic from annotations.

Nothing is pickled: every input, result and event payload is stored as JSON and validated
against the declared type when it is read back.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import pydantic
import pydantic_core

from sagaloop.errors import DeclarationError, ValidationError

JSON = Any  # a JSON-compatible value: dict, list, str, int, float, bool or None


class Converter:
    """Validates and converts one declared type."""

    __slots__ = ("_adapter", "annotation")

    def __init__(self, annotation: Any) -> None:
        self.annotation = annotation
        self._adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(annotation)

    def to_json(self, value: Any, *, what: str) -> JSON:
        try:
            # Validate first so that a wrong Python value fails here, not on the reader's side.
            checked = self._adapter.validate_python(value)
            return self._adapter.dump_python(checked, mode="json")
        except (pydantic.ValidationError, pydantic_core.PydanticSerializationError) as e:
            raise ValidationError(
                f"{what} is not a valid {_name(self.annotation)}: {_short(e)}"
            ) from e

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
