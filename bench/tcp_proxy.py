"""A TCP proxy for partition tests and benchmarks, run in the caller's own process: put it
between a client and a server (an etcd member, a broker, a controller) and cut, black-hole
and heal the path between them.  Its home is ``bench/`` because the benchmarks may not
import from ``tests/`` (``bench/failover_bench.py`` partitions with it); the tests import it
from here too (``tests/tcp_proxy.py`` re-exports it).  Standard library only.

    proxy = TcpProxy("127.0.0.1:2379").start()   # listens on proxy.address
    proxy.blackhole()   # a partition: nothing arrives either way, nothing is closed
    proxy.heal()        # the partition heals
    proxy.cut()         # open connections closed, new ones reset at once (until heal)
    proxy.stop()        # everything closed, the port freed, the threads joined

Threads: one accepting, two per connection (one per direction).  The states:

- ``forward`` (at start and after :meth:`heal`): bytes flow both ways.
- ``blackhole``: every byte either way is held back, none delivered, no connection closed
  (new ones are accepted, and connected upstream, but carry nothing either).  Bytes are
  *held*, not thrown away: each direction stops after reading what was in flight, the rest
  waits in the kernel's buffers and, when those are full, the sender's writes block — as
  over a partitioned network, where TCP keeps what is unacknowledged and retransmits it.
  So the peers see exactly what a partition shows them: silence, requests that time out.
- ``cut``: open connections are closed (both sides see the stream end), and a new
  connection is accepted and reset at once (the client's connect or first read fails fast).

:meth:`heal` returns to ``forward``.  A connection black-holed and still open *resumes*:
the bytes held during the black hole are delivered, in order, none lost or repeated — a
partition that heals before either side gave up.  (A peer that did give up meanwhile —
a timed-out gRPC call — simply gets a late answer it ignores; one that wants a fresh
connection makes one.)  Connections closed by :meth:`cut` stay closed."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

__all__ = ["TcpProxy"]

FORWARD, BLACKHOLE, CUT, STOPPED = "forward", "blackhole", "cut", "stopped"


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset rather than an orderly end (SO_LINGER 0)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class _Link:
    """One proxied connection: the client's socket, the upstream one, a pump each way."""

    def __init__(self, proxy: TcpProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self._lock = threading.Lock()
        self._pumps_left = 2
        self._closed = False
        self.threads = [
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True),
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def shut(self) -> None:
        """End both directions now (their pumps then close the sockets)."""
        with self._lock:  # never on a closed socket's number, which may be reused
            if self._closed:
                return
            for s in (self.client, self.upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                # held while black-holed (the end of a stream too: a partition lets no FIN
                # through); False once cut or stopped
                if not self.proxy._wait_forwarding():
                    self.shut()
                    break
                if not data:  # the sender ended its side: pass the end on
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    break
                dst.sendall(data)
        except OSError:  # reset by a peer (passed on once forwarding), or shut by cut/stop
            self.proxy._wait_forwarding()
            self.shut()
        finally:
            with self._lock:
                self._pumps_left -= 1
                last = self._pumps_left == 0
                if last:  # both directions done: nobody uses the sockets any more
                    self._closed = True
                    self.client.close()
                    self.upstream.close()
            if last:
                self.proxy._forget(self)


class TcpProxy:
    """Forwards ``127.0.0.1:<free port>`` (:attr:`address`) to ``target`` ("host:port")."""

    def __init__(self, target: str, *, connect_timeout: float = 5.0) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.connect_timeout = connect_timeout
        self.state = FORWARD
        self._cond = threading.Condition()
        self._links: set[_Link] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._handlers: list[threading.Thread] = []
        self.address = ""

    # -- the tests' controls ---------------------------------------------------------------

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        self.address = f"127.0.0.1:{listener.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name="tcp-proxy")
        self._acceptor.start()
        return self

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def cut(self) -> None:
        """Close every open connection; reset every new one at once (until :meth:`heal`)."""
        self._set(CUT)
        for link in self._snapshot():
            link.shut()

    def blackhole(self) -> None:
        """Deliver nothing either way, close nothing (until :meth:`heal`)."""
        self._set(BLACKHOLE)

    def heal(self) -> None:
        """Forward again: new connections, and black-holed ones still open (their held
        bytes delivered first)."""
        self._set(FORWARD)

    def stop(self) -> None:
        """Close the listener and every connection; join every thread."""
        self._set(STOPPED)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() (Linux)
        if self._acceptor is not None:
            self._acceptor.join(10)
        if self._listener is not None:
            self._listener.close()
        for t in list(self._handlers):
            t.join(10)
        links = self._snapshot()
        for link in links:
            link.shut()
        for link in links:
            for t in link.threads:
                t.join(10)

    def connections(self) -> int:
        """How many proxied connections are open now."""
        return len(self._snapshot())

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inside ----------------------------------------------------------------------------

    def _set(self, state: str) -> None:
        with self._cond:
            if self.state != STOPPED:
                self.state = state
            self._cond.notify_all()

    def _snapshot(self) -> list[_Link]:
        with self._cond:
            return list(self._links)

    def _forget(self, link: _Link) -> None:
        with self._cond:
            self._links.discard(link)

    def _wait_forwarding(self) -> bool:
        """Block while black-holed; True to forward, False if the link must end."""
        with self._cond:
            self._cond.wait_for(lambda: self.state != BLACKHOLE)
            return self.state == FORWARD

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # stop() shut the listener
                return
            with self._cond:
                state = self.state
                if state not in (CUT, STOPPED):
                    self._handlers = [t for t in self._handlers if t.is_alive()]
                    handler = threading.Thread(target=self._connect, args=(client,), daemon=True)
                    self._handlers.append(handler)
            if state in (CUT, STOPPED):
                _reset(client)
                if state == STOPPED:
                    return
                continue
            handler.start()

    def _connect(self, client: socket.socket) -> None:
        """Connect upstream for a new client (not in the acceptor: a slow upstream must not
        hold up other clients); a client whose upstream refuses is reset."""
        try:
            upstream = socket.create_connection(self.target, timeout=self.connect_timeout)
        except OSError:
            _reset(client)
            return
        upstream.settimeout(None)
        link = _Link(self, client, upstream)
        with self._cond:
            if self.state in (CUT, STOPPED):
                accepted = False
            else:
                self._links.add(link)
                accepted = True
        if not accepted:
            _reset(client)
            upstream.close()
            return
        link.start()
