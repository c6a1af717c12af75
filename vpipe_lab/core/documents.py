"""The lab's one serialiser: a dataclass to its JSON document and back, every field checked against its type hint.

Every value type that is written to a file or sent on the wire (a ``Plan``, a ``LayerCost``, a bundle's stages, a
message body) is a dataclass; its document is its fields by name, nested dataclasses as objects, tuples as lists and
enums as their values. ``dump`` writes one; ``load`` reads one back as the hints say, refusing a missing, unknown
or mistyped field with the path to it (``layers[2].forward_s must be a number, got 'fast'``) in the caller's error
class, after which the type's own ``__post_init__`` checks what types cannot say. So adding a field to a type is
one edit: its line in the class. A field marked ``sparse`` is left out while it holds its default (documents stay
as short as they were); one whose metadata says ``{"document": False}`` is not part of the document at all.
"""

from __future__ import annotations

import dataclasses
import enum
import reprlib
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = ["dump", "load", "load_fields", "short", "sparse"]

T = TypeVar("T")
Extra = Literal["refuse", "ignore"]
_HINTS: dict[type, dict[str, Any]] = {}
_SHORT = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 3, 60, 60, 6, 6


def sparse(default: Any) -> Any:
    """A dataclass field with ``default`` that its document leaves out while it holds that default."""
    return dataclasses.field(default=default, metadata={"sparse": True})


def short(value: Any) -> str:
    """A value for an error line: what a crafted document holds is cut short (depth and length), never printed whole."""
    return _SHORT.repr(value)


def documented(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``cls`` its document holds: those its constructor takes, less any marked ``document: False``."""
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("document", True)]


def dump(value: Any) -> Any:
    """``value`` as JSON types: a dataclass as an object of its documented fields, tuples as lists, enums as values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in documented(type(value)):
            item = getattr(value, f.name)
            if f.metadata.get("sparse") and item == f.default:
                continue
            out[f.name] = dump(item)
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [dump(v) for v in value]
    if isinstance(value, dict):
        return {k: dump(v) for k, v in value.items()}
    return value


def load_fields(cls: type[T], doc: Any, where: str, error: type[Exception], *, extra: Extra = "refuse") -> T:
    """A ``cls`` built from ``doc``'s fields, each checked (``load``); ``extra="ignore"`` passes over keys the class
    does not have (a file written by a newer version, or a header such as ``kind``). What the class's own checks
    raise (``error``, ValueError, TypeError) becomes ``error`` with ``where`` before its message."""
    if not isinstance(doc, Mapping):
        raise error(f"{where} must be an object with {', '.join(f.name for f in documented(cls)[:4])}, ... fields, "
                    f"got {short(doc)}")
    hints = _hints(cls)
    fields = {f.name: f for f in documented(cls)}
    unknown = sorted(str(k) for k in doc if k not in fields)
    if unknown and extra == "refuse":
        raise error(f"{where} has unknown field(s) {unknown} for a {cls.__name__}: it was written by another version "
                    "of vpipe_lab, or by hand")
    values = {}
    for name, f in fields.items():
        if name in doc:
            values[name] = load(hints[name], doc[name], f"{where}.{name}", error)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise error(f"{where}.{name} is missing ({_name(hints[name])})")
    try:
        return cls(**values)
    except (error, ValueError, TypeError) as exc:  # the type's own rules, said where the document broke them
        raise error(f"{where}: {exc}") from None


def load(hint: Any, value: Any, where: str, error: type[Exception]) -> Any:
    """``value`` as ``hint`` says (ints are taken for floats and whole floats for ints, lists for tuples, values for
    enums), else ``error`` naming ``where``, what it should be and what it is."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        arms = [arm for arm in get_args(hint) if arm is not type(None)]
        if value is not None and len(arms) == 1:  # an optional field that is present: it must be that one type
            return load(arms[0], value, where, error)
        for arm in get_args(hint):
            try:
                return load(arm, value, where, error)
            except error:
                continue
    elif hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 1e9 bytes, as another tool writes it
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple) or hint in (list, tuple):
        if isinstance(value, (list, tuple)):
            return _sequence(hint, value, where, error)
    elif origin is dict or hint is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            args = get_args(hint)
            return {k: load(args[1] if args else Any, v, f"{where}[{k!r}]", error) for k, v in value.items()}
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return getattr(hint, "parse", hint)(value)
        except (ValueError, TypeError):
            pass
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return load_fields(hint, value, where, error)
    else:
        raise TypeError(f"documents cannot check fields of type {hint!r} ({where}): use JSON types, enums or dataclasses")
    raise error(f"{where} must be {_name(hint)}, got {short(value)}")


def _sequence(hint: Any, value: list[Any] | tuple[Any, ...], where: str, error: type[Exception]) -> Any:
    args = get_args(hint)
    if get_origin(hint) is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise error(f"{where} must have {len(args)} items ({_name(hint)}), got {len(value)}")
        return tuple(load(a, v, f"{where}[{i}]", error) for i, (a, v) in enumerate(zip(args, value)))
    arg = args[0] if args else Any
    items = [load(arg, v, f"{where}[{i}]", error) for i, v in enumerate(value)]
    return tuple(items) if get_origin(hint) is tuple or hint is tuple else items


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", type(None): "null",
          list: "a list", tuple: "a list", dict: "an object"}


def _name(hint: Any) -> str:
    """What ``hint`` asks for, in words: ``a list of whole numbers``, ``a LayerCost object or null``."""
    if hint in _WORDS:
        return _WORDS[hint]
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_name(a) for a in args)
    if origin in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} ({', '.join(_name(a) for a in args)})"
        return "a list of " + (_plural(_name(args[0])) if args else "values")
    if origin is dict:
        return f"an object of {_plural(_name(args[1]))}" if args and args[1] is not Any else "an object"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    if isinstance(hint, type):
        return f"a {hint.__name__} object"
    return str(hint).replace("typing.", "")


def _plural(words: str) -> str:
    """``a whole number`` -> ``whole numbers``, ``a list of strings`` -> ``lists of strings``."""
    for article in ("a ", "an "):
        if words.startswith(article):
            head, sep, rest = words[len(article):].partition(" of ")
            return f"{head}s{sep}{rest}"
    return f"values, each {words}"
