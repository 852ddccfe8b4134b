"""Who may send probe frames over tcp: ZMQ CURVE, one ZAP handler, refusals counted.

The receiver's tcp socket is a CURVE server whose key pair, like the one client key it
accepts, is derived from the probe secret (``kvscope_probe.transport``). This module answers
libzmq's ZAP requests (``inproc://zeromq.zap.01`` in the receiver's context) and reads the
socket's handshake events, so that every refused connection attempt is counted by reason:

- ``auth``: CURVE with the right server key but a client key not derived from the secret;
- ``crypto``: a CURVE handshake that does not decrypt (another secret on the other side);
- ``mechanism``: a peer without CURVE (a probe with no secret set; depending on which side
  notices first, such a peer may count as ``protocol`` instead);
- ``protocol``: anything else that fails the handshake (a peer that connects and never
  completes it is dropped after ``HANDSHAKE_MS``).

Bytes that are not ZMTP at all (an HTTP request) are cut off at once, before any
handshake: they deliver nothing, and libzmq reports only a disconnection, not counted.

A refused peer never delivers a frame. Keys and the secret are never logged.
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvscope.throttle import worth_logging
from kvscope_probe.transport import ZAP_DOMAIN, CurveKeys

log = logging.getLogger("kvscope.sidecar")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
REASONS = ("auth", "crypto", "mechanism", "protocol")
HANDSHAKE_MS = 3000
AT_ONCE = 64
"""ZAP requests (or handshake events) answered in one wake-up of the socket thread."""
_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class CurveGate:
    """The CURVE side of one receiver: configures its tcp socket and counts refusals."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        self.keys = keys
        self._client = z85.decode(keys.client_public)
        self.refused: Counter[str] = Counter()
        self.accepted = 0
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.monitor: zmq.Socket[Any] | None = None

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (before it binds) and watch its handshakes."""
        # A peer that connects and never completes the handshake (a port scanner, HTTP)
        # is dropped, and counted, after this long.
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        sock.curve_server = True
        sock.curve_secretkey = self.keys.server_secret
        sock.zap_domain = ZAP_DOMAIN.encode()
        self.monitor = sock.get_monitor_socket(_FAILED)

    def sockets(self) -> list[zmq.Socket[Any]]:
        return [s for s in (self.zap, self.monitor) if s is not None]

    def handle(self, sock: zmq.Socket[Any]) -> None:
        """Answer every ZAP request, or read every handshake event, waiting on ``sock``:
        probes often connect together (engines that start together), and the receiver's
        socket thread rests between wake-ups while frames flow (``TAKE_EVERY_S``), so one
        request a wake-up kept the last of eight probes out ~2 s, past the 1 s a probe
        waits before it drops what it cannot send. At most ``AT_ONCE`` a wake-up, so that
        peers that keep connecting cannot hold the thread from the frames."""
        one = self._zap if sock is self.zap else self._event
        one()
        for _ in range(AT_ONCE - 1):
            if not sock.poll(0, zmq.POLLIN):
                break
            one()

    def _zap(self) -> None:
        req = self.zap.recv_multipart()
        padded = req + [b""] * max(0, 7 - len(req))
        version, request_id, domain, address, _routing_id, mechanism = padded[:6]
        ok = (len(req) >= 7 and mechanism == b"CURVE" and domain == ZAP_DOMAIN.encode()
              and hmac.compare_digest(req[6], self._client))
        if ok:
            self.accepted += 1
        # An "auth" refusal is counted from the handshake event that follows it.
        elif self.refused["auth"] == 0:
            log.warning("refused a probe connection from %s: its key is not the probe "
                        "secret's (counted in kvscope_probe_connections_refused_total)",
                        address.decode(errors="replace")[:64])
        self.zap.send_multipart([version or b"1.0", request_id, b"200" if ok else b"400",
                                 b"OK" if ok else b"not a kvscope probe", b"", b""])

    def _event(self) -> None:
        assert self.monitor is not None
        ev = recv_monitor_message(self.monitor)
        event, value = ev["event"], ev["value"]
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            reason = "auth"
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            reason = "mechanism"
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            reason = "crypto"
        else:
            reason = "protocol"
        self.refused[reason] += 1
        n = self.refused[reason]
        if worth_logging(n):
            log.warning("refused an unauthenticated probe connection (%s, %d so far)%s",
                        reason, n, _HINTS.get(reason, ""))

    def close(self) -> None:
        for s in self.sockets():
            s.close(0)


_HINTS = {
    "mechanism": ": the peer uses no CURVE; set KVSCOPE_PROBE_SECRET where vLLM runs",
    "crypto": ": the peer's KVSCOPE_PROBE_SECRET differs from the sidecar's",
}
