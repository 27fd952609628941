"""A cluster's credentials: a CA, one certificate per role, and an API key.

    llmserve certs --out DIR [--hosts router,scheduler,worker-0]

writes DIR/ca.crt, DIR/{router,scheduler,worker}.{crt,key} and DIR/api-key (and the CA's
key, DIR/ca.key unless --ca-key puts it elsewhere). Run it again and it reuses the CA
(and the API key) and issues fresh role certificates: running services pick them up
without a restart (see llmserve/contract/cert_reload.py). `llmserve up` makes a
throwaway set the same way, in a private temporary directory.

Each role's certificate names its role in its subject CN (`llmserve-router`, ...):
the internal services authorise peers by it (llmserve/contract/peers.py). Keys are EC
P-256: generating a whole set takes milliseconds.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmserve.contract.peers import ROLES, common_name
from llmserve.settings import Command

LOCAL_HOSTS = ("localhost", "127.0.0.1")
CA_NAME = "llmserve cluster CA"


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # Unique, in order.
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


class CertificateAuthority:
    """Signs the role certificates of one cluster."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey):
        self.cert, self.key = cert, key

    @classmethod
    def new(cls, days: int = 3650) -> "CertificateAuthority":
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(_name(CA_NAME)).issuer_name(_name(CA_NAME))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert, key)

    @classmethod
    def load(cls, cert_pem: bytes, key_pem: bytes) -> "CertificateAuthority":
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the CA key is not an EC key")
        return cls(x509.load_pem_x509_certificate(cert_pem), key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)

    def issue(self, cn: str, hosts: list[str], days: int = 825) -> KeyPair:
        """A certificate for `cn`, valid as a TLS server for `hosts` (its SANs) and as a
        client (every service is both: it serves, and it dials the next hop)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_san(hosts), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write(path: Path, data: bytes, mode: int) -> None:
    """Atomically (a temporary file renamed over the old one): a service re-reading its
    certificate never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class ClusterCredentials:
    """Where a cluster's credential files lie (the layout `llmserve certs` writes)."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def cert(self, role: str) -> Path:
        return self.dir / f"{role}.crt"

    def key(self, role: str) -> Path:
        return self.dir / f"{role}.key"

    @property
    def api_key_file(self) -> Path:
        return self.dir / "api-key"

    @property
    def api_key(self) -> str:
        return self.api_key_file.read_text().strip()

    def service_flags(self, role: str) -> list[str]:
        """The TLS flags of the service of this role."""
        return ["--tls-cert", str(self.cert(role)), "--tls-key", str(self.key(role)), "--tls-ca", str(self.ca)]


def write_credentials(out: Path, hosts: list[str] = (), ca_key: Path | None = None,
                      keep_ca_key: bool = True) -> ClusterCredentials:
    """Writes a cluster's credentials into `out` (made 0700 if new). Role certificates
    are valid for localhost, 127.0.0.1 and `hosts`. An existing CA (out/ca.crt with its
    key at `ca_key`, default out/ca.key) and API key are kept; a new CA's key is written
    only if `keep_ca_key` (a throwaway set needs none: nothing will be signed later)."""
    out = Path(out)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    creds = ClusterCredentials(out)
    ca_key = Path(ca_key) if ca_key is not None else out / "ca.key"
    if creds.ca.exists() and ca_key.exists():
        ca = CertificateAuthority.load(creds.ca.read_bytes(), ca_key.read_bytes())
    else:
        ca = CertificateAuthority.new()
        if keep_ca_key:
            ca_key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _write(ca_key, ca.key_pem, 0o600)
        _write(creds.ca, ca.cert_pem, 0o644)
    all_hosts = [*LOCAL_HOSTS, *hosts]
    for role in ROLES:
        pair = ca.issue(common_name(role), all_hosts)
        # The key first: a service that reads in between sees a new key with the old
        # certificate, a mismatch it refuses (keeping the pair it has) until both are new.
        _write(creds.key(role), pair.key_pem, 0o600)
        _write(creds.cert(role), pair.cert_pem, 0o644)
    if not creds.api_key_file.exists():
        _write(creds.api_key_file, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    return creds


# --- `llmserve certs` ----------------------------------------------------------------------


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="directory to write the set into (created 0700)")
    p.add_argument("--hosts", default="", help="comma-separated extra host names / IPs every certificate is valid "
                                              "for, e.g. the compose service names (localhost and 127.0.0.1 always)")
    p.add_argument("--ca-key", type=Path, default=None,
                   help="where the CA's private key is kept (default: OUT/ca.key); keep it away from the services")


def _run(args) -> int:
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    creds = write_credentials(args.out, hosts, ca_key=args.ca_key)
    print(f"CA certificate: {creds.ca}")
    for role in ROLES:
        print(f"{role}: {creds.cert(role)} {creds.key(role)}")
    print(f"API key file: {creds.api_key_file}")
    return 0


COMMAND = Command("certs", "write a CA, per-role certificates and an API key for a deployment", None, _run,
                  _arguments)
