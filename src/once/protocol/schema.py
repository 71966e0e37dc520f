"""Request validation with the official SDKs' own types, errors naming the param at fault.

A body is checked against an SDK's TypedDict through a pydantic TypeAdapter, so the schema
is exactly what the SDK sends; the first error becomes an `InvalidRequestError` whose
`param` is the field path an API user understands (`input[2].content[0].text`).
"""

import functools
import re
import typing
from collections.abc import Iterator
from typing import Any

from once.protocol.errors import InvalidRequestError


@functools.cache
def types_by_name(union: Any) -> dict[str, Any]:
    """The members of an SDK union of TypedDicts by the values of their `type` literal
    (the SDK writes the annotation as a string: "Required[Literal['function']]")."""
    table: dict[str, Any] = {}
    for member in typing.get_args(union):
        annotation = getattr(member, "__annotations__", {}).get("type")
        text = getattr(annotation, "__forward_arg__", None) or str(annotation)
        for name in re.findall(r"'([A-Za-z0-9_.-]+)'", text):
            table.setdefault(name, member)
    return table


class SdkType:
    """An SDK TypedDict with its validator. The SDKs write `Required[...]` inside string
    annotations of `total=False` classes, which Python cannot see at class creation (their
    `__required_keys__` is empty), so pydantic would take a body that lacks a required
    field: the required keys are read from the annotations' text here and checked first."""

    def __init__(self, typed_dict: Any):
        from pydantic import TypeAdapter

        self.typed_dict = typed_dict
        self.adapter = TypeAdapter(typed_dict)
        self.required = required_keys(typed_dict)

    def validate_python(self, value: Any, strict: bool = False) -> Any:
        return self.adapter.validate_python(value, strict=strict)


def required_keys(typed_dict: Any) -> tuple[str, ...]:
    keys: list[str] = []
    for cls in reversed(getattr(typed_dict, "__mro__", ())):
        for key, annotation in getattr(cls, "__annotations__", {}).items():
            text = getattr(annotation, "__forward_arg__", None) or str(annotation)
            if text.startswith(("Required[", "typing_extensions.Required[")) and key not in keys:
                keys.append(key)
    return tuple(keys)


def validate(adapter: Any, value: Any, prefix: str = "", *, strict: bool = False) -> None:
    from pydantic import ValidationError

    if isinstance(adapter, SdkType) and isinstance(value, dict):
        for key in adapter.required:
            if key not in value:
                param = f"{prefix}.{key}" if prefix else key
                raise InvalidRequestError(f"missing required parameter: {param!r}", param=param)
    try:
        validated = adapter.validate_python(value, strict=strict)
    except ValidationError as e:
        raise schema_error(e, prefix) from None
    _check_lazy_lists(validated, prefix)


def _check_lazy_lists(validated: Any, prefix: str) -> None:
    """Pydantic checks an `Iterable[...]` field lazily, only as it is iterated, and the
    SDKs type every list that way: walk the validated value and iterate each such field,
    so its items are checked too (an error names the field as if checked at once)."""
    from pydantic import ValidationError

    stack: list[tuple[Any, tuple]] = [(validated, ())]
    while stack:
        node, loc = stack.pop()
        if isinstance(node, dict):
            stack.extend((child, (*loc, key)) for key, child in node.items())
        elif isinstance(node, list | tuple):
            stack.extend((child, (*loc, i)) for i, child in enumerate(node))
        elif isinstance(node, Iterator):
            try:
                items = list(node)
            except ValidationError as e:
                raise schema_error(e, prefix, loc) from None
            stack.extend((child, (*loc, i)) for i, child in enumerate(items))


# pydantic's loc holds union branch tags ("str", "list[...]", "EasyInputMessageParam")
# between the real field names; the param an API user understands skips them.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "function-after"}


def _param_from_loc(loc: tuple) -> str | None:
    parts: list[str] = []
    for element in loc:
        if isinstance(element, int):
            parts.append(f"[{element}]")
        elif (
            isinstance(element, str)
            and element not in _TYPE_TAGS
            and element.replace("_", "").isalnum()
            and element[:1].islower()
        ):
            parts.append(("." if parts else "") + element)
    return "".join(parts) or None


def schema_error(error, prefix: str, outer_loc: tuple = ()) -> InvalidRequestError:
    # A union reports one error per branch; the deepest one is the user's likeliest mistake.
    details = [{**detail, "loc": (*outer_loc, *detail["loc"])} for detail in error.errors()]
    best = max(details, key=lambda d: len(_param_from_loc(d["loc"]) or ""))
    inner = _param_from_loc(best["loc"])
    if inner is None:
        param = prefix or None
    elif inner.startswith("["):
        param = prefix + inner
    else:
        param = f"{prefix}.{inner}" if prefix else inner
    return InvalidRequestError(f"invalid value for '{param}': {best['msg']}", param=param)
