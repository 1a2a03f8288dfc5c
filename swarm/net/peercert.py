"""What a swarm peer's certificate proves: the Ed25519 identity key it is issued for.

``fedswarm certs`` (:mod:`fedswarm.certs`) issues a peer's certificate for its identity key
and names that key in a ``urn:fedswarm:peer:<hex>`` URI; the transport of a permissioned
swarm reads it back from the TLS handshake, so the identity a peer proves there is the one
its messages are signed with.
"""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = ["PEER_URI_PREFIX", "peer_id_of_cert"]

PEER_URI_PREFIX = "urn:fedswarm:peer:"


def peer_id_of_cert(cert: x509.Certificate | bytes) -> str:
    """The peer id (hex Ed25519 public key) a peer certificate is issued for; ValueError
    if it is not a peer certificate (other key type, or the URI does not match the key)."""
    if isinstance(cert, bytes | bytearray):
        cert = x509.load_der_x509_certificate(bytes(cert))
    key = cert.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("certificate is not for an Ed25519 peer key")
    pid = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
            .get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    if PEER_URI_PREFIX + pid not in uris:
        raise ValueError("certificate does not name its key as a fedswarm peer")
    return pid
