"""One annotation-driven type check for the fields of openk3's config dataclasses.

:func:`check_fields` reads a dataclass's field annotations and checks each value against its
own: ``int`` (a bool is not an integer; at most int64, since sizes become tensor shapes and ids
int64 tensors), ``float`` (an int or float, finite: JSON admits NaN, Infinity and huge integers),
``str``, ``bool``, ``dict`` / ``Mapping``, ``list[X]`` / ``tuple[X, ...]`` / ``tuple[X, Y]``
(items checked), ``Literal[...]``, unions and ``Optional[...]`` (``X | None``), a class
(``isinstance``), ``Callable`` (``callable``); ``Any`` / ``object`` accept anything. A field's
``metadata["expect"]`` replaces the generated description of what it must be.

A wrong value raises ``ValueError("Owner.field=value: must be <description>")`` with the value
as ``repr`` and the description in words (``an integer``, ``a finite number or null``, ``one of
cosine, wsd``). Range and consistency checks specific to one field stay in the class that owns
the field; they run after this check, so they can trust the types.

Used by :class:`openk3.config.K3Config`, :class:`openk3.vision.config.VisionConfig`,
:class:`openk3.engine.EngineConfig`, :class:`openk3.train.trainer.StepConfig`,
:class:`openk3.train.run_config.RunConfig` and the recipes' settings (:mod:`openk3.recipes`).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import math
import sys
import types
import typing
from typing import Any

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_NONE = type(None)


def _finite(value: int | float) -> bool:
    """True for a number a float64 holds finitely (a huge integer overflows the conversion)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _union_args(hint: Any) -> tuple | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


def describe(hint: Any) -> str:
    """What a value of type ``hint`` is, in words: ``int | None`` -> ``"an integer or null"``."""
    args = _union_args(hint)
    if args is not None:
        parts = [describe(a) for a in args if a is not _NONE]
        return " or ".join(parts) + (" or null" if _NONE in args else "")
    origin = typing.get_origin(hint) or hint
    if hint is bool:
        return "a boolean"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a finite number"
    if hint is str:
        return "a string"
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(hint))
    if origin in (dict, collections.abc.Mapping):
        return "a JSON object"
    if origin in (list, tuple, collections.abc.Sequence):
        items = typing.get_args(hint)
        if origin is tuple and items and items[-1] is not Ellipsis:
            if len(set(items)) == 1:
                return f"a list of {len(items)} {_plural(items[0])}"
            return "a list of " + ", ".join(describe(a) for a in items)
        return f"a list of {_plural(items[0])}" if items else "a list"
    if origin is collections.abc.Callable:
        return "a callable"
    if isinstance(origin, type):
        return f"a {origin.__name__}"
    return str(hint)


def _plural(hint: Any) -> str:
    word = describe(hint)
    for article in ("an ", "a "):
        if word.startswith(article):
            word = word[len(article) :]
            break
    return {
        "finite number": "finite numbers",
        "integer": "integers",
        "string": "strings",
        "boolean": "booleans",
    }.get(word, word)


def matches(value: Any, hint: Any) -> bool:
    """True when ``value`` is a valid value of type ``hint`` (see the module docstring).

    Raises:
        ValueError: an integer beyond int64 where ``int`` is the type (the message has no field
            name; :func:`check_fields` adds it).
    """
    if hint is Any or hint is object:
        return True
    args = _union_args(hint)
    if args is not None:
        return any(matches(value, a) for a in args)
    if hint is _NONE or hint is None:
        return value is None
    origin = typing.get_origin(hint) or hint
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        if not _is_int(value):
            return False
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _TooLarge()
        return True
    if hint is float:
        return (_is_int(value) or isinstance(value, float)) and _finite(value)
    if hint is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(hint))
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, collections.abc.Mapping)
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        items = typing.get_args(hint)
        if origin is tuple and items and items[-1] is not Ellipsis:
            return len(value) == len(items) and all(matches(v, h) for v, h in zip(value, items))
        if not items:
            return True
        if items[0] in (str, bool):  # C-level isinstance per item (configs with 10^6 layer types)
            return all(map(isinstance, value, itertools.repeat(items[0])))
        return all(matches(v, items[0]) for v in value)
    if origin is collections.abc.Callable:
        return callable(value)
    if isinstance(origin, type):
        return isinstance(value, origin)
    return True


class _TooLarge(Exception):
    pass


_HINTS: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """``{field name: resolved annotation}`` of the dataclass ``cls`` (cached per class)."""
    hints = _HINTS.get(cls)
    if hints is None:
        module = sys.modules.get(cls.__module__)
        hints = typing.get_type_hints(cls, globalns=vars(module) if module else None)
        hints = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        _HINTS[cls] = hints
    return hints


def check_fields(
    obj: Any,
    *,
    owner: str | None = None,
    skip: collections.abc.Collection[str] = (),
    message: collections.abc.Callable[[str, Any, str], str] | None = None,
) -> None:
    """Check every field of the dataclass instance ``obj`` against its annotation.

    Args:
        obj: a dataclass instance.
        owner: the name errors give the fields (``owner.field``); default the class name.
        skip: fields not checked here (their class checks them itself).
        message: ``(field, value, why) -> text`` for a class whose errors already have another
            published form (``vision_config.x: why (got value)``); ``why`` is ``"must be
            <description>"`` or ``"too large (beyond int64)"``. Default ``"<owner>.<field>=<value!r>: <why>"``.
    Raises:
        ValueError: ``"<owner>.<field>=<value!r>: must be <description>"`` for the first field
            (in declaration order) whose value does not fit, or ``"...: too large (beyond int64)"``.
    """
    cls = type(obj)
    name = owner or cls.__name__
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        try:
            ok = matches(value, hints[f.name])
            why = None if ok else "must be " + (f.metadata.get("expect") or describe(hints[f.name]))
        except _TooLarge:
            why = "too large (beyond int64)"
        if why is not None:
            raise ValueError(
                message(f.name, value, why) if message else f"{name}.{f.name}={value!r}: {why}"
            ) from None


def replace_fields(
    obj: Any, changes: collections.abc.Mapping[str, Any], *, owner: str | None = None
) -> Any:
    """``dataclasses.replace(obj, **changes)`` that names an unknown field instead of a TypeError.

    Raises:
        ValueError: ``"<owner>: unknown key 'x' (known: a, b, ...)"``, or the new object's own
            validation errors.
    """
    names = {f.name for f in dataclasses.fields(obj) if f.init}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(
            f"{owner or type(obj).__name__}: unknown key {unknown[0]!r} "
            f"(known: {', '.join(sorted(names))})"
        )
    return dataclasses.replace(obj, **changes)


__all__ = ["check_fields", "replace_fields", "describe", "matches", "field_types"]
