"""Typed message bodies: a dataclass per message type, checked field by field when it is read off the wire.

Each body class declares its wire ``TYPE`` and its fields with their types; ``encode`` turns one into a signed-ready
``Message``, ``decode`` turns a received ``Message`` back into the class its type names, refusing (``ProtocolError``
naming the message type and the field) a body with a missing, unknown or mistyped field. So a field renamed on one
side fails where the message is read, with its name, not as a ``KeyError`` deep in the other side's code. A field may
be one of core's value types (a frozen dataclass: ``LayerCost``), carried as its fields and rebuilt, so the wire does
not repeat the core's types. Documents with a format of their own (a ``Plan``'s dict) are typed as JSON objects here
and parsed by their owners.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, ClassVar, Self, TypeVar, Union, dataclass_transform, get_args, get_origin, get_type_hints

from vpipe_lab.wire.protocol import Message, ProtocolError

B = TypeVar("B", bound="Body")
REGISTRY: dict[str, type[Body]] = {}  # wire type -> its body class (filled by ``register``)
_HINTS: dict[type, dict[str, Any]] = {}


class Body:
    """Base of every message body: a dataclass with a class-level ``TYPE``. Fields whose metadata says
    ``{"wire": False}`` (raw buffers) travel as the message's binary frames, not in its JSON header."""

    TYPE: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if f.metadata.get("wire", True)}

    def to_doc(self) -> dict[str, Any]:
        """The body with its type, as one JSON object (how rank 0 broadcasts commands to the other ranks)."""
        return {"type": self.TYPE, **self.to_dict()}

    def message(self, src: str = "controller") -> Message:
        buffers = [b for f in dataclasses.fields(self) if not f.metadata.get("wire", True)  # type: ignore[arg-type]
                   for b in getattr(self, f.name)]
        return Message(self.TYPE, src, self.to_dict(), buffers)

    @classmethod
    def from_dict(cls, doc: Any, buffers: list[bytes] | None = None) -> Self:
        """Check ``doc`` against this class's fields and build it; ``ProtocolError`` names what is wrong."""
        if not isinstance(doc, dict):
            raise ProtocolError(f"a {cls.TYPE or cls.__name__!r} body must be a JSON object, got {_show(doc)}")
        hints = _hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(doc) - {n for n, f in fields.items() if f.metadata.get("wire", True)})
        if unknown:
            raise ProtocolError(f"a {cls.TYPE or cls.__name__!r} message has unknown field(s) {unknown}: the sender "
                                "speaks another version of the protocol (vpipe_lab versions differ?)")
        values: dict[str, Any] = {}
        for name, f in fields.items():
            if not f.metadata.get("wire", True):
                values[name] = list(buffers or [])
            elif name in doc:
                values[name] = _check(doc[name], hints[name], f"{cls.TYPE or cls.__name__}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"a {cls.TYPE or cls.__name__!r} message lacks its field {name!r}")
        return cls(**values)


@dataclass_transform()
def register(cls: type[B]) -> type[B]:
    """Class decorator: make ``cls`` a dataclass body and the decoder of messages of its ``TYPE``."""
    cls = dataclasses.dataclass(cls)
    if cls.TYPE in REGISTRY:
        raise ValueError(f"two body classes for message type {cls.TYPE!r}: {REGISTRY[cls.TYPE].__name__}, {cls.__name__}")
    REGISTRY[cls.TYPE] = cls
    return cls


def decode(msg: Message) -> Body:
    """The typed body of a received message; ``ProtocolError`` for an unknown type or a malformed body."""
    cls = REGISTRY.get(msg.type)
    if cls is None:
        raise ProtocolError(f"unknown message type {msg.type!r} (known: {', '.join(sorted(REGISTRY))})")
    return cls.from_dict(msg.body, [bytes(b) for b in msg.buffers])


def from_doc(doc: Any) -> Body:
    """A body from ``to_doc``'s form (its ``type`` inside)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("type"), str):
        raise ProtocolError(f"a message document needs a string 'type', got {_show(doc)}")
    rest = {k: v for k, v in doc.items() if k != "type"}
    return decode(Message(doc["type"], body=rest))


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _plain(value: Any) -> Any:
    if isinstance(value, Body):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a core value type (LayerCost, ...)
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` as ``hint`` says (ints are accepted for floats, lists for tuples), else ``ProtocolError``."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        arms = [arm for arm in get_args(hint) if arm is not type(None)]
        if value is not None and len(arms) == 1:  # an optional field that is present: it must be that one type
            return _check(value, arms[0], where)
        for arm in get_args(hint):
            try:
                return _check(value, arm, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"field '{where}' should be {_name(hint)}, got {_show(value)}")
    if hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple) or hint in (list, tuple):
        if isinstance(value, (list, tuple)):
            args = get_args(hint)
            if origin is tuple and args and args[-1] is not Ellipsis:
                if len(args) != len(value):
                    raise ProtocolError(f"field '{where}' should have {len(args)} items, got {len(value)}")
                return tuple(_check(v, a, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
            arg = args[0] if args else Any
            items = [_check(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if origin is tuple else items
    elif origin is dict or hint is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            args = get_args(hint)
            arg = args[1] if args else Any
            return {k: _check(v, arg, f"{where}[{k!r}]") for k, v in value.items()}
    elif isinstance(hint, type) and issubclass(hint, Body):
        return hint.from_dict(value)
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a core value type: its fields, then its checks
        return _value(value, hint, where)
    else:
        raise TypeError(f"the codec cannot check fields of type {hint!r} ({where}): use JSON types or a Body")
    raise ProtocolError(f"field '{where}' should be {_name(hint)}, got {_show(value)}")


def _value(value: Any, hint: type, where: str) -> Any:
    """A core value type (a frozen dataclass such as ``LayerCost``) from its JSON object, field by field; its own
    ``__post_init__`` checks what the types cannot (a ValueError there is the sender's mistake)."""
    if not isinstance(value, dict):
        raise ProtocolError(f"field '{where}' should be a {hint.__name__} object, got {_show(value)}")
    hints = _hints(hint)
    fields = {f.name: f for f in dataclasses.fields(hint)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ProtocolError(f"field '{where}' has unknown key(s) {unknown} for a {hint.__name__}")
    checked = {name: _check(value[name], hints[name], f"{where}.{name}") for name in fields if name in value}
    missing = [n for n, f in fields.items() if n not in value and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ProtocolError(f"field '{where}' lacks {missing} of a {hint.__name__}")
    try:
        return hint(**checked)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"field '{where}' is not a valid {hint.__name__}: {exc}") from None


def _name(hint: Any) -> str:
    return str(hint.__name__) if isinstance(hint, type) and not get_args(hint) else str(hint).replace("typing.", "")
