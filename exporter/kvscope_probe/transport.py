"""How the probe and the middleware reach the sidecar: one ZMQ PUSH setup, one send.

Both senders (``sender.Sender``, the probe's, and ``emitter.Emitter``, the middleware's)
open their socket with ``push_socket`` and send with ``send``, so they agree on the rules:
never block the caller's thread for longer than it asks, queue only to a connected peer,
and authenticate on tcp.

Authentication. A ``tcp://`` endpoint uses ZMQ CURVE (encrypted, and each connection's
handshake proves the client holds the key; frames cannot be replayed into another
connection). Both ends derive their CURVE key pairs from one shared secret, so a deployment
sets one value: ``KVSCOPE_PROBE_SECRET`` or a file named by ``KVSCOPE_PROBE_SECRET_FILE``
(at least 24 characters; ``openssl rand -hex 32`` makes one). The sidecar accepts only the
client key derived from its secret. ``ipc://`` endpoints carry no CURVE: the socket file's
permissions decide who may connect (the sidecar makes it 0600 in a 0700 directory, and
refuses a directory another user could replace it in). The
secret and the keys are never logged.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvscope_probe import iothreads

ENV_SECRET = "KVSCOPE_PROBE_SECRET"
ENV_SECRET_FILE = "KVSCOPE_PROBE_SECRET_FILE"
MIN_SECRET_CHARS = 24
ZAP_DOMAIN = "kvscope"


class TransportError(ValueError):
    """A transport setting that cannot work (no secret for tcp, an unreadable file)."""


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE keys of both ends, derived from the shared secret."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)


def read_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret from the environment or its file; None when neither is set."""
    env = os.environ if env is None else env
    value = env.get(ENV_SECRET, "")
    path = env.get(ENV_SECRET_FILE, "")
    if not value and path:
        try:
            with open(path, "rb") as f:
                value = f.read().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise TransportError(f"cannot read {ENV_SECRET_FILE} ({type(exc).__name__})") from None
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise TransportError(f"the probe secret must have at least {MIN_SECRET_CHARS} "
                             "characters (openssl rand -hex 32 makes one)")
    return value.encode("utf-8")


def curve_keys(secret: bytes) -> CurveKeys:
    """Both key pairs, derived one-way from the secret (domain-separated SHA-256)."""
    import zmq
    from zmq.utils import z85

    def pair(role: bytes) -> tuple[bytes, bytes]:
        sk = z85.encode(hashlib.sha256(b"kvscope-curve/" + role + b"\0" + secret).digest())
        return zmq.curve_public(sk), sk

    spub, ssec = pair(b"server")
    cpub, csec = pair(b"client")
    return CurveKeys(spub, ssec, cpub, csec)


def requires_auth(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


RECONNECT_IVL_MAX_MS = 1000
"""While no sidecar listens, libzmq's I/O thread retries the connection every 100 ms (its
``ZMQ_RECONNECT_IVL``) for as long as that lasts: 0.83-0.85 ms of CPU a second in the engine
process on an ipc endpoint, 1.28-1.33 on tcp. Each failed try doubles the wait up to this:
0.12-0.13 and 0.20-0.21 ms a second (``benchmarks/probe_reconnect.py``). A sidecar that
comes back is reached within about a second, and a connection that drops starts again from
100 ms (tests/unit/test_transport_reconnect.py)."""


def push_socket(endpoint: str, *, hwm: int, secret: bytes | None = None,
                env: Mapping[str, str] | None = None) -> Any:
    """A connected PUSH socket; CURVE on tcp (the secret from ``env`` unless given)."""
    import zmq

    if requires_auth(endpoint) and secret is None:
        secret = read_secret(env)
        if secret is None:
            raise TransportError(f"{endpoint} is tcp: set {ENV_SECRET} or {ENV_SECRET_FILE} "
                                 "to the sidecar's probe secret")
    sock = iothreads.context().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected (authenticated) sidecar
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    if requires_auth(endpoint):
        assert secret is not None
        keys = curve_keys(secret)
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    sock.connect(endpoint)
    return sock


CONNECT_GRACE_MS = 1000
"""How long a sender waits, once, for its first connection before it starts sending."""


def await_connection(sock: Any) -> bool:
    """Wait once for ``connect()`` to complete: it happens in the background and IMMEDIATE
    makes a send fail until it has, so the first frames were dropped without this. A
    sidecar that is not there costs one wait on the sending thread, never the caller's."""
    import zmq

    return bool(sock.poll(CONNECT_GRACE_MS, zmq.POLLOUT))


def send(sock: Any, parts: list[Any], wait_ms: int) -> bool:
    """Send one multipart message, waiting at most ``wait_ms`` for room; False when it
    could not go (no connected sidecar, or a full pipe): the caller drops and counts it."""
    import zmq

    if not sock.poll(wait_ms, zmq.POLLOUT):
        return False
    try:
        # Copied, not zero-copy: pyzmq releases a zero-copy message of 64 KiB or more
        # through a Python garbage-collector thread it starts on the first one, which
        # then wakes for every frame and takes the GIL from the engine thread. A copy of
        # a frame (0.1-0.5 MiB at 0.1 s of records) is 10-40 us once per wakeup.
        sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=True)
    except zmq.Again:
        return False
    return True
