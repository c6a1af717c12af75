"""ZeroMQ endpoints of the control plane, each owned by one background thread (zmq sockets are not thread-safe).

``Hub`` is the controller side (a ROUTER that workers connect to); ``Link`` is a worker's side (a DEALER). Both hand
messages to their owners through thread-safe queues, sign everything with the session key and drop what does not
verify.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import zmq
from zmq.utils import z85

from vpipe_lab.wire.events import Welcome
from vpipe_lab.wire.protocol import (
    ATTACH,
    DETACH,
    HEARTBEAT,
    MAX_COMMAND,
    MAX_EVENT,
    WELCOME,
    Message,
    ProtocolError,
    RateLimitedLog,
    ReplayGuard,
    Sender,
    decode,
    encode,
)

log = logging.getLogger(__name__)
_rejections = RateLimitedLog(log)


def bounded(sock: zmq.Socket, limit: int, what: str, key: str, server: bool) -> zmq.Socket:  # type: ignore[type-arg]
    """A socket that reads nothing from a peer without the session key, and no frame larger than ``limit`` from one
    with it. ZeroMQ's CURVE handshake comes before any message: the server's key pair is derived from the session
    key and its public half is never sent, so a peer that does not hold the session key cannot complete the
    handshake, and ZeroMQ drops its connection having buffered only the handshake's fixed-size frames (what any
    number of keyless connections can make us hold is bounded by the open-file limit times a few KiB, not by what
    they send). The HMAC signature on every message (``protocol.encode``) still authenticates each one and guards
    against replays; CURVE encrypts the channel too."""
    sock.setsockopt(zmq.MAXMSGSIZE, limit)
    if zmq.has("curve"):
        server_secret = _curve_secret(key, "server")
        if server:
            sock.curve_server = True
            sock.curve_secretkey = server_secret
        else:
            client_secret = _curve_secret(key, "client")
            sock.curve_secretkey = client_secret
            sock.curve_publickey = zmq.curve_public(client_secret)
            sock.curve_serverkey = zmq.curve_public(server_secret)
        log.info("%s: CURVE from the session key; frames over %d bytes are dropped unread", what, limit)
    else:  # a libzmq built without libsodium: the frame bound alone, per connection
        log.warning("%s: this libzmq has no CURVE, so a peer without the key can send up to %d bytes a frame before "
                    "its signature is checked (install pyzmq's own wheel, which has it)", what, limit)
    return sock


def _curve_secret(key: str, role: str) -> bytes:
    """A CURVE secret key (Z85) for ``role`` derived from the session key: only holders of the key can compute it,
    or the server's public key from it."""
    digest = hmac.new(key.encode(), f"vpipe-lab zmq curve {role}".encode(), hashlib.sha256).digest()
    return z85.encode(digest)

_POLL_MS = 20


class Endpoint(Protocol):
    """What a controller talks to its workers through: a ``Hub`` the workers connect to (a launched job) or a
    ``Client`` attached to a job's broker (a torchrun job); the Session needs no more than this."""

    def send(self, to: str, msg: Message) -> None: ...

    def set_handler(self, handler: Callable[[Message], None]) -> None: ...

    def close(self) -> None: ...


class Routes:
    """Where each worker is reached: its name -> the ROUTER's id of the connection its newest *signed* message came
    from. Workers connect without a chosen identity (ZeroMQ gives each connection a random one), so a peer without the
    key can connect under any name it likes and still get no route: a route changes only on a message that carries
    the key's signature and passes the replay guard (a restarted worker's first heartbeat moves its route at once)."""

    def __init__(self) -> None:
        self._ids: dict[str, bytes] = {}

    def learn(self, name: str, connection: bytes) -> None:
        self._ids[name] = bytes(connection)

    def get(self, name: str) -> bytes | None:
        return self._ids.get(name)


class Hub:
    """The controller's endpoint: binds, receives from every worker, sends to a worker by its name."""

    def __init__(self, key: str, host: str = "127.0.0.1", port: int = 0,
                 on_message: Callable[[Message], None] | None = None, session: str | None = None) -> None:
        self.key = key
        self._ctx = zmq.Context.instance()
        self._sock = bounded(self._ctx.socket(zmq.ROUTER), MAX_EVENT, "controller", key, server=True)
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
        self.routes = Routes()  # worker name -> the connection its signed messages came from
        self.rejected = 0
        self._sender, self._guard = Sender(session or ""), ReplayGuard(session)
        self._thread = threading.Thread(target=self._loop, name="vpipe-hub", daemon=True)
        self._thread.start()

    def set_handler(self, handler: Callable[[Message], None]) -> None:
        """Deliver every message to ``handler`` (on the hub's thread) from now on; what arrived before goes first."""
        while not self.inbox.empty():
            handler(self.inbox.get_nowait())
        self._on_message = handler

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
                route = self.routes.get(to)
                if route is None:  # nothing signed has come from it yet: not connected (the monitor reports it)
                    log.debug("cannot send %s to %s: it has not said who it is", msg.type, to)
                    continue
                self._sender.stamp(msg)
                try:
                    self._sock.send_multipart([route, *encode(msg, self.key)], copy=False)
                except zmq.ZMQError as exc:  # the peer is gone (ROUTER_MANDATORY): drop, the monitor reports it
                    log.debug("cannot send %s to %s: %s", msg.type, to, exc)
            if not poller.poll(_POLL_MS):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decode(frames[1:], self.key)
                    self._guard.check(msg)
                except ProtocolError as exc:
                    self.rejected += 1
                    _rejections.warning("rejected a message from connection %s: %s", frames[0].hex(), exc)
                    continue
                peer = msg.src
                self.routes.learn(peer, frames[0])
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


class _Dealer:
    """A DEALER endpoint owned by one thread: an outbox, heartbeats, and signature checks on everything received."""

    def __init__(self, address: str, key: str, name: str, identity: bytes | None, heartbeat_s: float, linger_ms: int,
                 thread_name: str, limit: int = MAX_COMMAND, session: str | None = None) -> None:
        self.key = key
        self.name = name
        self.address = address
        self._ctx = zmq.Context()
        self._sock = bounded(self._ctx.socket(zmq.DEALER), limit, name, key, server=False)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        self._linger = linger_ms
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.connect(address)
        self._outbox: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._heartbeat_s = heartbeat_s
        self._sender, self._guard = Sender(session or ""), ReplayGuard(session)
        self.rejected = 0
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    def _deliver(self, msg: Message) -> None:
        raise NotImplementedError

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
                self._sock.send_multipart(encode(self._sender.stamp(msg), self.key), copy=False)
            if not poller.poll(_POLL_MS):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decode(frames, self.key)
                    self._guard.check(msg)
                except ProtocolError as exc:
                    self.rejected += 1
                    _rejections.warning("%s rejected a message: %s", self.name, exc)
                    continue
                if msg.type == HEARTBEAT:
                    continue
                try:
                    self._deliver(msg)
                except Exception:  # keep serving the other messages
                    log.exception("handling a %r message failed", msg.type)

    def _shut(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(self._linger)
        self._ctx.term()


class Link(_Dealer):
    """A worker's endpoint: connects to the controller, sends events, receives commands, sends heartbeats."""

    def __init__(self, address: str, key: str, name: str, heartbeat_s: float = 1.0, session: str | None = None) -> None:
        self.inbox: queue.Queue[Message] = queue.Queue()
        # no identity of its own choosing: the controller routes by the signed name (``Routes``)
        super().__init__(address, key, name, None, heartbeat_s, 2000, "vpipe-link", session=session)

    def send(self, msg: Message) -> None:
        msg.src = self.name
        self._outbox.put(msg)

    def _deliver(self, msg: Message) -> None:
        self.inbox.put(msg)

    def drain(self, wait: float) -> list[Message]:
        """Every message waiting now; when there is none, wait up to ``wait`` seconds for the first one."""
        found: list[Message] = []
        deadline = time.monotonic() + wait
        while True:
            try:
                found.append(self.inbox.get(timeout=max(0.0, deadline - time.monotonic())))
                deadline = 0.0  # got something: take the rest without waiting
            except queue.Empty:
                return found

    def close(self) -> None:
        self.flush(2.0)
        self._shut()


class Client(_Dealer):
    """An attached client's endpoint (a DEALER on a broker's frontend), with the interface the Session uses of Hub.

    It announces itself, waits for the broker's welcome (the job and its current state) and the recent events the
    broker replays after it, then delivers every event the ranks send; commands go to rank 0 through the broker.
    """

    def __init__(self, address: str, key: str, timeout: float = 30.0) -> None:
        self._early: list[Message] = []
        self._on_message: Callable[[Message], None] | None = None
        self.peers: dict[str, float] = {}
        self.welcome: Welcome | None = None
        self._welcomed = threading.Event()
        self._replayed = threading.Event()
        self._received = 0
        super().__init__(address, key, "client", None, 2.0, 500, "vpipe-client", limit=MAX_EVENT)
        self._outbox.put(Message(ATTACH, "client"))
        if not self._welcomed.wait(timeout):
            self.close()
            raise TimeoutError(f"no answer from {address} within {timeout:.0f} s: is the job running, is this the "
                               "address its rank 0 serves (--control-host/--control-port), and is the key right? "
                               "(a broker drops messages signed with another key)")

    def send(self, to: str, msg: Message) -> None:  # `to` is always rank 0 through the broker
        self._outbox.put(msg)

    def wait_replay(self, timeout: float) -> bool:
        return self._replayed.wait(timeout)

    def set_handler(self, handler: Callable[[Message], None]) -> None:
        """Start delivering events (the ones that came with the welcome first)."""
        self._on_message = handler
        early, self._early = self._early, []
        for msg in early:
            handler(msg)

    def _deliver(self, msg: Message) -> None:
        if msg.type == WELCOME:
            try:
                welcome = Welcome.from_dict(msg.body)
            except ProtocolError as exc:
                log.error("the broker's welcome is malformed (%s): is it another vpipe_lab version?", exc)
                return
            # From now on this client speaks for the job's session and hears only it.
            self._sender.session = self._guard.session = msg.session
            self.welcome = welcome
            self._welcomed.set()
            if not welcome.replay:
                self._replayed.set()
            return
        self._received += 1
        if self.welcome and self._received >= self.welcome.replay:
            self._replayed.set()
        if self._on_message is None:
            self._early.append(msg)
        else:
            self._on_message(msg)

    def close(self) -> None:
        try:
            self._sock.send_multipart(encode(self._sender.stamp(Message(DETACH, "client")), self.key), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._shut()
