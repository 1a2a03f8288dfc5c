"""What the Noise tests share: two allowed identities and an outsider, a transport that
echoes, a socket stand-in, a record splitter, and one handshake over a socket pair with
either side's frames passed through a mutation."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

from fedswarm.swarm.net import noise
from fedswarm.swarm.net.envelope import Verifier
from fedswarm.swarm.net.identity import Identity
from fedswarm.swarm.net.transport import Transport

A, B, EVE = Identity.generate(), Identity.generate(), Identity.generate()
ALLOWED = {A.peer_id, B.peer_id}


def transport(ident: Identity, handler=None, **kw) -> Transport:
    def echo(msg, s):
        s.send("ack", {"n": len(msg.body)}, bytes(msg.body)[::-1], re=msg.nonce)

    return Transport(ident, Verifier(ident, ALLOWED), handler or echo, encrypt=True, io_timeout_s=10, **kw)


def records(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        head = data[pos : pos + 4]
        c = struct.unpack(">I", head)[0]
        out.append((head, data[pos + 4 : pos + 4 + c]))
        pos += 4 + c
    return out


class Wire:
    """A socket stand-in: what is sent is kept; reads replay ``data``."""

    def __init__(self, data: bytes = b""):
        self.data, self.pos = bytearray(data), 0

    def sendall(self, b) -> None:
        self.data += bytes(b)

    def recv_into(self, view, n) -> int:
        n = min(n, len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def settimeout(self, t) -> None:
        pass


class Tamper:
    """Wraps a socket; ``sendall`` passes its data through ``mutate`` first."""

    def __init__(self, sock, mutate):
        self.sock, self.mutate = sock, mutate

    def sendall(self, data) -> None:
        self.sock.sendall(self.mutate(bytes(data)))

    def __getattr__(self, name):
        return getattr(self.sock, name)


def handshake(mutate_i=None, mutate_r=None) -> tuple[BaseException | None, BaseException | None]:
    """Both sides of one handshake over a socket pair; what each raised (None: succeeded)."""
    si, sr = socket.socketpair()
    for s in (si, sr):
        s.settimeout(5)
    out: list = [None, None]

    def responder():
        try:
            assert noise.read_exact(sr, 4, "magic") == noise.MAGIC
            noise.respond(Tamper(sr, mutate_r or (lambda d: d)), A, Verifier(A, ALLOWED))
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            out[1] = exc
            sr.close()

    t = threading.Thread(target=responder)
    t.start()
    try:
        noise.initiate(Tamper(si, mutate_i or (lambda d: d)), B, Verifier(B, ALLOWED), A.peer_id)
    except Exception as exc:  # noqa: BLE001
        out[0] = exc
    with contextlib.suppress(OSError):  # the responder reads to the end of what was sent, then ends
        si.shutdown(socket.SHUT_WR)
    t.join(10)
    si.close()
    sr.close()
    return out[0], out[1]
