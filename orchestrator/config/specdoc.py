"""A spec's fields in words — type, default, allowed values — for `orch run PLAYBOOK --help` and for
validation errors a person can act on (the key, the bad value, what is allowed, did-you-mean)."""

from __future__ import annotations

import difflib
import json
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

_NAMES: dict[Any, str] = {str: "text", int: "integer", float: "number", bool: "true|false", type(None): "none"}
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="),
           ("max_length", "length <="), ("pattern", "matching"))


@dataclass(frozen=True)
class FieldDoc:
    name: str
    type: str  # in words: "integer", "list of integer", "one of "warn", "kill", "dump""
    required: bool
    default: Any  # a JSON value; None when the field is unset by default
    description: str
    bounds: str  # "> 0", "matching ^...$": what validation adds to the type

    @property
    def default_text(self) -> str:
        if self.required:
            return "required"
        return "unset" if self.default is None else json.dumps(self.default)


def type_text(annotation: Any) -> str:
    """A type as a person reads it, in the words of the TOML it is given in."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if origin is list:
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {type_text(args[1])}" if args else "table"
    return _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(metadata: list[Any]) -> str:
    found = []
    for item in metadata:
        for attr, word in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{word} {value}")
    return ", ".join(found)


def fields(spec_cls: type[BaseModel]) -> list[FieldDoc]:
    """Every field of a spec, in declaration order (the playbook's own after the common ones)."""
    docs = []
    for name, info in spec_cls.model_fields.items():
        required = info.is_required()
        default = None if required else info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):  # a table's default (serve-bench's `bench`): as the JSON it is given in
            default = default.model_dump(mode="json")
        docs.append(FieldDoc(name, type_text(info.annotation), required, default, info.description or "",
                             _bounds(info.metadata)))
    return docs


def did_you_mean(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _value(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def problems(spec_cls: type[BaseModel], exc: ValidationError, origin: Callable[[str], str] | None = None) -> list[str]:
    """One line per problem: `key = value (where it came from): what is wrong; what is allowed`."""
    known = {d.name: d for d in fields(spec_cls)}
    lines = []
    for e in exc.errors():
        key = ".".join(str(p) for p in e["loc"])
        source = origin(key) if origin and key else ""
        where = f" ({source})" if source else ""
        given = "" if e["type"] == "missing" or not key else f" = {_value(e['input'])}"
        doc = known.get(str(e["loc"][0])) if e["loc"] else None
        if e["type"] == "extra_forbidden":
            hint = did_you_mean(key, list(known)) or "; not a key of this spec"
            lines.append(f"{key}{given}{where}: unknown key{hint}")
            continue
        if e["type"] == "missing":
            what = f"required ({doc.type}{': ' + doc.description if doc and doc.description else ''})" if doc else "required"
            lines.append(f"{key}: {what}, not given")
            continue
        msg = e["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        if e["type"] == "literal_error" and doc and isinstance(e["input"], str):
            choices = [str(a) for a in get_args(spec_cls.model_fields[doc.name].annotation)]
            msg += did_you_mean(e["input"], choices)
        elif doc and (e["type"].endswith("_type") or e["type"].endswith("_parsing")):
            msg += f" (expected {doc.type})"
        lines.append(f"{key}{given}{where}: {msg}" if key else msg)
    return lines
