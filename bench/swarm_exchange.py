"""The 40 MB model exchange of ``fedswarm bench swarm``: a raw socket against the swarm's
transports (plain, Noise-encrypted, legacy static-key encrypted, mutual TLS) in one run,
and ``--profile``'s step-by-step account of where an exchange's time goes. Run through :mod:`fedswarm.bench.swarm`
(``python -m fedswarm.bench.swarm --exchange-only [--profile] --out OUT``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path

import torch

from fedswarm.params import all_finite
from fedswarm.swarm.net.noise import pipeline_default

__all__ = ["D_EXCHANGE", "EXCHANGE_PATHS", "exchange_rows", "profile_rows"]

D_EXCHANGE = 10_000_000
#: The raw reference writes 1 MB at a time: on loopback here one 40 MB ``sendall`` took ~12.3 ms
#: and forty 1 MB ones ~9.8 (the kernel holds the socket for a whole call, delaying the window
#: updates), so the faster of the two is the reference the swarm's paths are divided by.
RAW_WRITE = 1 << 20


# -- 1. exchange throughput ------------------------------------------------------------
def _transport(pki: Path, name: str, handler, *, mode: str, **kw):
    """A transport for peer ``name`` of the bench's PKI: ``plain`` (signed envelopes, Poly1305
    body tags), ``encrypted`` (a Noise handshake per connection, then everything AES-256-GCM
    under its session keys), ``pipelined`` (the same, each body's records encrypted on a
    second thread while earlier ones are written), ``static`` (AES-256-GCM bodies under static-key-derived keys, no
    forward secrecy) or ``secure`` (mutual TLS with CA-issued certificates bound to the key)."""
    from fedswarm.swarm.net.envelope import Verifier
    from fedswarm.swarm.net.identity import create_or_load
    from fedswarm.swarm.net.transport import Transport, permissioned_tls

    d = pki / "peers" / name
    ident = create_or_load(d / "keys")
    other = create_or_load(pki / "peers" / ("p1" if name == "p0" else "p0") / "keys")
    tls = {"encrypt": mode in ("encrypted", "pipelined", "static"), "static_keys": mode == "static",
           "noise_pipeline": mode == "pipelined"}
    if mode == "secure":
        tls_s, tls_c = permissioned_tls(str(pki / "ca.pem"), str(d / "cert.pem"), str(d / "keys" / "private.pem"),
                                        ident.peer_id, str(pki / "crl.pem"))
        tls = {"tls_server": tls_s, "tls_client": tls_c, "bind_identity": True}
    return Transport(ident, Verifier(ident, {other.peer_id}), handler, **tls, **kw)  # the peers' chunk size


def _receiver(pipe, pki: str, d: int) -> None:
    """Child process: swarm transports that validate and ack models, and two raw socket
    servers that read the same number of bytes into one warm buffer (one also checks them
    for finiteness, as a peer must; neither authenticates anything)."""
    from fedswarm.swarm.net.payload import read_vector

    torch.set_num_threads(1)

    def handle(msg, s):
        read_vector(msg.meta, msg.body, d, finite=msg.finite)  # validated as a peer does, before any use
        # one thread per connection: its CPU time so far is this exchange's (handshake included)
        s.send("ack", {"cpu_s": time.thread_time()}, re=msg.nonce)

    ts = {m: _transport(Path(pki), "p1", handle, mode=m).start() for m in EXCHANGE_PATHS if not m.startswith("raw")}
    raw = {m: socket.create_server(("127.0.0.1", 0)) for m in ("raw", "raw_checked")}
    buf = bytearray(4 * d)

    def serve_raw(server: socket.socket, check: bool):
        while True:
            try:
                c, _ = server.accept()
            except OSError:
                return
            with c:
                cpu0 = time.thread_time()
                view, got = memoryview(buf), 0
                while got < len(buf):
                    got += c.recv_into(view[got:])
                if check:
                    all_finite(torch.frombuffer(buf, dtype=torch.float32))  # what a peer checks
                c.sendall(struct.pack(">d", time.thread_time() - cpu0))

    for m, server in raw.items():
        threading.Thread(target=serve_raw, args=(server, m == "raw_checked"), daemon=True).start()
    pipe.send((ts["plain"].ident.peer_id, {m: t.address for m, t in ts.items()},
               {m: server.getsockname()[1] for m, server in raw.items()}))
    pipe.recv()  # until the parent is done
    for t in ts.values():
        t.stop()
    for server in raw.values():
        server.close()


EXCHANGE_PATHS = {
    "raw": "raw socket copy into one warm buffer (no authentication, no validation)",
    "raw_checked": "raw socket copy into one warm buffer + the finiteness check a peer does (no authentication)",
    "plain": "swarm, no TLS, body in clear (signed header, Poly1305 body tag, validated)",
    "encrypted": "swarm, no TLS, Noise XX handshake per connection, then all AES-256-GCM (forward secret, validated)",
    "pipelined": "swarm, no TLS, Noise as above, a body's records encrypted on a second thread while earlier ones "
                 "are written (FEDSWARM_NOISE_PIPELINE=on)",
    "static": "swarm, no TLS, body AES-256-GCM under static-key-derived keys (legacy, NO forward secrecy, validated)",
    "secure": "swarm, mutual TLS (encrypted, CA-issued certs bound to the signing key, validated)",
}


def exchange_rows(reps: int, d: int = D_EXCHANGE) -> list[dict]:
    from fedswarm.certs import init_pki
    from fedswarm.swarm.net.payload import vector_body

    tmp = Path(tempfile.mkdtemp(prefix="bench-swarm-pki-"))
    init_pki(tmp / "pki", hosts=[], peers=2)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(child, str(tmp / "pki"), d), daemon=True)
    proc.start()
    times: dict[str, list[float]] = {k: [] for k in EXCHANGE_PATHS}
    cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in EXCHANGE_PATHS}  # (sender, receiver) s
    handshakes: dict[str, list[float]] = {}  # each exchange's own handshake, wall s (the sender's side)
    sent: dict[str, int] = {}
    order = list(EXCHANGE_PATHS)
    try:
        peer_id, addrs, raw_ports = parent.recv()
        senders = {m: (_transport(tmp / "pki", "p0", lambda m, s: None, mode=m, io_timeout_s=120), a)
                   for m, a in addrs.items()}
        meta, body = vector_body(torch.randn(d))
        for r in range(reps + 1):  # the first round warms up every path; the order rotates
            for key in order[r % len(order):] + order[: r % len(order)]:
                t0, c0 = time.perf_counter(), time.thread_time()
                if key in raw_ports:
                    with socket.create_connection(("127.0.0.1", raw_ports[key])) as s:
                        for o in range(0, len(body), RAW_WRITE):
                            s.sendall(body[o : o + RAW_WRITE])
                        ack = s.recv(8, socket.MSG_WAITALL)
                    recv_cpu = struct.unpack(">d", ack)[0]
                else:
                    t, addr = senders[key]
                    n0, h0 = t.stats.handshakes, t.stats.handshake_s
                    recv_cpu = t.request(addr, peer_id, "model", meta, body, timeout=120).meta["cpu_s"]
                    if t.stats.handshakes > n0:
                        handshakes.setdefault(key, []).append(t.stats.handshake_s - h0)
                times[key].append(time.perf_counter() - t0)
                cpu[key].append((time.thread_time() - c0, recv_cpu))
        for key, (t, _) in senders.items():
            sent[key] = t.stats.totals()[0] // (reps + 1)
            t.stop()
    finally:
        parent.send("done")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    # over a session already open: each exchange less its own connection's handshake, then the median
    # (a path whose every exchange opened a connection; one slow handshake moves only its own rep)
    apart = {k: statistics.median(t - h for t, h in zip(times[k][1:], hs[1:], strict=True))
             for k, hs in handshakes.items() if len(hs) == len(times[k])}
    common = {"benchmark": "exchange", "params": d, "payload_bytes": 4 * d, "reps": reps, "load": os.getloadavg()[0]}
    default = "pipelined" if pipeline_default() else "encrypted"  # what a peer here does (FEDSWARM_NOISE_PIPELINE)
    return [{**common, "transport": EXCHANGE_PATHS[k] + (" [this machine's default]" if k == default else ""),
             "path": k, "seconds": med[k], "MBps": 4 * d / med[k] / 1e6,
             "ratio_vs_raw": med["raw"] / med[k], "wire_bytes": sent.get(k, 4 * d + 8),
             "send_cpu_ms": 1e3 * statistics.median(c[0] for c in cpu[k][1:]),
             "recv_cpu_ms": 1e3 * statistics.median(c[1] for c in cpu[k][1:]),
             "handshake_ms": 1e3 * statistics.median(handshakes[k][1:]) if k in apart else None,
             "ratio_vs_raw_handshake_apart": med["raw"] / apart[k] if k in apart else None,
             "seconds_first": times[k][0], "seconds_all": times[k][1:]} for k in EXCHANGE_PATHS]


def profile_rows(reps: int = 3, n: int = 4 * D_EXCHANGE) -> list[dict]:
    """Where the time of one 40 MB exchange goes, step by step, in this process (median
    CPU ms of ``reps``, this thread's; the handshakes: both sides'): what a raw socket pays
    (a copy) next to what the swarm adds."""
    import hmac
    import ssl

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    from fedswarm.certs import init_pki
    from fedswarm.swarm.net.envelope import CHUNK_BYTES, alloc_body

    chunk = CHUNK_BYTES  # what a peer sends
    src = bytearray(os.urandom(1000)) * (n // 1000)
    aes = AESGCM(os.urandom(32))
    cts = [aes.encrypt(i.to_bytes(12, "big"), memoryview(src)[o : o + chunk], None)
           for i, o in enumerate(range(0, n, chunk))]
    warm = bytearray(n + 16)  # room for the last chunk's tag when decrypting in place
    scratch = bytearray(chunk + 16)
    tmp = Path(tempfile.mkdtemp(prefix="bench-swarm-prof-"))
    init_pki(tmp / "pki", hosts=[], peers=2)

    def tls_pair():
        def ctx(server: bool, name: str):
            c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
            c.check_hostname = False
            c.load_verify_locations(tmp / "pki" / "ca.pem")
            c.verify_mode = ssl.CERT_REQUIRED
            c.load_cert_chain(tmp / "pki" / "peers" / name / "cert.pem",
                              tmp / "pki" / "peers" / name / "keys" / "private.pem")
            return c
        ci, co, si, so = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
        c, s = ctx(False, "p0").wrap_bio(ci, co), ctx(True, "p1").wrap_bio(si, so, server_side=True)
        for _ in range(6):
            for o in (c, s):
                try:
                    o.do_handshake()
                except ssl.SSLWantReadError:
                    pass
            si.write(co.read())
            ci.write(so.read())
        return c, co, s, si

    def step_copy():
        memoryview(warm)[:n] = src

    def step_fresh():
        memoryview(alloc_body(n))[:] = src

    def step_poly():
        m = Poly1305(hmac.new(b"k", b"m", "sha256").digest())
        for o in range(0, n, chunk):
            m.update(memoryview(src)[o : o + chunk])
        m.finalize()

    def step_gcm_enc():
        out = bytearray(chunk + 16)
        for i, o in enumerate(range(0, n, chunk)):
            piece = memoryview(src)[o : o + chunk]
            aes.encrypt_into(i.to_bytes(12, "big"), piece, None, memoryview(out)[: len(piece) + 16])

    def step_gcm_dec():
        v = memoryview(warm)
        for i, o in enumerate(range(0, n, chunk)):
            aes.decrypt_into(i.to_bytes(12, "big"), cts[i], None, v[o : o + len(cts[i]) - 16])

    def step_record_scratch(check: bool = False):
        """A record copied into a 1 MB scratch (as ``recv_into`` does), decrypted into the body;
        ``check``: each chunk's finiteness checked while it is in cache."""
        v = memoryview(warm)
        for i, o in enumerate(range(0, n, chunk)):
            c = len(cts[i])
            memoryview(scratch)[:c] = cts[i]
            aes.decrypt_into(i.to_bytes(12, "big"), memoryview(scratch)[:c], None, v[o : o + c - 16])
            if check:
                all_finite(torch.frombuffer(warm, dtype=torch.float32, count=(c - 16) // 4, offset=o))

    def step_record_in_place():
        v = memoryview(warm)
        for i, o in enumerate(range(0, n, chunk)):
            c = len(cts[i])
            v[o : o + c] = cts[i]
            aes.decrypt_into(i.to_bytes(12, "big"), v[o : o + c], None, v[o : o + c - 16])

    def step_tls_enc():
        c, co, _, _ = tls_pair()
        for o in range(0, n, 1 << 20):
            c.write(memoryview(src)[o : o + (1 << 20)])
            co.read()

    def step_tls_dec() -> float:
        """Decrypt 40 MB of TLS records through Python's ssl (one record per read, as a socket
        reads them); only the decryption is timed."""
        c, co, s, si = tls_pair()
        records = []
        for o in range(0, n, 1 << 20):
            c.write(memoryview(src)[o : o + (1 << 20)])
            records.append(co.read())
        view, got = memoryview(warm), 0
        t0 = time.thread_time()
        for rec in records:
            si.write(rec)
            while got < n:
                try:
                    got += s.read(n - got, view[got:])
                except ssl.SSLWantReadError:
                    break
        assert got == n
        return time.thread_time() - t0

    def step_validate():
        all_finite(torch.frombuffer(warm, dtype=torch.float32, count=n // 4))

    def handshakes(resume: bool) -> float:
        """CPU ms of both sides of one mutual-TLS handshake (CRL checked), median of 5."""
        from fedswarm.swarm.net.identity import create_or_load
        from fedswarm.swarm.net.transport import permissioned_tls

        def ctxs(name):
            d = tmp / "pki" / "peers" / name
            return permissioned_tls(str(tmp / "pki" / "ca.pem"), str(d / "cert.pem"), str(d / "keys" / "private.pem"),
                                    create_or_load(d / "keys").peer_id, str(tmp / "pki" / "crl.pem"))
        server, client, ticket, out = ctxs("p1")[0], ctxs("p0")[1], None, []
        for _ in range(6):
            a, b = socket.socketpair()
            cpu_s = []

            def serve(a=a, cpu_s=cpu_s):
                c0 = time.thread_time()
                with server.wrap_socket(a, server_side=True) as x:
                    x.sendall(b"k")
                    x.recv(1)
                cpu_s.append(time.thread_time() - c0)
            th = threading.Thread(target=serve)
            th.start()
            c0 = time.thread_time()
            with client.wrap_socket(b, session=ticket if resume else None) as y:
                y.recv(1)  # the session ticket came before this byte
                y.sendall(b"k")
                ticket = y.session
            c1 = time.thread_time() - c0
            th.join()
            out.append(c1 + cpu_s[0])
        return 1e3 * statistics.median(out[1:])

    def noise_handshakes() -> float:
        """CPU ms of both sides of one Noise XX handshake over a socket pair, median of 5."""
        from fedswarm.swarm.net.envelope import Verifier
        from fedswarm.swarm.net.identity import Identity
        from fedswarm.swarm.net.noise import initiate, read_exact, respond

        a, b = Identity.generate(), Identity.generate()
        out = []
        for _ in range(6):
            x, y = socket.socketpair()
            cpu_s = []

            def serve(x=x, cpu_s=cpu_s):
                c0 = time.thread_time()
                read_exact(x, 4, "magic")
                respond(x, a, Verifier(a, None))
                cpu_s.append(time.thread_time() - c0)
            th = threading.Thread(target=serve)
            th.start()
            c0 = time.thread_time()
            initiate(y, b, Verifier(b, None), a.peer_id)
            c1 = time.thread_time() - c0
            th.join()
            x.close()
            y.close()
            out.append(c1 + cpu_s[0])
        return 1e3 * statistics.median(out[1:])

    steps = {"copy 40 MB into a warm buffer (what a raw socket costs per side, roughly)": step_copy,
             "copy into a fresh body buffer (page faults included; a received body reuses a pooled one)":
                 step_fresh,
             "Poly1305 tag of the body (clear mode, each side)": step_poly,
             f"AES-256-GCM encrypt, {chunk >> 20} MB chunks (encrypted mode, sender)": step_gcm_enc,
             f"AES-256-GCM decrypt_into, {chunk >> 20} MB chunks (encrypted mode, receiver)": step_gcm_dec,
             "a record copied into a 1 MB scratch, decrypt_into the body (Noise receiver)": step_record_scratch,
             "... instead copied into the body and decrypted in place (not used)": step_record_in_place,
             "... the scratch path with each chunk's finiteness checked in cache (not used)":
                 lambda: step_record_scratch(check=True),
             "TLS 1.3 record encryption through Python's ssl (mutual-TLS mode, sender)": step_tls_enc,
             "TLS 1.3 record decryption through Python's ssl, 16 KB records (mutual-TLS mode, receiver)":
                 step_tls_dec,
             "finiteness check (params.all_finite, receiver)": step_validate}
    torch.set_num_threads(1)
    rows = []
    try:
        for name, resume in (("mutual-TLS handshake, full (CPU of both sides)", False),
                             ("mutual-TLS handshake, resumed with a session ticket (CPU of both sides)", True)):
            rows.append({"benchmark": "profile", "step": name, "ms": handshakes(resume), "load": os.getloadavg()[0]})
        rows.append({"benchmark": "profile", "step": "Noise XX handshake, 4 X25519 a side (CPU of both sides)",
                     "ms": noise_handshakes(), "load": os.getloadavg()[0]})
        for name, fn in steps.items():
            ts = []
            for _ in range(reps):
                t0 = time.thread_time()  # CPU time: a loaded machine inflates it far less than wall time
                timed = fn()  # a step that sets itself up returns the time of its own part
                ts.append(timed if timed is not None else time.thread_time() - t0)
            rows.append({"benchmark": "profile", "step": name, "ms": 1e3 * statistics.median(ts),
                         "load": os.getloadavg()[0]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows
