"""The router's door on TCP: admits the cluster's members, refuses everyone else, and says so.

CURVE alone only proves that a peer knows the router's *public* key. The guard is ZeroMQ's authentication
handler (ZAP, RFC 27) for the router's context: a peer gets in only if its key is the cluster's member key
(pdlab.serve.curve). It also watches the router socket's handshake failures, so a peer that does not even
speak CURVE with the cluster's keys (plain TCP, another cluster's keys) is counted too. Each kind of refusal
is logged once, as it first happens (logger `pdlab.control`, on stderr), and counted; `summary()` is the
sentence a run prints when a node it waits for never got in.

One thread, started before the router binds and stopped before its context ends: ZAP requests must be
answered while handshakes happen, whatever the router's main loop is doing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

log = logging.getLogger("pdlab.control")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27
_NOT_MEMBER = "its key is not this cluster's member key"


def _protocol_reason(value: int) -> str:
    # deferred: zmq
    import zmq

    if value == getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", -1):
        return "it speaks plain TCP (no keys) to a control plane that requires the cluster's keys"
    if value == getattr(zmq, "PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC", -1):
        return "its keys are not this cluster's (the handshake did not decrypt)"
    return f"its handshake failed (ZMTP protocol error {value:#x})"


class Guard:
    def __init__(self, ctx: Any, sock: Any, members: set[bytes], address: str):
        """`members`: Z85 public keys admitted; `sock`: the router socket, not yet bound."""
        # deferred: zmq
        import zmq

        self.address, self.members = address, {m.strip() for m in members}
        self._lock = threading.Lock()
        self.refused: dict[str, int] = {}  # reason -> connection attempts refused
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        failures = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        self._monitor = sock.get_monitor_socket(failures)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdlab-control-guard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # deferred: zmq
        import zmq

        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._zap in ready:
                    self._answer(self._zap.recv_multipart())
                if self._monitor in ready:
                    self._watch()
        finally:
            self._zap.close(0)
            self._monitor.close(0)

    def _answer(self, frames: list[bytes]) -> None:
        """One ZAP request: [version, id, domain, address, identity, mechanism, credentials...]."""
        # deferred: zmq
        import zmq.utils.z85

        version, rid, _domain, address, _identity, mechanism = frames[:6]
        ok = False
        if mechanism == b"CURVE" and len(frames) > 6 and len(frames[6]) == 32:
            ok = zmq.utils.z85.encode(frames[6]) in self.members
        if not ok:
            self._refuse(_NOT_MEMBER if mechanism == b"CURVE" else f"mechanism {mechanism.decode(errors='replace')}",
                         address.decode(errors="replace"))
        self._zap.send_multipart([version, rid, b"200" if ok else b"400", b"OK" if ok else b"not a cluster member",
                                  b"member" if ok else b"", b""])

    def _watch(self) -> None:
        # deferred: zmq
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        ev = parse_monitor_message(self._monitor.recv_multipart())
        if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._refuse(_protocol_reason(int(ev["value"])))
        elif ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._refuse("its handshake failed")

    def _refuse(self, reason: str, peer: Optional[str] = None) -> None:
        with self._lock:
            first = reason not in self.refused
            self.refused[reason] = self.refused.get(reason, 0) + 1
        if first:  # a refused peer retries every few hundred ms: the first of each kind is the news
            log.warning("pdlab: control plane %s refused a peer%s: %s", self.address,
                        f" from {peer}" if peer else "", reason)

    def summary(self) -> str:
        """'refused 12 connection attempts (its keys are not this cluster's ...)', or '' when nobody was."""
        with self._lock:
            items = dict(self.refused)
        if not items:
            return ""
        n = sum(items.values())
        return f"refused {n} connection attempt{'s' if n != 1 else ''} ({'; '.join(items)})"

    def close(self) -> None:
        """Stop the router socket's monitor, then the thread (it closes its own sockets); before the context ends.

        In that order: stopping a monitor sends a last event to its PAIR socket, and a PAIR send with no peer
        blocks. With the thread's end of the pair closed first, `pdlab run` hung at exit now and then."""
        try:
            self._sock.disable_monitor()
        except Exception:  # noqa: BLE001 - the router socket may already be closed
            pass
        self._stop.set()
        self._thread.join()
