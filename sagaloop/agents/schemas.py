"""JSON Schemas of tools, as the model providers and MCP hosts take them, and validation errors
as text a model can act on: shared by :class:`~sagaloop.agents.tools.StepTools` and the MCP
server's tools (:mod:`sagaloop.mcp_server.tools`). Pure pydantic."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pydantic

from sagaloop.errors import DeclarationError

__all__ = ["accepts_none", "clean_schema", "explain", "ordered"]


def clean_schema(raw: dict[str, Any], *, strict: bool = False, what: str = "") -> dict[str, Any]:
    """pydantic's JSON Schema ``raw`` rewritten for the providers: no titles, unused ``$defs``
    dropped; with ``strict``, OpenAI's strict mode (:class:`DeclarationError` naming ``what``
    when it cannot describe a parameter)."""
    return _Cleaner(raw, strict=strict, what=what).root()


def accepts_none(hint: Any) -> bool:
    """Whether ``hint`` takes ``None`` (a parameter that does can be left out of a call as
    null without a default)."""
    try:
        pydantic.TypeAdapter(hint).validate_python(None)
    except Exception:  # pydantic.ValidationError, or a type that cannot validate alone
        return False
    return True


def ordered(schema: dict[str, Any]) -> dict[str, Any]:
    """The root keys in a readable order: type, properties, required, additionalProperties,
    then the rest ($defs last)."""
    first = ("type", "properties", "required", "additionalProperties")
    out = {k: schema[k] for k in first if k in schema}
    out.update({k: v for k, v in schema.items() if k not in out and k != "$defs"})
    if "$defs" in schema:
        out["$defs"] = schema["$defs"]
    return out


class _Cleaner:
    """Rewrites pydantic's JSON Schema for the providers: no titles; with ``strict``, OpenAI's
    strict mode (every object closed and fully required, ``anyOf`` for ``oneOf``, no defaults,
    a ``$ref`` with siblings inlined, free-form objects and ``Any`` refused)."""

    _SCHEMA_MAPS = ("properties", "$defs", "patternProperties", "dependentSchemas")
    _SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
    _SCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
    _TYPED = ("type", "anyOf", "allOf", "oneOf", "$ref", "enum", "const")

    def __init__(self, raw: dict[str, Any], *, strict: bool, what: str) -> None:
        self.raw = raw
        self.strict = strict
        self.what = what
        self.defs: dict[str, Any] = raw.get("$defs", {})

    def root(self) -> dict[str, Any]:
        schema: dict[str, Any] = self.clean(self.raw, "")
        schema.setdefault("type", "object")
        if "$defs" in schema:
            used = self._used_defs(schema)
            schema["$defs"] = {k: v for k, v in schema["$defs"].items() if k in used}
            if not schema["$defs"]:
                del schema["$defs"]
        return schema

    def clean(self, node: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node
        if self.strict and "$ref" in node and len(node) > 1:
            resolved = self.defs.get(str(node["$ref"]).rsplit("/", 1)[-1])
            if resolved is not None:  # siblings of a $ref: inline the definition once
                merged = {**resolved, **{k: v for k, v in node.items() if k != "$ref"}}
                return self.clean(merged, path)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "title" or (self.strict and key in ("default", "discriminator")):
                continue
            if key in self._SCHEMA_MAPS and isinstance(value, dict):
                sep = "$defs." if key == "$defs" else "."
                out[key] = {
                    k: self.clean(v, f"{path}{sep}{k}".lstrip(".")) for k, v in value.items()
                }
            elif key in self._SCHEMA_LISTS and isinstance(value, list):
                out[key] = [self.clean(v, path) for v in value]
            elif key in self._SCHEMAS and isinstance(value, dict):
                out[key] = self.clean(value, f"{path}[]" if key == "items" else path)
            else:
                out[key] = value
        if self.strict:
            self._strict(out, path)
        return out

    def _strict(self, out: dict[str, Any], path: str) -> None:
        where = f"{self.what}, parameter {path!r}" if path else self.what
        if "oneOf" in out:
            out["anyOf"] = out.get("anyOf", []) + out.pop("oneOf")
        if not any(k in out for k in self._TYPED):
            raise DeclarationError(
                f"{where} takes any value, which OpenAI's strict mode cannot describe: annotate "
                "it with a type, or use StepTools(..., strict=False)"
            )
        if out.get("type") == "object":
            extra = out.get("additionalProperties")
            if "properties" not in out or extra not in (None, False):
                raise DeclarationError(
                    f"{where} is a free-form mapping, which OpenAI's strict mode cannot "
                    "describe: use a pydantic model (extra='forbid' or the default), or "
                    "StepTools(..., strict=False)"
                )
            out["additionalProperties"] = False
            out["required"] = list(out["properties"])

    def _used_defs(self, schema: dict[str, Any]) -> set[str]:
        defs: dict[str, Any] = schema.get("$defs", {})
        used: set[str] = set()
        todo = list(_refs({k: v for k, v in schema.items() if k != "$defs"}))
        while todo:
            name = todo.pop()
            if name in used or name not in defs:
                continue
            used.add(name)
            todo.extend(_refs(defs[name]))
        return used


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref.rsplit("/", 1)[-1]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def explain(e: pydantic.ValidationError) -> tuple[str, list[str]]:
    """A validation error as text for a model or a person (at most five problems, each naming
    its argument), and the arguments at fault (``"items.0.qty"`` for a nested one)."""
    problems, fields = [], []
    for x in e.errors()[:5]:
        field = ".".join(map(str, x["loc"]))
        fields.append(field)
        if x["type"] == "extra_forbidden":
            problems.append(f"unexpected argument {field!r}")
        elif x["type"] == "missing":
            problems.append(f"missing argument {field!r}")
        else:
            got = repr(x.get("input"))
            got = got if len(got) <= 60 else got[:57] + "..."
            problems.append(f"argument {field!r}: {x['msg']} (got {got})")
    more = e.error_count() - len(problems)
    return "; ".join(problems) + (f"; and {more} more" if more > 0 else ""), fields
