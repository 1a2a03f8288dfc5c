"""Helpers shared by the swarm tests: in-process peers, raw clients, recorded messages."""

from __future__ import annotations

import datetime as dt
import socket
import threading
from pathlib import Path

from fedswarm.swarm.net.envelope import Conn, Dropped
from fedswarm.swarm.net.identity import Identity, create_or_load
from fedswarm.swarm.peer import Peer, PeerConfig


def make_peers(tmp: Path, n: int, *, algorithm: str = "dpsgd", task: str = "synthetic-logreg", **kw) -> list[Peer]:
    """``n`` in-process peers on loopback sharing one allow list; peer 0 is the join peer."""
    idents = [create_or_load(tmp / f"p{i}" / "keys") for i in range(n)]
    allow = tmp / "allow.txt"
    allow.write_text("# test swarm\n" + "\n".join(i.peer_id for i in idents) + "\n")
    peers, first = [], None
    for i in range(n):
        cfg = PeerConfig(join=[first] if first else [], algorithm=algorithm, task=task, num_partitions=n,
                         partition_id=i, allow=str(allow), state_dir=str(tmp / f"p{i}"), min_peers=n,
                         **{"heartbeat_s": 0.1, "round_timeout_s": 5.0, "linger_s": 1.0, "local_steps": 5, **kw})
        p = Peer(cfg, identity=idents[i])
        first = first or p.transport.address
        peers.append(p)
    return peers


def run_all(peers: list[Peer], timeout: float = 120.0) -> list[dict]:
    out: list = [None] * len(peers)

    def go(i: int) -> None:
        out[i] = peers[i].run()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(peers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    for p in peers:
        p.stop.set()
    assert all(o is not None for o in out), "a peer did not finish"
    return out


def start_all(peers: list[Peer]) -> None:
    """Start transports, heartbeats and joins (no training rounds)."""
    threads = [threading.Thread(target=p.start) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def stop_all(peers: list[Peer]) -> None:
    for p in peers:
        p.stop.set()
    for p in peers:
        p.transport.stop()
        p.pool.shutdown(wait=False)


class Recorder(Conn):
    """A Conn that records what would be sent, to replay or tamper with it."""

    def __init__(self):
        super().__init__(None)
        self.data = bytearray()

    def sendall(self, data) -> None:
        self.data += bytes(data)


class Replay(Recorder):
    """A Conn whose reads replay recorded bytes (``data``, or what is sent to it), and which
    knows how far it was read (``pos``)."""

    def __init__(self, data: bytes | None = None):
        super().__init__()
        if data is not None:
            self.data += data
        self.pos = 0

    def recv_exact_into(self, view) -> None:
        n = len(view)
        if self.pos + n > len(self.data):
            raise Dropped("closed", "end of recording")
        view[:] = self.data[self.pos : self.pos + n]
        self.pos += n


def send_raw(addr: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes to a peer and read until it closes; returns what it answered."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the peer hung up early (e.g. on an oversized header)
            return b""
        chunks = []
        while True:
            try:
                c = s.recv(65536)
            except ConnectionResetError:
                break
            if not c:
                break
            chunks.append(c)
    return b"".join(chunks)


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate and key for 127.0.0.1."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedswarm-peer")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    c, k = tmp / "cert.pem", tmp / "key.pem"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return c, k


__all__ = ["Identity", "Recorder", "make_peers", "run_all", "self_signed", "send_raw", "start_all", "stop_all"]
