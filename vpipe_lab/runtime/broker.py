"""The control endpoint of a job started by torchrun, served by rank 0: ranks on one side, attached clients on the
other.

Ranks connect to the backend (reachable from every node); notebooks and scripts attach to the frontend (loopback
unless told otherwise). Every message must carry the session key's signature on both sides; the broker checks it and
forwards the frames unchanged: client commands to rank 0, rank events to every attached client. It remembers the
job's description, the plan in force and the latest events, so a client that attaches (or re-attaches) mid-run
starts with the current state and recent history. Training never waits for a client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import zmq

from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.channel import Routes, bounded
from vpipe_lab.wire.codec import decode
from vpipe_lab.wire.events import Current, IterationReport, JobInfo, Ready, Welcome

log = logging.getLogger(__name__)
_rejections = P.RateLimitedLog(log)
REPLAY = 200  # recent events kept for clients that attach later
CLIENT_TIMEOUT_S = 15.0


class Broker:
    def __init__(self, key: str, backend: str, frontend: str, job: JobInfo) -> None:
        self.key = key
        self.job = job  # what a client needs to build its Session: stages, schedule, budgets, ...
        self._ctx = zmq.Context()
        self._back = bounded(self._ctx.socket(zmq.ROUTER), P.MAX_EVENT, "broker (ranks)", key, server=True)
        self._front = bounded(self._ctx.socket(zmq.ROUTER), P.MAX_COMMAND, "broker (clients)", key, server=True)
        for sock in (self._back, self._front):
            sock.setsockopt(zmq.LINGER, 0)
        # The clients' port is the one a user chose: bind it before the ranks' port, which may be any free one and
        # could otherwise be handed exactly that port.
        self._front.bind(frontend)
        self._back.bind(backend)
        self.backend = self._back.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frontend = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("broker: ranks on %s, clients on %s; every message must carry the key's signature; frames over "
                 "%d bytes from clients are dropped unread", self.backend, self.frontend, P.MAX_COMMAND)
        self.ready: dict[int, Ready] = {}
        self.current: Current | None = None
        self.clients: dict[bytes, float] = {}
        self.routes = Routes()  # rank name -> its connection, learnt only from signed messages (wire/channel.py)
        self.rejected = 0
        # Frames are forwarded unchanged, so one guard serves both sides; a client's attach comes before it knows the
        # session, and is harmless (it only asks for a welcome).
        session = job.session_id
        self._sender = P.Sender(session)
        self._guard = P.ReplayGuard(session, exempt=frozenset({P.ATTACH, P.DETACH, P.HEARTBEAT}))
        self._replay: deque[list[bytes]] = deque(maxlen=REPLAY)
        self._busy = time.monotonic()  # when the loop last had something to read
        self.observer: Callable[[P.Message], None] | None = None  # an unattended job's run log (telemetry/runlog.py)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vpipe-broker", daemon=True)
        self._thread.start()

    def _verify(self, frames: list[bytes], side: str) -> P.Message | None:
        try:
            msg = P.decode(frames, self.key)
            self._guard.check(msg)
            return msg
        except P.ProtocolError as exc:
            self.rejected += 1
            _rejections.warning("broker: rejected a message on the %s: %s", side, exc)
            return None

    def _to_clients(self, frames: list[bytes]) -> None:
        for client in list(self.clients):
            try:
                self._front.send_multipart([client, *frames], zmq.NOBLOCK)
            except zmq.ZMQError:  # a client gone or too slow: it re-attaches and gets the replay
                self.clients.pop(client, None)

    def _welcome(self, client: bytes) -> None:
        welcome = Welcome(self.job, [self.ready[r] for r in sorted(self.ready)], self.current, len(self._replay))
        self._front.send_multipart([client, *[bytes(f) for f in P.encode(
            self._sender.stamp(welcome.message("broker")), self.key)]])
        for frames in list(self._replay):
            self._front.send_multipart([client, *frames])

    def _follow(self, msg: P.Message) -> None:
        """Keep what an attaching client is welcomed with: every rank's READY and the job's current view."""
        try:
            body = decode(msg)
        except P.ProtocolError as exc:  # forwarded all the same: the clients refuse it with the same reason
            _rejections.warning("broker: a malformed %s message from the ranks: %s", msg.type, exc)
            return
        if isinstance(body, Ready):
            self.ready[body.rank] = body
            if self.current is None:
                self.current = Current(body.plan, 0, body.names, body.iteration, False, body.iteration, body.units)
        elif isinstance(body, Current):
            self.current = body
        elif isinstance(body, IterationReport) and body.stage == 0 and body.replica == 0 and self.current:
            self.current = replace(self.current, iteration=body.iteration + 1)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._back, zmq.POLLIN)
        poller.register(self._front, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            if events:
                self._busy = time.monotonic()
            if self._back in events:
                while True:
                    try:
                        frames = self._back.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = self._verify(frames[1:], "backend")
                    if msg is None:
                        continue
                    self.routes.learn(msg.src, frames[0])
                    if msg.type == P.HEARTBEAT:
                        continue
                    if self.observer is not None:
                        try:
                            self.observer(msg)
                        except Exception:  # the run log must never stop the job's control traffic
                            log.exception("broker: the run log failed on a %s message", msg.type)
                    self._follow(msg)
                    if msg.type in (P.ITERATION, P.MIGRATED):
                        self._replay.append(frames[1:])
                    self._to_clients(frames[1:])
            if self._front in events:
                while True:
                    try:
                        frames = self._front.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    client, rest = frames[0], frames[1:]
                    msg = self._verify(rest, "frontend")
                    if msg is None:
                        continue
                    self.clients[client] = time.monotonic()
                    if msg.type == P.ATTACH:
                        self._welcome(client)
                    elif msg.type == P.DETACH:
                        self.clients.pop(client, None)
                    elif msg.type != P.HEARTBEAT:
                        route = self.routes.get("rank0")
                        try:
                            if route is None:
                                raise zmq.ZMQError(msg="rank 0 has not connected yet")
                            self._back.send_multipart([route, *rest], zmq.NOBLOCK)
                        except zmq.ZMQError as exc:
                            log.warning("broker: rank 0 cannot take a %s command now: %s", msg.type, exc)
            now = time.monotonic()
            for client, seen in list(self.clients.items()):
                if now - seen > CLIENT_TIMEOUT_S:
                    self.clients.pop(client, None)

    def close(self, drain_s: float = 2.0) -> None:
        """Stop, after the ranks' last messages (an unattended job's final iteration reports) have been read."""
        deadline = time.monotonic() + drain_s
        while time.monotonic() - self._busy < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=2)
        self._back.close(0)
        self._front.close(0)
        self._ctx.term()
