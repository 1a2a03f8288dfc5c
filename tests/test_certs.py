"""``fedswarm certs``: the PKI it writes is checked with ``cryptography``'s own parsers and
verifiers (the independent oracle), private keys are 0600 and never printed."""

from __future__ import annotations

import ipaddress
import os
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fedswarm.certs import CertAuthority, init_pki, issue_peer, revoke
from fedswarm.swarm.net.peercert import peer_id_of_cert
from fedswarm.swarm.net.identity import create_or_load
from typer.testing import CliRunner


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_makes_a_ca_server_cert_node_keys_and_peer_certs(tmp_path):
    from fedswarm.cli import app

    out = tmp_path / "pki"
    res = CliRunner().invoke(app, ["certs", "init", "--out", str(out), "--host", "localhost", "--host", "127.0.0.1",
                                   "--supernodes", "2", "--peers", "2"])
    assert res.exit_code == 0, res.output
    secrets = [out / "ca.key", out / "superlink" / "server.key", out / "supernodes" / "sn0.key",
               out / "supernodes" / "sn1.key", out / "peers" / "p0" / "keys" / "private.pem",
               out / "peers" / "p1" / "keys" / "private.pem"]
    for path in secrets:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        body = path.read_bytes().split(b"\n")[1]  # a line of the key's base64
        assert body.decode() not in res.output, f"{path} printed"
    assert "PRIVATE" not in res.output
    ca = _cert(out / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # the server certificate is signed by the CA, names both hosts, and is for server auth
    server = _cert(out / "superlink" / "server.pem")
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    days = (server.not_valid_after_utc - server.not_valid_before_utc).days
    assert 300 <= days <= 400
    key = serialization.load_pem_private_key((out / "superlink" / "server.key").read_bytes(), None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()
    # SuperNode keys: OpenSSH ECDSA P-384 pairs (what Flower's node authentication loads)
    for i in range(2):
        priv = serialization.load_ssh_private_key((out / "supernodes" / f"sn{i}.key").read_bytes(), None)
        pub = serialization.load_ssh_public_key((out / "supernodes" / f"sn{i}.pub").read_bytes())
        assert isinstance(priv, ec.EllipticCurvePrivateKey) and isinstance(priv.curve, ec.SECP384R1)
        assert priv.public_key().public_numbers() == pub.public_numbers()
    # peer certificates are issued for the peers' Ed25519 identity keys
    for i in range(2):
        cert = _cert(out / "peers" / f"p{i}" / "cert.pem")
        cert.verify_directly_issued_by(ca)
        assert peer_id_of_cert(cert) == create_or_load(out / "peers" / f"p{i}" / "keys").peer_id


def test_ca_is_never_overwritten_and_a_loose_key_is_refused(tmp_path):
    init_pki(tmp_path, hosts=[])
    with pytest.raises(FileExistsError):
        init_pki(tmp_path, hosts=[])
    os.chmod(tmp_path / "ca.key", 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        CertAuthority.load(tmp_path)


def test_peer_cert_for_an_existing_key_and_revocation(tmp_path):
    from fedswarm.cli import app

    init_pki(tmp_path / "pki", hosts=[])
    device = create_or_load(tmp_path / "device-keys")  # the private key stays on the device
    res = CliRunner().invoke(app, ["certs", "peer", "--out", str(tmp_path / "pki"), "--name", "pi",
                                   "--public-key", str(tmp_path / "device-keys" / "public.txt")])
    assert res.exit_code == 0, res.output
    cert_path = tmp_path / "pki" / "peers" / "pi" / "cert.pem"
    assert peer_id_of_cert(_cert(cert_path)) == device.peer_id
    assert not (tmp_path / "pki" / "peers" / "pi" / "keys").exists()
    other, _ = issue_peer(CertAuthority.load(tmp_path / "pki"), "other")
    res = CliRunner().invoke(app, ["certs", "revoke", "--out", str(tmp_path / "pki"), "--name", "pi",
                                   "--reason", "device lost"])
    assert res.exit_code == 0, res.output
    crl = x509.load_pem_x509_crl((tmp_path / "pki" / "crl.pem").read_bytes())
    ca = _cert(tmp_path / "pki" / "ca.pem")
    assert crl.is_signature_valid(ca.public_key())
    assert crl.get_revoked_certificate_by_serial_number(_cert(cert_path).serial_number) is not None
    assert crl.get_revoked_certificate_by_serial_number(_cert(other).serial_number) is None
    assert revoke(tmp_path / "pki", name="pi")["reason"] == "device lost"  # idempotent
    assert len(x509.load_pem_x509_crl((tmp_path / "pki" / "crl.pem").read_bytes())) == 1
    # a certificate from another CA cannot be revoked here
    init_pki(tmp_path / "foreign", hosts=[], peers=1)
    with pytest.raises(ValueError, match="not issued by this CA"):
        revoke(tmp_path / "pki", cert=tmp_path / "foreign" / "peers" / "p0" / "cert.pem")


def test_a_non_peer_certificate_names_no_peer(tmp_path):
    init_pki(tmp_path, hosts=["localhost"])
    with pytest.raises(ValueError, match="Ed25519"):
        peer_id_of_cert(_cert(tmp_path / "superlink" / "server.pem"))


def test_client_passes_the_auth_key_to_flower_and_refuses_a_loose_one(tmp_path):
    from fedswarm.cli import app

    init_pki(tmp_path, hosts=["localhost"], supernodes=1)
    key = tmp_path / "supernodes" / "sn0.key"
    args = ["client", "--superlink", "localhost:9093", "--root-certificates", str(tmp_path / "ca.pem"),
            "--auth-key", str(key), "--device-class", "cpu", "--dry-run"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    cmd = res.output.split()
    assert cmd[cmd.index("--auth-supernode-private-key") + 1] == str(key)
    assert cmd[cmd.index("--root-certificates") + 1] == str(tmp_path / "ca.pem")
    os.chmod(key, 0o644)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "chmod 600" in res.output
    os.chmod(key, 0o600)
    res = CliRunner().invoke(app, [*args[:-1], "--insecure", "--dry-run"])
    assert res.exit_code == 2 and "--insecure cannot be combined" in res.output
