"""The Noise handshake against an independent implementation (the ``noiseprotocol``
package), the legacy static-key mode beside it, and the X25519 keys derived from the
identities against known answers."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from fedswarm.swarm.net import noise
from fedswarm.swarm.net.envelope import Verifier
from fedswarm.swarm.net.identity import Identity

from tests.noise_helpers import ALLOWED, A, B, Wire, records, transport


def _raw_private(ident: Identity) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return ident.x25519_private().private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                serialization.NoEncryption())


def _reference(ident: Identity, initiator: bool):
    conn = pytest.importorskip("noise.connection")  # noiseprotocol, a dev dependency
    n = conn.NoiseConnection.from_name(b"Noise_XX_25519_AESGCM_SHA256")
    n.set_as_initiator() if initiator else n.set_as_responder()
    n.set_prologue(b"fedswarm-swarm-noise-v1")
    n.set_keypair_from_private_bytes(conn.Keypair.STATIC, _raw_private(ident))
    n.start_handshake()
    return n


def test_handshake_and_records_interoperate_with_the_noiseprotocol_package():
    # our initiator, their responder; our records (rekeyed every 2) decrypted by their cipher state
    ref = _reference(A, initiator=False)
    x, y = socket.socketpair()
    seen = {}

    def responder():
        m1 = noise.read_exact(x, 36, "message 1")
        assert m1[:4] == noise.MAGIC
        ref.read_message(m1[4:])
        x.sendall(ref.write_message(A.public_bytes))
        seen["payload"] = ref.read_message(noise.read_exact(x, 96, "message 3"))

    t = threading.Thread(target=responder)
    t.start()
    ours = noise.initiate(y, B, Verifier(B, ALLOWED), A.peer_id, rekey_records=2)
    t.join(10)
    assert seen["payload"] == B.public_bytes and ref.handshake_finished
    assert ref.get_handshake_hash() == ours.handshake_hash
    ours.sock = Wire()
    msgs = [os.urandom(100 + i) for i in range(5)]
    for m in msgs:
        ours.sendall(m)
    theirs = ref.noise_protocol.cipher_state_decrypt
    for i, (head, ct) in enumerate(records(bytes(ours.sock.data))):
        assert theirs.decrypt_with_ad(head, ct) == msgs[i]
        if i % 2 == 1:
            theirs.rekey()
    # their initiator, our responder; their record read by ours
    ref = _reference(B, initiator=True)
    x, y = socket.socketpair()
    got = {}

    def our_responder():
        assert noise.read_exact(x, 4, "magic") == noise.MAGIC
        got["conn"] = noise.respond(x, A, Verifier(A, ALLOWED))

    t = threading.Thread(target=our_responder)
    t.start()
    y.sendall(noise.MAGIC + ref.write_message())
    assert ref.read_message(noise.read_exact(y, 128, "message 2")) == A.public_bytes
    y.sendall(ref.write_message(B.public_bytes))
    t.join(10)
    assert got["conn"].peer == B.peer_id and got["conn"].handshake_hash == ref.get_handshake_hash()
    head = struct.pack(">I", 16 + 11)
    y.sendall(head + ref.noise_protocol.cipher_state_encrypt.encrypt_with_ad(head, b"hello, swarm"[:11]))
    assert bytes(got["conn"].recv_exact(11)) == b"hello, swarm"[:11]
    for s in (x, y):
        s.close()


def test_a_responder_accepts_the_handshake_and_the_legacy_static_key_mode():
    server = transport(A).start()
    noise_client, legacy = transport(B), transport(B, static_keys=True)
    try:
        for client, handshakes in ((noise_client, 1), (legacy, 1)):  # the legacy request adds none
            body = os.urandom(20_000)
            assert bytes(client.request(server.address, A.peer_id, "model", {}, body, timeout=10).body) == body[::-1]
            assert server.stats.handshakes == handshakes
        assert noise_client.stats.handshakes == 1 and legacy.stats.handshakes == 0
        assert server.verifier.drop_counts() == {}
    finally:
        for t in (server, noise_client, legacy):
            t.stop()


def test_legacy_static_keys_needs_encryption():
    from fedswarm.swarm.peer import PeerConfig

    PeerConfig(insecure_allow_any=True, legacy_static_keys=True).check()
    with pytest.raises(ValueError, match="cannot go with --no-encrypt"):
        PeerConfig(insecure_allow_any=True, encrypt=False, legacy_static_keys=True).check()


# -- the Ed25519 -> X25519 map (libsodium through PyNaCl) ------------------------------------------
def _fixed(seed: bytes) -> Identity:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = Ed25519PrivateKey.from_private_bytes(seed)
    return Identity(key, key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def test_x25519_keys_match_the_known_answers():
    """Vectors written down from the former field-arithmetic conversion (u = (1 + y)/(1 − y)
    mod 2^255 − 19, scalar = SHA-512(seed)[:32]) before it was replaced: PyNaCl gives the same."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from fedswarm.swarm.net.identity import x25519_public

    def raw(pub: X25519PublicKey) -> str:
        return pub.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    a, b = _fixed(bytes(range(32))), _fixed(bytes(range(100, 132)))
    assert a.peer_id == "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
    assert raw(x25519_public(a.peer_id)) == "4701d08488451f545a409fb58ae3e58581ca40ac3f7f114698cd71deac73ca01"
    assert raw(x25519_public(b.peer_id)) == "5bccd484527714f28eb6b6fa9e43feabae73eab192aef1e7d59d2111343d7b70"
    assert raw(a.x25519_private().public_key()) == raw(x25519_public(a.peer_id))
    secret = "b56138ad241960171c76273df6634f09ce469acc28bc81439b5c8c231819ff5a"
    assert a.shared_secret(b.peer_id).hex() == secret and b.shared_secret(a.peer_id).hex() == secret


@pytest.mark.parametrize("peer_id,match", [
    ("01" + "00" * 31, "not a usable curve point"),         # y = 1: the neutral point, u would divide by 0
    ("ed" + "ff" * 30 + "7f", "not a usable curve point"),  # y = p: not a field element
    ("00" * 31, "not a usable curve point"),                # 31 bytes
    ("zz" * 32, "not a peer id"),
])
def test_unusable_public_keys_are_refused(peer_id, match):
    from fedswarm.swarm.net.identity import x25519_public

    with pytest.raises(ValueError, match=match):
        x25519_public(peer_id)
