"""The policy file reference (Markdown), generated from the policy model so the two cannot disagree."""

from __future__ import annotations

import types
import typing
from decimal import Decimal
from fractions import Fraction
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from gpupool.policies import model as m

_SIMPLE = {str: "string", int: "integer", bool: "boolean", Decimal: "decimal", Fraction: "share"}


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        if annotation == m.Quantity:
            return "quantity"
        return _type_name(base)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        return f"map of {_type_name(typing.get_args(annotation)[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return _SIMPLE.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is None or value is PydanticUndefined:
        return "—"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]" if value else "[]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _models(root: type[BaseModel]) -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in seen:
                seen.append(annotation)
                for field in annotation.model_fields.values():
                    visit(field.annotation)
            return
        for arg in typing.get_args(annotation):
            visit(arg)

    visit(root)
    return seen


def policy_reference() -> str:
    lines = [
        "Types: *share* is a fraction of one card (`0.25`, `\"1/3\"`) or a whole number of cards; *quantity* is a "
        "Kubernetes quantity (`4`, `500m`, `32Gi`); *decimal* is an exact number (`\"3.20\"`). Unknown keys, "
        "negative and non-finite numbers are errors.",
        "",
    ]
    for model in _models(m.Policy):
        lines.append(f"### {model.__name__}")
        doc = (model.__doc__ or "").strip().splitlines()
        if doc:
            lines += ["", doc[0]]
        lines += ["", "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            description = (field.description or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {description} |")
        lines.append("")
    return "\n".join(lines)
