"""The control-plane wire format: versioned JSON headers plus raw binary frames, signed with a per-session HMAC key.

A message is one ZeroMQ multipart: ``[signature, header, *buffers]``. The header is UTF-8 JSON
``{"v": 1, "type": ..., "src": ..., "sess": ..., "sid": ..., "seq": ..., "body": {...}}``; buffers carry raw tensor
bytes described in the body. The signature is HMAC-SHA256 over the header and every buffer, as Jupyter's own wire
protocol does, so a process without the session key can neither send commands nor forge events. ``sess`` is the
job's session id (a message captured from another job that used the same key is refused), ``sid`` a random id of the
sending endpoint and ``seq`` counts its messages: a receiver accepts from each (src, sid) only sequence numbers newer
than the last it took (``ReplayGuard``), so a captured message cannot be sent again. Nothing is ever unpickled from a
socket.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

VERSION = 1

# Commands: controller -> rank 0 (which broadcasts them to every rank at an iteration boundary).
RUN, PAUSE, RESUME, STOP, APPLY, PROFILE, STATE, SAVE, PING, MODEL, TELEMETRY, EVAL = (
    "run", "pause", "resume", "stop", "apply", "profile", "state", "save", "ping", "model", "telemetry", "eval")
# Events: workers -> controller.
HELLO, READY, ITERATION, LAYERS, ERROR, ACK, HEARTBEAT, TENSORS, MIGRATED, EVALUATED = (
    "hello", "ready", "iteration", "layers", "error", "ack", "heartbeat", "tensors", "migrated", "evaluated")
UNITS = "units"  # rank 0 started alone (JobSpec.scout): the model's partition units, before the others start


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
    sid: str = ""
    session: str = ""


class Sender:
    """One sending endpoint's identity: its job's session id, a random stream id and its message counter."""

    def __init__(self, session: str = "") -> None:
        self.session = session
        self.sid = secrets.token_hex(8)
        self.seq = 0

    def stamp(self, msg: Message) -> Message:
        self.seq += 1
        msg.seq, msg.sid, msg.session = self.seq, self.sid, self.session
        return msg


class ReplayGuard:
    """Accepts only messages of this job's session (when known; ``exempt`` types excepted: a client's attach, before
    it has learnt the session) and, from each sender stream (src, sid), only sequence numbers newer than the last."""

    def __init__(self, session: str | None = None, exempt: frozenset[str] = frozenset()) -> None:
        self.session = session
        self.exempt = exempt
        self._last: dict[tuple[str, str], int] = {}

    def check(self, msg: Message) -> None:
        if self.session is not None and msg.session != self.session and msg.type not in self.exempt:
            raise ProtocolError(f"a {msg.type!r} message for session {msg.session!r} reached session "
                                f"{self.session!r}: captured from another job that used the same key")
        key = (msg.src, msg.sid)
        last = self._last.get(key, 0)
        if msg.seq <= last:
            raise ProtocolError(f"replayed or reordered message: {msg.type!r} from {msg.src!r} has sequence number "
                                f"{msg.seq}, not newer than {last}")
        self._last[key] = msg.seq


# The largest frame a receiver buffers before it can check a signature (ZeroMQ's limit applies per frame), so what a
# process without the key can make a receiver hold. Commands (to workers, and to a broker from its clients) are small
# JSON: a set_model factory travels as a file path, never on the socket. Events carry, for state_dict and profile
# replies, one stage's tensors, so their receivers (the controller, a broker's rank side, attached clients) allow
# more. Override with VPIPE_LAB_MAX_COMMAND / VPIPE_LAB_MAX_EVENT (bytes).
MAX_COMMAND = int(os.environ.get("VPIPE_LAB_MAX_COMMAND", str(16 << 20)))
MAX_EVENT = int(os.environ.get("VPIPE_LAB_MAX_EVENT", str(4 << 30)))


def _sign(key: bytes, header: bytes, buffers: list[bytes | memoryview]) -> bytes:
    mac = hmac.new(key, header, hashlib.sha256)
    for buf in buffers:
        mac.update(buf)
    return mac.hexdigest().encode()


def encode(msg: Message, key: str) -> list[bytes | memoryview]:
    header = json.dumps(
        {"v": VERSION, "type": msg.type, "src": msg.src, "sess": msg.session, "sid": msg.sid, "seq": msg.seq,
         "body": msg.body},
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
    seq = doc.get("seq", 0)
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise ProtocolError(f"sequence number {seq!r} is not an integer")
    return Message(doc["type"], str(doc.get("src", "?")), body, buffers, seq, str(doc.get("sid", "")),
                   str(doc.get("sess", "")))


class RateLimitedLog:
    """Warnings about rejected messages, at most one per ``period_s`` with a count of those not shown: a flood of junk
    frames must not flood the notebook."""

    def __init__(self, logger: Any, period_s: float = 5.0) -> None:
        self.logger, self.period_s = logger, period_s
        self._next = 0.0
        self._held = 0

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        more = f" ({self._held} more rejected since the last report)" if self._held else ""
        self.logger.warning(fmt + more, *args)
        self._held, self._next = 0, now + self.period_s
