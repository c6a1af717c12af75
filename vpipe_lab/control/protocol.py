"""The control-plane wire format: versioned JSON headers plus raw binary frames, signed with a per-session HMAC key.

A message is one ZeroMQ multipart: ``[signature, header, *buffers]``. The header is UTF-8 JSON
``{"v": 1, "type": ..., "src": ..., "seq": ..., "body": {...}}``; buffers carry raw tensor bytes described in the
body. The signature is HMAC-SHA256 over the header and every buffer, as Jupyter's own wire protocol does, so a
process without the session key can neither send commands nor forge events. Nothing is ever unpickled from a socket.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

VERSION = 1

# Commands: controller -> rank 0 (which broadcasts them to every rank at an iteration boundary).
RUN, PAUSE, RESUME, STOP, APPLY, PROFILE, STATE, SAVE, PING, MODEL, TELEMETRY = (
    "run", "pause", "resume", "stop", "apply", "profile", "state", "save", "ping", "model", "telemetry")
# Events: workers -> controller.
HELLO, READY, ITERATION, LAYERS, ERROR, ACK, HEARTBEAT, TENSORS, MIGRATED = (
    "hello", "ready", "iteration", "layers", "error", "ack", "heartbeat", "tensors", "migrated")


# Attaching to a job served by a broker (torchrun): client <-> broker, and rank 0's "plan in force" updates.
ATTACH, DETACH, WELCOME, CURRENT = "attach", "detach", "welcome", "current"


class ProtocolError(Exception):
    """A message that is malformed, from another protocol version, or not signed with the session key."""


def new_key() -> str:
    """A fresh session key (hex), as strong as Jupyter's connection-file keys."""
    return secrets.token_hex(32)


@dataclass
class Message:
    type: str
    src: str = "controller"
    body: dict[str, Any] = field(default_factory=dict)
    buffers: list[bytes | memoryview] = field(default_factory=list)
    seq: int = 0


def _sign(key: bytes, header: bytes, buffers: list[bytes | memoryview]) -> bytes:
    mac = hmac.new(key, header, hashlib.sha256)
    for buf in buffers:
        mac.update(buf)
    return mac.hexdigest().encode()


def encode(msg: Message, key: str) -> list[bytes | memoryview]:
    header = json.dumps(
        {"v": VERSION, "type": msg.type, "src": msg.src, "seq": msg.seq, "body": msg.body},
        separators=(",", ":"), allow_nan=True,
    ).encode()
    return [_sign(key.encode(), header, msg.buffers), header, *msg.buffers]


def decode(frames: list[bytes], key: str) -> Message:
    if len(frames) < 2:
        raise ProtocolError(f"a message needs a signature and a header, got {len(frames)} frame(s)")
    signature, header, buffers = frames[0], frames[1], list(frames[2:])
    expected = _sign(key.encode(), header, buffers)
    if not hmac.compare_digest(signature, expected):
        raise ProtocolError("bad signature: the sender does not hold this session's key")
    try:
        doc = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise ProtocolError(f"protocol version {doc.get('v') if isinstance(doc, dict) else doc!r} is not {VERSION}: "
                            "the worker and the controller come from different vpipe_lab versions")
    body = doc.get("body")
    if not isinstance(body, dict) or not isinstance(doc.get("type"), str):
        raise ProtocolError("header lacks a type or a body object")
    return Message(doc["type"], str(doc.get("src", "?")), body, buffers, int(doc.get("seq", 0)))
