"""``fedswarm certs``: the keys and certificates of a secure deployment, made with ``cryptography``.

One directory (``--out DIR``) holds a small PKI::

    ca.pem, ca.key              the certificate authority (ECDSA P-384, 5 years)
    superlink/server.pem, .key  the SuperLink's TLS certificate for the given host names and
                                addresses (ECDSA P-384, 1 year; ``--ssl-certfile/--ssl-keyfile``)
    supernodes/NAME.key, .pub   SuperNode authentication key pairs in the form Flower's node
                                authentication reads: an OpenSSH ECDSA P-384 private key and
                                its ``ecdsa-sha2-nistp384 ...`` public key
                                (``flower-supernode --auth-supernode-private-key``, registered
                                on the SuperLink with ``flwr supernode register NAME.pub``)
    peers/NAME/keys/private.pem the swarm peer's Ed25519 identity (``fedswarm keys`` layout)
    peers/NAME/cert.pem         its certificate, issued by the CA *for that Ed25519 key*: the
                                TLS key is the identity key, so the peer id a certificate
                                proves is the one every message is signed with
    crl.pem, revoked.json       revoked peer certificates (an X.509 CRL signed by the CA)

Every private key is written with mode 0600 (the directory 0700) and never printed.
``fedswarm certs revoke`` adds a peer's certificate to the CRL; peers started with
``--tls-crl crl.pem`` refuse it in the TLS handshake.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedswarm.swarm.net.peercert import PEER_URI_PREFIX, peer_id_of_cert

__all__ = [
    "CertAuthority",
    "init_pki",
    "issue_peer",
    "issue_server",
    "make_supernode_keys",
    "revoke",
]

CA_DAYS, SERVER_DAYS, PEER_DAYS = 5 * 365, 365, 365
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"a name must be 1-64 letters, digits, '_', '.', '-' (got {name!r})")
    return name


def write_private(path: Path, data: bytes) -> None:
    """Write a secret with mode 0600 from the first byte (no window where others can read it)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(data)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class CertAuthority:
    """The CA's key and certificate, loaded from (or created in) a PKI directory."""

    dir: Path
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, out: Path, name: str | None = None, days: int = CA_DAYS) -> CertAuthority:
        out = Path(out)
        name = name or f"fedswarm CA {os.urandom(4).hex()}"  # tells two swarms' CAs apart in logs
        if (out / "ca.key").exists():
            raise FileExistsError(f"{out / 'ca.key'} exists: refusing to overwrite a CA (use another --out)")
        key = ec.generate_private_key(ec.SECP384R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(_now() - dt.timedelta(minutes=5))
                .not_valid_after(_now() + dt.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(ski, critical=False)
                .sign(key, hashes.SHA384()))
        write_private(out / "ca.key", _key_pem(key))
        _write_public(out / "ca.pem", _pem(cert))
        ca = cls(out, key, cert)
        ca.write_crl([])
        return ca

    @classmethod
    def load(cls, pki_dir: Path) -> CertAuthority:
        d = Path(pki_dir)
        if not (d / "ca.key").exists():
            raise FileNotFoundError(f"no CA in {d} (make one with `fedswarm certs init --out {d}`)")
        mode = (d / "ca.key").stat().st_mode & 0o777
        if mode & 0o077:
            raise PermissionError(f"{d / 'ca.key'} is readable by others (mode {mode:o}); chmod 600 it")
        key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{d / 'ca.key'} is not an EC private key")
        return cls(d, key, x509.load_pem_x509_certificate((d / "ca.pem").read_bytes()))

    def _leaf(self, subject: str, public_key, days: int, san: list[x509.GeneralName], usage) -> x509.Certificate:
        ca_ski = self.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(self.cert.subject).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(_now() - dt.timedelta(minutes=5))
                .not_valid_after(min(_now() + dt.timedelta(days=days), self.cert.not_valid_after_utc))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(san), critical=False)
                .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
                .sign(self.key, hashes.SHA384()))

    # -- revocation ----------------------------------------------------------------------
    def revoked(self) -> list[dict]:
        path = self.dir / "revoked.json"
        return json.loads(path.read_text()) if path.exists() else []

    def write_crl(self, entries: list[dict], days: int = 30) -> Path:
        """(Re)write ``revoked.json`` and ``crl.pem`` (valid ``days``; re-run revoke to renew)."""
        b = (x509.CertificateRevocationListBuilder().issuer_name(self.cert.subject)
             .last_update(_now() - dt.timedelta(minutes=5)).next_update(_now() + dt.timedelta(days=days)))
        for e in entries:
            b = b.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(int(e["serial"]))
                .revocation_date(dt.datetime.fromisoformat(e["revoked_at"])).build())
        crl = b.sign(self.key, hashes.SHA384())
        _write_public(self.dir / "revoked.json", json.dumps(entries, indent=1).encode())
        _write_public(self.dir / "crl.pem", crl.public_bytes(serialization.Encoding.PEM))
        return self.dir / "crl.pem"


def _san(hosts: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def issue_server(ca: CertAuthority, hosts: list[str], days: int = SERVER_DAYS) -> tuple[Path, Path]:
    """The SuperLink's certificate for ``hosts`` (names and IP addresses) and its key."""
    if not hosts:
        raise ValueError("a server certificate needs at least one --host (name or IP address)")
    key = ec.generate_private_key(ec.SECP384R1())
    cert = ca._leaf(hosts[0], key.public_key(), days, _san(hosts), [ExtendedKeyUsageOID.SERVER_AUTH])
    d = ca.dir / "superlink"
    write_private(d / "server.key", _key_pem(key))
    _write_public(d / "server.pem", _pem(cert))
    return d / "server.pem", d / "server.key"


def make_supernode_keys(out: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode authentication key pair as Flower reads it (OpenSSH ECDSA P-384)."""
    _check_name(name)
    key = ec.generate_private_key(ec.SECP384R1())
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    d = Path(out) / "supernodes"
    write_private(d / f"{name}.key", priv)
    _write_public(d / f"{name}.pub", pub + f" {name}\n".encode())
    return d / f"{name}.key", d / f"{name}.pub"


def issue_peer(ca: CertAuthority, name: str, peer_id: str | None = None, days: int = PEER_DAYS,
               hosts: list[str] | None = None) -> tuple[Path, str]:
    """A swarm peer's certificate for its Ed25519 identity key.

    With ``peer_id`` (a public key from ``fedswarm keys``), the certificate is issued for
    that key and the private key never leaves its device; without, a new identity is made
    in ``peers/NAME/keys``. Returns the certificate's path and the peer id."""
    from fedswarm.swarm.net.identity import create_or_load, parse_public_key

    _check_name(name)
    d = ca.dir / "peers" / name
    if peer_id is None:
        peer_id = create_or_load(d / "keys").peer_id
    raw = parse_public_key(peer_id)
    san = [x509.UniformResourceIdentifier(PEER_URI_PREFIX + raw.hex()), *_san(hosts or [])]
    cert = ca._leaf(f"fedswarm peer {name}", Ed25519PublicKey.from_public_bytes(raw), days, san,
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    _write_public(d / "cert.pem", _pem(cert))
    return d / "cert.pem", raw.hex()


def revoke(pki_dir: Path, *, cert: Path | None = None, name: str | None = None, reason: str = "") -> dict:
    """Add a peer certificate (a file, or ``peers/NAME/cert.pem``) to the CA's CRL."""
    ca = CertAuthority.load(pki_dir)
    if (cert is None) == (name is None):
        raise ValueError("revoke takes exactly one of --cert FILE or --name PEER")
    path = Path(cert) if cert is not None else ca.dir / "peers" / _check_name(name) / "cert.pem"
    c = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        c.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError(f"{path} was not issued by this CA ({c.issuer.rfc4514_string()})") from None
    entries = ca.revoked()
    if any(int(e["serial"]) == c.serial_number for e in entries):
        return next(e for e in entries if int(e["serial"]) == c.serial_number)
    try:
        pid = peer_id_of_cert(c)
    except ValueError:
        pid = None
    entry = {"serial": str(c.serial_number), "peer_id": pid, "subject": c.subject.rfc4514_string(),
             "revoked_at": _now().replace(microsecond=0).isoformat(), "reason": reason}
    ca.write_crl([*entries, entry])
    return entry


def init_pki(out: Path, *, hosts: list[str], supernodes: int = 0, peers: int = 0) -> dict:
    """A CA, the SuperLink certificate, ``supernodes`` SuperNode key pairs and ``peers``
    swarm peer identities with certificates, in ``out``. Returns the paths made."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca = CertAuthority.create(out)
    made: dict = {"ca": str(out / "ca.pem"), "crl": str(out / "crl.pem")}
    if hosts:
        made["server_cert"], made["server_key"] = map(str, issue_server(ca, hosts))
    made["supernodes"] = [str(p) for i in range(supernodes) for p in make_supernode_keys(out, f"sn{i}")[1:]]
    made["peers"] = [str(issue_peer(ca, f"p{i}")[0]) for i in range(peers)]
    return made


# -- the command line (mounted as ``fedswarm certs``) --------------------------------------
def _cli():
    import typer

    app = typer.Typer(help="Make the CA, TLS certificates and node keys of a secure deployment; revoke peers. "
                           "Private keys are written 0600 and never printed.", no_args_is_help=True)
    out_opt = typer.Option(..., "--out", help="The PKI directory (holds ca.pem, ca.key, crl.pem, ...).")

    @app.command("init")
    def init_cmd(out: Path = out_opt,
                 host: list[str] = typer.Option([], "--host", help="SuperLink host name or IP (repeat)."),
                 supernodes: int = typer.Option(0, "--supernodes", min=0, help="SuperNode auth key pairs to make."),
                 peers: int = typer.Option(0, "--peers", min=0, help="Swarm peer identities + certificates to make.")):
        """A new CA in OUT, with a SuperLink certificate (if --host), SuperNode key pairs sn0.. and peers p0..

        Example: fedswarm certs init --out pki --host localhost --host 127.0.0.1 --supernodes 2 --peers 4
        """
        made = init_pki(out, hosts=host, supernodes=supernodes, peers=peers)
        typer.echo(f"CA: {made['ca']}  (key {out / 'ca.key'}, 0600; CRL {made['crl']})")
        if host:
            typer.echo(f"SuperLink certificate for {', '.join(host)}: {made['server_cert']} (key 0600)")
        for p in made["supernodes"]:
            typer.echo(f"SuperNode public key (register with `flwr supernode register`): {p}")
        for p in made["peers"]:
            typer.echo(f"swarm peer certificate: {p}")

    @app.command("server")
    def server_cmd(out: Path = out_opt, host: list[str] = typer.Option(..., "--host", help="Name or IP (repeat).")):
        """Issue (or reissue) the SuperLink certificate for the given host names and addresses."""
        cert, _ = issue_server(CertAuthority.load(out), host)
        typer.echo(f"SuperLink certificate: {cert}")

    @app.command("supernode")
    def supernode_cmd(out: Path = out_opt, name: str = typer.Option(..., "--name", help="Key file name.")):
        """A SuperNode authentication key pair (OpenSSH ECDSA P-384, as Flower reads it)."""
        _, pub = make_supernode_keys(out, name)
        typer.echo(f"SuperNode public key: {pub}  (register: flwr supernode register {pub} FEDERATION)")

    @app.command("peer")
    def peer_cmd(out: Path = out_opt, name: str = typer.Option(..., "--name", help="The peer's name in the PKI."),
                 public_key: str | None = typer.Option(
                     None, "--public-key", help="The peer's key (hex, or a public.txt file from `fedswarm keys`); "
                                                "default: make a new identity in OUT/peers/NAME/keys."),
                 host: list[str] = typer.Option([], "--host", help="Optional names/IPs of the peer (repeat).")):
        """Issue a swarm peer certificate, bound to the peer's Ed25519 identity key."""
        if public_key and Path(public_key).is_file():
            public_key = Path(public_key).read_text().split()[0]
        cert, pid = issue_peer(CertAuthority.load(out), name, public_key, hosts=host)
        typer.echo(f"peer {name} ({pid[:16]}…): {cert}")

    @app.command("revoke")
    def revoke_cmd(out: Path = out_opt, name: str | None = typer.Option(None, "--name", help="Peer name."),
                   cert: Path | None = typer.Option(None, "--cert", help="A peer certificate file."),
                   reason: str = typer.Option("", "--reason", help="Why (kept in revoked.json).")):
        """Revoke a swarm peer's certificate: it is added to OUT/crl.pem, which peers load with --tls-crl."""
        try:
            entry = revoke(out, cert=cert, name=name, reason=reason)
        except (ValueError, FileNotFoundError) as exc:
            raise typer.BadParameter(str(exc)) from None
        typer.echo(f"revoked serial {entry['serial']} ({entry['subject']}); CRL: {out / 'crl.pem'}")

    return app


def certs_app():
    """The ``fedswarm certs`` Typer app."""
    return _cli()
