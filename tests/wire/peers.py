"""A raw ZeroMQ peer of the control plane for tests: one that completes the CURVE handshake (it holds the key) and
then sends whatever the test makes it, to reach the signature and replay checks behind the handshake."""

from __future__ import annotations

import zmq

from vpipe_lab.wire.channel import bounded
from vpipe_lab.wire.protocol import MAX_COMMAND


def transport_peer(ctx: zmq.Context, address: str, key: str, identity: bytes | None = None) -> zmq.Socket:  # type: ignore[type-arg]
    """A DEALER connected to ``address`` past the handshake ``key`` allows."""
    sock = bounded(ctx.socket(zmq.DEALER), MAX_COMMAND, "test peer", key, server=False)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock
