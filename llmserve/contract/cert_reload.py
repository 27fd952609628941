"""A server certificate that follows its files: rotate the files, and new connections get
the new certificate without a restart.

gRPC asks `CertificateFiles.fetch` before every TLS handshake
(`grpc.dynamic_ssl_server_credentials`); it costs three `stat`s unless a file changed.
A changed set is loaded only if it is whole (the key matches the certificate, the CA
parses): a rotation caught half-way keeps the last good set until the other file lands.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

logger = logging.getLogger(__name__)

_Stamp = tuple[tuple[int, int, int], ...]


def _public_der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def check_pair(cert_pem: bytes, key_pem: bytes) -> x509.Certificate:
    """The certificate, if `key_pem` is its private key; ValueError otherwise."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    if _public_der(cert.public_key()) != _public_der(key.public_key()):
        raise ValueError("the private key does not belong to the certificate")
    return cert


class CertificateFiles:
    """A server's certificate, key and (for client authentication) CA, as files."""

    def __init__(self, cert: Path, key: Path, ca: Path | None = None):
        self.paths = tuple(Path(p) for p in (cert, key, ca) if p is not None)
        self.cert, self.key, self.ca = Path(cert), Path(key), Path(ca) if ca is not None else None
        self._lock = threading.Lock()  # gRPC may fetch from several threads at once.
        self._loaded: _Stamp | None = None
        self._refused: _Stamp | None = None
        self.serial: int | None = None  # The serial number of the certificate being served.

    def _stamp(self) -> _Stamp:
        # A rename (atomic rotation) changes the inode; an in-place rewrite the mtime or size.
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, self.paths))

    def load(self) -> grpc.ServerCertificateConfiguration:
        """The current files as a certificate configuration; raises (OSError, ValueError)
        if they are missing, unreadable or do not belong together."""
        with self._lock:
            stamp = self._stamp()
            config, serial = self._read()
            self._loaded, self.serial = stamp, serial
            return config

    def _read(self) -> tuple[grpc.ServerCertificateConfiguration, int]:
        cert_pem, key_pem = self.cert.read_bytes(), self.key.read_bytes()
        cert = check_pair(cert_pem, key_pem)
        ca_pem = None
        if self.ca is not None:
            ca_pem = self.ca.read_bytes()
            x509.load_pem_x509_certificates(ca_pem)  # Parses, or ValueError.
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=ca_pem), \
            cert.serial_number

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files changed, else None (keep
        serving the current one). Never raises: it runs inside gRPC's handshake."""
        with self._lock:
            try:
                stamp = self._stamp()
            except OSError:  # A file missing mid-rotation: keep the current set.
                return None
            if stamp in (self._loaded, self._refused):
                return None
            try:
                config, serial = self._read()
            except Exception as err:  # noqa: BLE001 - unreadable, unparsable or mismatched files
                self._refused = stamp  # Logged once per change, not once per connection.
                logger.warning("TLS files %s changed but cannot be used (%s); still serving certificate "
                               "serial %x", ", ".join(map(str, self.paths)), err, self.serial or 0)
                return None
            self._loaded, self.serial = stamp, serial
        logger.info("TLS certificate %s reloaded: serial %x", self.cert, serial)
        return config
