"""Typed message bodies: a dataclass per message type, checked field by field when it is read off the wire.

Each body class declares its wire ``TYPE`` and its fields with their types; ``encode`` turns one into a signed-ready
``Message``, ``decode`` turns a received ``Message`` back into the class its type names, refusing (``ProtocolError``
naming the message type and the field) a body with a missing, unknown or mistyped field. So a field renamed on one
side fails where the message is read, with its name, not as a ``KeyError`` deep in the other side's code. The
checking is core's one serialiser (``core/documents.py``), so a field may be one of core's value types (a frozen
dataclass: ``LayerCost``), carried as the same document its files hold and rebuilt, and the wire does not repeat the
core's types. Documents with a header of their own (a ``Plan``'s dict) are typed as JSON objects here and parsed by
their owners.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self, TypeVar, dataclass_transform

from vpipe_lab.core import documents
from vpipe_lab.wire.protocol import Message, ProtocolError

B = TypeVar("B", bound="Body")
REGISTRY: dict[str, type[Body]] = {}  # wire type -> its body class (filled by ``register``)
RAW = {"document": False}  # a field that travels as the message's binary frames, not in its JSON header


class Body:
    """Base of every message body: a dataclass with a class-level ``TYPE``. Fields whose metadata is ``RAW`` (raw
    buffers) travel as the message's binary frames, not in its JSON header."""

    TYPE: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return documents.dump(self)  # type: ignore[no-any-return]

    def to_doc(self) -> dict[str, Any]:
        """The body with its type, as one JSON object (how rank 0 broadcasts commands to the other ranks)."""
        return {"type": self.TYPE, **self.to_dict()}

    def message(self, src: str = "controller") -> Message:
        buffers = [b for f in dataclasses.fields(self) if not f.metadata.get("document", True)  # type: ignore[arg-type]
                   for b in getattr(self, f.name)]
        return Message(self.TYPE, src, self.to_dict(), buffers)

    @classmethod
    def from_dict(cls, doc: Any, buffers: list[bytes] | None = None) -> Self:
        """Check ``doc`` against this class's fields and build it; ``ProtocolError`` names what is wrong."""
        body = documents.load_fields(cls, doc, cls.TYPE or cls.__name__, ProtocolError)
        raw = {f.name: list(buffers or []) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
               if not f.metadata.get("document", True)}
        return dataclasses.replace(body, **raw) if raw else body  # type: ignore[type-var]


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
        raise ProtocolError(f"a message document needs a string 'type', got {documents.short(doc)}")
    rest = {k: v for k, v in doc.items() if k != "type"}
    return decode(Message(doc["type"], body=rest))
