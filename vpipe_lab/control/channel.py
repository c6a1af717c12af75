"""ZeroMQ endpoints of the control plane, each owned by one background thread (zmq sockets are not thread-safe).

``Hub`` is the controller side (a ROUTER that workers connect to); ``Link`` is a worker's side (a DEALER). Both hand
messages to their owners through thread-safe queues, sign everything with the session key and drop what does not
verify.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from vpipe_lab.control.protocol import HEARTBEAT, Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)

_POLL_MS = 20


class Hub:
    """The controller's endpoint: binds, receives from every worker, sends to a worker by its name."""

    def __init__(self, key: str, host: str = "127.0.0.1", port: int = 0,
                 on_message: Callable[[Message], None] | None = None) -> None:
        self.key = key
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.inbox: queue.Queue[Message] = queue.Queue()
        self._outbox: queue.Queue[tuple[str, Message]] = queue.Queue()
        self._on_message = on_message
        self._stop = threading.Event()
        self.peers: dict[str, float] = {}  # worker name -> time of its last message
        self.rejected = 0
        self._seq = 0
        self._thread = threading.Thread(target=self._loop, name="vpipe-hub", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def send(self, to: str, msg: Message) -> None:
        self._outbox.put((to, msg))

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:  # workers exit when the controller falls silent, so keep talking
                for peer in list(self.peers):
                    self._outbox.put((peer, Message(HEARTBEAT)))
                next_beat = now + 1.0
            while True:
                try:
                    to, msg = self._outbox.get_nowait()
                except queue.Empty:
                    break
                self._seq += 1
                msg.seq = self._seq
                try:
                    self._sock.send_multipart([to.encode(), *encode(msg, self.key)], copy=False)
                except zmq.ZMQError as exc:  # the peer is gone (ROUTER_MANDATORY): drop, the monitor reports it
                    log.debug("cannot send %s to %s: %s", msg.type, to, exc)
            if not poller.poll(_POLL_MS):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                peer = frames[0].decode(errors="replace")
                try:
                    msg = decode(frames[1:], self.key)
                except ProtocolError as exc:
                    self.rejected += 1
                    log.warning("rejected a message from %r: %s", peer, exc)
                    continue
                self.peers[peer] = time.monotonic()
                if msg.type == HEARTBEAT:
                    continue
                if self._on_message is None:
                    self.inbox.put(msg)
                    continue
                try:
                    self._on_message(msg)
                except Exception:  # a bad message must not kill the thread that every other message needs
                    log.exception("handling a %r message from %s failed", msg.type, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)


class Link:
    """A worker's endpoint: connects to the controller, sends events, receives commands, sends heartbeats."""

    def __init__(self, address: str, key: str, name: str, heartbeat_s: float = 1.0) -> None:
        self.key = key
        self.name = name
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, name.encode())
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.connect(address)
        self.inbox: queue.Queue[Message] = queue.Queue()
        self._outbox: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._heartbeat_s = heartbeat_s
        self.last_heard = time.monotonic()
        self._seq = 0
        self._thread = threading.Thread(target=self._loop, name="vpipe-link", daemon=True)
        self._thread.start()

    def send(self, msg: Message) -> None:
        msg.src = self.name
        self._outbox.put(msg)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued has been handed to the socket."""
        deadline = time.monotonic() + timeout
        while not self._outbox.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        return self._outbox.empty()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._outbox.put(Message(HEARTBEAT, self.name))
                next_beat = now + self._heartbeat_s
            while True:
                try:
                    msg = self._outbox.get_nowait()
                except queue.Empty:
                    break
                self._seq += 1
                msg.seq = self._seq
                self._sock.send_multipart(encode(msg, self.key), copy=False)
            if not poller.poll(_POLL_MS):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decode(frames, self.key)
                except ProtocolError as exc:
                    log.warning("rejected a message: %s", exc)
                    continue
                self.last_heard = time.monotonic()
                if msg.type != HEARTBEAT:
                    self.inbox.put(msg)

    def close(self) -> None:
        self.flush(2.0)
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(2000)
        self._ctx.term()
