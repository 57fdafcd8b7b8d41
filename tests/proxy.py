"""A TCP proxy on loopback in front of a real broker, which a test can freeze: connections
stay open but nothing more is forwarded either way, as with a broker that hangs (SIGSTOP,
a full disk, a network partition). Thawed, forwarding resumes. Only 127.0.0.1 is used."""
from __future__ import annotations

import selectors
import socket
import sqlite3
import threading
from pathlib import Path


class FreezableProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._frozen = threading.Event()
        self._still = threading.Event()     # the proxy's thread has seen the freeze
        self._stop = threading.Event()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="proxy", daemon=True)
        self._thread.start()

    def url(self, scheme: str, rest: str = "") -> str:
        credentials = "guest:guest@" if scheme == "amqp" else ""
        return f"{scheme}://{credentials}127.0.0.1:{self.port}{rest}"

    def freeze(self) -> None:
        """Stop forwarding; returns once nothing more goes through."""
        self._still.clear()
        self._frozen.set()
        if self._thread.is_alive() and not self._still.wait(5):
            raise RuntimeError("the proxy's thread did not stop forwarding within 5 s")

    def thaw(self) -> None:
        self._frozen.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()
        with self._lock:
            for a, b in self._pairs:
                a.close()
                b.close()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, None)
        peers: dict[socket.socket, socket.socket] = {}
        while not self._stop.is_set():
            if self._frozen.is_set():
                # Accept nothing and forward nothing: the data waits in the kernel buffers.
                self._still.set()
                self._stop.wait(0.02)
                continue
            for key, _ in selector.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    client, _ = self.listener.accept()
                    try:
                        server = socket.create_connection(self.target, timeout=5)
                    except OSError:
                        client.close()
                        continue
                    peers[client], peers[server] = server, client
                    with self._lock:
                        self._pairs.append((client, server))
                    selector.register(client, selectors.EVENT_READ, None)
                    selector.register(server, selectors.EVENT_READ, None)
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                other = peers.get(sock)
                if not data or other is None:
                    for s in (sock, other):
                        if s is not None and s in peers:
                            selector.unregister(s)
                            s.close()
                            peers.pop(s, None)
                    continue
                try:
                    other.sendall(data)
                except OSError:
                    pass
        selector.close()


class SilentBroker:
    """A broker a test can make go silent: SQLite with its write lock held by a connection
    of the test's own (every writer waits; readers go on), Redis or RabbitMQ behind a
    FreezableProxy. ``url`` is the one to give the worker; ``direct_url`` reaches the broker
    without the proxy."""

    PORTS = {"redis": 6379, "amqp": 5672}

    def __init__(self, kind: str, directory: Path, redis_db: int = 4) -> None:
        self.kind = kind
        self.proxy: FreezableProxy | None = None
        self._locker: sqlite3.Connection | None = None
        if kind == "sqlite":
            self.path = directory / "broker.sqlite3"
            self.url = self.direct_url = f"sqlite:///{self.path}"
            return
        self.proxy = FreezableProxy(self.PORTS[kind])
        if kind == "redis":
            self.url = self.proxy.url("redis", f"/{redis_db}")
            self.direct_url = f"redis://127.0.0.1:{self.PORTS[kind]}/{redis_db}"
        else:
            self.url = self.proxy.url("amqp", "//")
            self.direct_url = f"amqp://guest:guest@127.0.0.1:{self.PORTS[kind]}//"

    def freeze(self) -> None:
        if self.proxy is not None:
            self.proxy.freeze()
            return
        self._locker = sqlite3.connect(self.path, isolation_level=None)
        self._locker.execute("BEGIN EXCLUSIVE")

    def cut(self) -> None:
        """End the silence without letting through anything sent meanwhile: the SQLite
        lock is given up, the proxy closed with what it held dropped."""
        if self._locker is not None:
            self._locker.rollback()
            self._locker.close()
            self._locker = None
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None

    close = cut
