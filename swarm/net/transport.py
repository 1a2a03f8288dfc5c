"""Real TCP transport between peers: a threaded server, request/response sessions,
timeouts, bounded retries, optional TLS and byte counters.

Without TLS, every connection starts with a Noise XX handshake (ephemeral X25519,
authenticated by both peers' identity keys) and carries every byte after it AES-256-GCM
encrypted under per-direction session keys (:mod:`fedswarm.swarm.net.noise`): a recorded
link stays secret even from whoever later steals both peers' identity keys. A responder
also accepts a connection without the handshake (``--no-encrypt``, and older peers' static-key
encryption, ``static_keys``, which has no forward secrecy).

One connection carries one exchange: the caller sends a request and reads a response
(``request``) or keeps talking on the same connection (``open_session``, what AD-PSGD's
request/accept/commit needs). Every message is a signed envelope
(:mod:`fedswarm.swarm.net.envelope`); every message refused on either side is counted by
reason. Sockets are blocking with timeouts (``recv_into`` straight into the body buffer,
``sendall`` straight from a tensor's storage: no extra copies of a large model).

Bytes are counted on the socket (after framing, before TLS; a Noise session's handshake and
record overhead included): ``stats.sent`` and ``stats.received``, in total and per message
kind; ``stats.handshakes`` and ``stats.handshake_s`` count the Noise handshakes and their wall
time (connect excluded).

In a permissioned swarm (mutual TLS, certificates bound to the signing keys) a body needs no
tag of its own (see :mod:`~fedswarm.swarm.net.envelope`), and a connection to a peer already
met resumes the TLS 1.3 session from its ticket: no certificate signatures to make and check
(bench: ``python -m fedswarm.bench.swarm --exchange-only --profile``), the certificate proved
again from the session on every connection.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from fedswarm.swarm.net.envelope import (
    CHUNK_BYTES,
    TAG_NOISE,
    Conn,
    Dropped,
    Message,
    Verifier,
    recv_message,
    send_message,
)
from fedswarm.swarm.net.identity import Identity
from fedswarm.swarm.net.noise import MAGIC, REKEY_BYTES, initiate, pipeline_default, read_exact, respond

__all__ = ["Session", "Transport", "TransportStats", "client_tls_context", "parse_addr", "server_tls_context",
           "tls_refusal"]

log = logging.getLogger("fedswarm.swarm")


def parse_addr(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` or ``:PORT`` -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT (got {text!r})")
    return (host.strip("[]") or default_host), int(port)


def _load_crl(ctx: ssl.SSLContext, crl: str | None) -> None:
    if crl:
        ctx.load_verify_locations(crl)
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF  # a revoked certificate fails the handshake


def server_tls_context(cert: str, key: str, *, client_ca: str | None = None, crl: str | None = None) -> ssl.SSLContext:
    """TLS for the listening side. With ``client_ca`` (a permissioned swarm), every client
    must present a certificate issued by that CA and not revoked in ``crl``: mutual TLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        _load_crl(ctx, crl)
    return ctx


def client_tls_context(ca: str | None = None, *, cert: str | None = None, key: str | None = None,
                       crl: str | None = None) -> ssl.SSLContext:
    """With ``ca``: verify the peer's certificate against it (and ``crl``). Without: encrypt
    only; peers are authenticated by their Ed25519 signatures, not by TLS. With ``cert`` and
    ``key``: present our certificate too (mutual TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # peers are addressed by IP; the CA (and the bound peer id) pin them
    if ca:
        ctx.load_verify_locations(ca)
        _load_crl(ctx, crl)
    else:
        ctx.verify_mode = ssl.CERT_NONE
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def tls_refusal(exc: BaseException) -> tuple[str, str]:
    """``(reason, detail)`` for a failed TLS handshake: ``revoked``, ``untrusted`` (no
    certificate, or one from another CA, or expired) or ``malformed`` (not TLS at all)."""
    text = getattr(exc, "verify_message", "") or getattr(exc, "reason", "") or str(exc)
    low = f"{text} {exc}".lower()
    if "revoked" in low:
        return "revoked", f"certificate revoked ({text})"
    if "unknown_ca" in low or "unknown ca" in low:
        return "untrusted", f"the other side does not trust our certificate: another swarm's CA? ({text})"
    if any(k in low for k in ("certificate", "issuer", "verify", "expired", "peer did not return")):
        return "untrusted", f"certificate not trusted ({text})"
    return "malformed", f"TLS handshake failed ({text})"


class TransportStats:
    """Bytes on the wire (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.handshakes = 0
        self.handshake_s = 0.0

    def add_handshake(self, seconds: float) -> None:
        with self._lock:
            self.handshakes += 1
            self.handshake_s += seconds

    def add(self, kind: str, conn: Conn) -> None:
        with self._lock:
            self.sent[kind] += conn.sent
            self.received[kind] += conn.received
            conn.sent = conn.received = 0

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return sum(self.sent.values()), sum(self.received.values())

    def by_kind(self) -> dict[str, dict[str, int]]:
        with self._lock:
            kinds = set(self.sent) | set(self.received)
            return {k: {"sent": self.sent[k], "received": self.received[k]} for k in kinds}


class Session:
    """Both ends of one connection: send and receive verified messages with one peer."""

    def __init__(self, transport: Transport, conn: Conn, remote: str | None, kind: str, cert_id: str | None = None):
        self.t = transport
        self.conn = conn
        self.remote = remote  # peer id, once known
        self.kind = kind  # what the bytes are counted under
        self.cert_id = cert_id  # the peer id the remote's TLS certificate proves (permissioned swarm)
        self.last_nonce: str | None = None

    def send(self, kind: str, meta: dict | None = None, body=b"", re: str | None = None) -> str:
        if self.remote is None:
            raise RuntimeError("cannot send before the remote peer is known")
        self.last_nonce = send_message(self.conn, self.t.ident, kind, to=self.remote, meta=meta, body=body,
                                       re=re, chunk_bytes=self.t.chunk_bytes,
                                       encrypt=self.t.encrypt and self.conn.channel_tag != TAG_NOISE,
                                       tls_bound=self.cert_id is not None and self.cert_id == self.remote)
        return self.last_nonce

    def recv(self, timeout: float | None = None, expect_re: str | None = None) -> Message:
        if timeout is not None:
            self.conn.sock.settimeout(timeout)
        try:
            msg = recv_message(self.conn, self.t.verifier, expect_re=expect_re, bound_peer=self.cert_id)
        finally:
            self.conn.sock.settimeout(self.t.io_timeout_s)
        if self.remote and msg.sender != self.remote:
            self.t.verifier.count("misdirected")
            raise Dropped("misdirected", "a different peer answered")
        self.remote = msg.sender
        return msg

    def close(self) -> None:
        self.t.stats.add(self.kind, self.conn)
        self.conn.close()


Handler = Callable[[Message, Session], None]


class Transport:
    """A peer's listening socket and its outgoing connections.

    Parameters
    ----------
    ident : Identity
        Signs everything sent.
    verifier : Verifier
        Checks everything received (and counts what it drops).
    handler : callable
        ``handler(message, session)`` for each verified incoming request; it answers
        with ``session.send(...)`` (an exception closes the connection).
    encrypt : bool
        Without TLS, open every connection with a Noise handshake: forward-secret session
        keys, every byte encrypted (the peer's default).
    static_keys : bool
        With ``encrypt``: no handshake; bodies AES-256-GCM encrypted under keys derived from
        the two peers' static identity keys, WITHOUT forward secrecy (what older peers speak).
    rekey_bytes : int
        A Noise session replaces a direction's key after this many bytes under it.
    noise_pipeline : bool or None
        Encrypt a Noise session's body records on a second thread while earlier ones are
        written; None: as ``FEDSWARM_NOISE_PIPELINE`` says (off unless set to ``on``).
    """

    def __init__(self, ident: Identity, verifier: Verifier, handler: Handler, *, host: str = "127.0.0.1",
                 port: int = 0, tls_server: ssl.SSLContext | None = None,
                 tls_client: ssl.SSLContext | None = None, io_timeout_s: float = 30.0,
                 connect_timeout_s: float = 3.0, max_connections: int = 64, chunk_bytes: int = CHUNK_BYTES,
                 bind_identity: bool = False, encrypt: bool = False, static_keys: bool = False,
                 rekey_bytes: int = REKEY_BYTES, noise_pipeline: bool | None = None):
        self.ident = ident
        self.verifier = verifier
        self.handler = handler
        self.tls_server = tls_server
        self.tls_client = tls_client
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.chunk_bytes = chunk_bytes
        self.bind_identity = bind_identity
        self.encrypt = encrypt and static_keys  # static-key AES-GCM bodies (no forward secrecy)
        self.noise = encrypt and not static_keys and tls_client is None  # handshake on outgoing connections
        self.rekey_bytes = rekey_bytes
        # a bad FEDSWARM_NOISE_PIPELINE fails here, when the peer starts
        self.noise_pipeline = pipeline_default() if noise_pipeline is None else noise_pipeline
        if bind_identity and (tls_server is None or tls_client is None):
            raise ValueError("binding identities to certificates needs TLS on both sides")
        self.stats = TransportStats()
        self.refusals: deque[dict] = deque(maxlen=200)  # the latest refused connections, for the report
        # TLS 1.3 session tickets per (address, peer): a later connection resumes (no certificate
        # signatures to make and check, ~4 ms of CPU a side, see bench/swarm.py). Safe for the
        # identity binding and revocation: the ticket holds the certificate the full handshake
        # verified (``_cert_id`` checks it again on every connection), only that server can
        # decrypt it, and the CRL a context checks never changes during its life.
        self._tls_sessions: dict[tuple[str, str], ssl.SSLSession] = {}
        self._tls_sessions_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stop = threading.Event()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name=f"accept-{self.port}", daemon=True)
        self._workers: set[threading.Thread] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- server ----------------------------------------------------------------------
    def start(self) -> Transport:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        try:
            self._sock.close()
        except OSError:
            pass
        for w in list(self._workers):
            w.join(timeout=2)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            if not self._slots.acquire(blocking=False):
                sock.close()  # too many connections at once: refuse rather than queue
                continue
            w = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._workers.add(w)
            w.start()

    def refuse(self, reason: str, detail: str, addr: str) -> None:
        """Count, log and remember a refused connection."""
        self.verifier.count(reason)
        self.refusals.append({"t": time.time(), "addr": addr, "reason": reason, "detail": detail})
        log.warning("%s: refused %s: %s", self.ident.short_id, addr, detail)

    def _cert_id(self, sock) -> str | None:
        if not self.bind_identity:
            return None
        from fedswarm.swarm.net.peercert import peer_id_of_cert

        der = sock.getpeercert(binary_form=True)
        if not der:
            raise Dropped("untrusted", "no certificate presented")
        try:
            return peer_id_of_cert(der)
        except ValueError as exc:
            raise Dropped("untrusted", str(exc)) from None

    def _serve(self, sock: socket.socket) -> None:
        session = None
        addr = "?"
        try:
            addr = "%s:%s" % sock.getpeername()[:2]
            sock.settimeout(self.io_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls_server is not None:
                try:
                    sock = self.tls_server.wrap_socket(sock, server_side=True)
                    cert_id = self._cert_id(sock)
                except ssl.SSLError as exc:
                    self.refuse(*tls_refusal(exc), addr)
                    return
                except Dropped as exc:
                    self.refuse(exc.reason, exc.detail, addr)
                    return
            else:
                cert_id = None
            try:
                head = read_exact(sock, len(MAGIC), "the first bytes")
            except Dropped as exc:
                self.verifier.count(exc.reason)
                raise
            except TimeoutError:
                self.verifier.count("timeout")
                raise Dropped("timeout", "peer too slow") from None
            if head == MAGIC:
                conn, cert_id = self._handshake(sock, addr, None, cert_id)
            else:
                conn = Conn(sock, head)
            session = Session(self, conn, None, "unknown", cert_id)
            msg = session.recv()
            session.kind = msg.kind
            self.handler(msg, session)
        except Dropped as exc:
            log.debug("dropped incoming message: %s", exc)
        except (OSError, ssl.SSLError) as exc:
            log.debug("connection error: %s", exc)
        except Exception:  # a handler bug must not kill the server
            log.exception("handler failed")
        finally:
            if session is not None:
                session.close()
            else:
                sock.close()
            self._slots.release()
            self._workers.discard(threading.current_thread())

    # -- client ----------------------------------------------------------------------
    def open_session(self, addr: str, remote: str, kind: str, *, retries: int = 1,
                     backoff_s: float = 0.1) -> Session:
        """Connect to ``addr`` (peer ``remote``), retrying refused or timed-out connects
        up to ``retries`` more times with exponential backoff."""
        host, port = addr.rsplit(":", 1)
        for attempt in range(retries + 1):
            try:
                sock = socket.create_connection((host, int(port)), timeout=self.connect_timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(self.io_timeout_s)
                if self.tls_client is not None:
                    with self._tls_sessions_lock:
                        ticket = self._tls_sessions.get((addr, remote))
                    sock = self.tls_client.wrap_socket(sock, session=ticket)
                try:
                    cert_id = self._cert_id(sock)
                except Dropped as exc:
                    sock.close()
                    self.refuse(exc.reason, exc.detail, addr)
                    raise
                if cert_id is not None and remote and cert_id != remote:
                    sock.close()
                    detail = f"{addr} presented the certificate of {cert_id[:8]}, not of {remote[:8]}"
                    self.refuse("identity_mismatch", detail, addr)
                    raise Dropped("identity_mismatch", detail)
                if not self.noise:
                    return Session(self, Conn(sock), remote, kind, cert_id)
                sock.settimeout(self.connect_timeout_s)  # authenticating is part of connecting
                conn, cert_id = self._handshake(sock, addr, remote, cert_id)
                sock.settimeout(self.io_timeout_s)
                return Session(self, conn, remote, kind, cert_id)
            except ssl.SSLError as exc:
                sock.close()
                reason, detail = tls_refusal(exc)
                self.refuse(reason, detail, addr)
                raise Dropped(reason, detail) from None
            except OSError:
                if attempt == retries or self._stop.is_set():
                    raise
                time.sleep(backoff_s * (2**attempt))
        raise AssertionError("unreachable")

    def _handshake(self, sock, addr: str, remote: str | None, cert_id: str | None):
        """Run our side of the Noise handshake (the initiator's when ``remote`` is not None):
        ``(conn, the peer id it proved)``. Raises :class:`Dropped` with the socket closed and
        the refusal counted, logged and remembered."""
        try:
            if remote is None:
                conn = respond(sock, self.ident, self.verifier, rekey_bytes=self.rekey_bytes,
                               pipeline=self.noise_pipeline)
            else:
                conn = initiate(sock, self.ident, self.verifier, remote, rekey_bytes=self.rekey_bytes,
                                pipeline=self.noise_pipeline)
            if cert_id is not None and conn.peer != cert_id:
                raise Dropped("identity_mismatch", f"Noise identity {conn.peer[:8]} over the TLS connection of "
                                                   f"{cert_id[:8]}")
        except TimeoutError:
            exc = Dropped("timeout", "handshake: peer too slow")
        except Dropped as dropped:
            exc = dropped
        else:
            self.stats.add_handshake(conn.handshake_s)
            return conn, conn.peer
        sock.close()
        self.refuse(exc.reason, exc.detail, addr)
        raise exc
    def request(self, addr: str, remote: str, kind: str, meta: dict | None = None, body=b"", *,
                timeout: float | None = None, retries: int = 1) -> Message:
        """Send one request and return the verified response. Raises OSError if the peer
        cannot be reached and :class:`Dropped` if its answer is refused."""
        s = self.open_session(addr, remote, kind, retries=retries)
        try:
            nonce = s.send(kind, meta, body)
            reply = s.recv(timeout=timeout, expect_re=nonce)
            self._keep_tls_session(addr, remote, s)
            return reply
        finally:
            s.close()

    def _keep_tls_session(self, addr: str, remote: str, s: Session) -> None:
        """After a verified exchange, keep the connection's newest session ticket for ``addr``."""
        ticket = getattr(s.conn.sock, "session", None)
        if ticket is None or not ticket.has_ticket:
            return
        with self._tls_sessions_lock:
            self._tls_sessions.pop((addr, remote), None)
            self._tls_sessions[(addr, remote)] = ticket
            while len(self._tls_sessions) > 1024:  # bounded: the oldest go first
                self._tls_sessions.pop(next(iter(self._tls_sessions)))


def permissioned_tls(ca: str, cert: str, key: str, peer_id: str, crl: str | None = None
                     ) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts of a permissioned swarm: mutual TLS against the swarm's CA
    (and its CRL), with ``cert`` checked to be issued for ``peer_id``'s Ed25519 key, so the
    identity a peer proves in the handshake is the one its messages are signed with."""
    from cryptography import x509

    from fedswarm.swarm.net.peercert import peer_id_of_cert

    with open(cert, "rb") as f:
        mine = x509.load_pem_x509_certificate(f.read())
    if peer_id_of_cert(mine) != peer_id:
        raise ValueError(f"{cert} is not issued for this peer's key {peer_id[:16]}… "
                         f"(issue one with `fedswarm certs peer --public-key {peer_id}`)")
    return (server_tls_context(cert, key, client_ca=ca, crl=crl),
            client_tls_context(ca, cert=cert, key=key, crl=crl))
