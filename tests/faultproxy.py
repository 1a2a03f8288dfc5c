"""A fault-injecting TCP proxy for tests: sits between peers on loopback and delays, drops or
cuts connections, so the tests can check what a peer does when the network misbehaves.

Modes (changeable while it runs, ``proxy.mode = ...``):

- ``pass``: forward bytes both ways.
- ``delay``: hold every forwarded chunk ``delay_s`` before sending it on.
- ``drop``: accept connections and swallow everything (a black hole: nothing answers, nothing closes).
- ``cut``: forward the first ``cut_after`` bytes from client to server, then close both sides
  (a connection cut in the middle of a message).

``stats`` counts connections per mode. Every thread it starts it stops in :meth:`stop`.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["FaultProxy"]


class FaultProxy:
    def __init__(self, target: tuple[str, int], *, mode: str = "pass", delay_s: float = 0.0, cut_after: int = 0):
        self.target = target
        self.mode = mode
        self.delay_s = delay_s
        self.cut_after = cut_after
        self.stats: dict[str, int] = {}
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self._accept.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._accept.join(5)
        self._sock.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
        for t in self._threads:
            t.join(5)

    def _track(self, *socks: socket.socket) -> None:
        with self._lock:
            self._conns.extend(socks)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            mode = self.mode
            self.stats[mode] = self.stats.get(mode, 0) + 1
            self._track(client)
            if mode == "drop":
                self._spawn(self._swallow, client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            self._track(server)
            budget = [self.cut_after] if mode == "cut" else None
            self._spawn(self._pipe, client, server, mode, budget)
            self._spawn(self._pipe, server, client, mode, None)

    def _swallow(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        while not self._stop.is_set():
            try:
                if not conn.recv(1 << 16):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def _pipe(self, src: socket.socket, dst: socket.socket, mode: str, budget: list[int] | None) -> None:
        src.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                if mode == "delay" and self.delay_s:
                    self._stop.wait(self.delay_s)
                if budget is not None:
                    data = data[: budget[0]]
                    budget[0] -= len(data)
                    if data:
                        dst.sendall(data)
                    if budget[0] <= 0:
                        break  # cut: close both sides in the middle of the message
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

