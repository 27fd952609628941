"""TLS settings every service shares, and the gRPC credentials made from them.

Every hop is TLS by default: each service serves with `--tls-cert`/`--tls-key`, and
dials the next hop presenting the same pair and verifying the server against
`--tls-ca` (mutual TLS). The scheduler and the worker also require a client
certificate from that CA; the router's public port does not (public clients prove
themselves with an API key, see api_keys.py). `--insecure` turns all of it off, for
debugging only, and every service logs a WARNING saying so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from llmserve.contract.cert_reload import CertificateFiles
from llmserve.settings import setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecurityOptions:
    tls_cert: Path | None = setting(None, help="this service's TLS certificate (PEM); a rotated file is served to "
                                               "new connections without a restart", unset="none")
    tls_key: Path | None = setting(None, help="the certificate's private key (PEM)", unset="none")
    tls_ca: Path | None = setting(None, help="the cluster's CA certificate (PEM): services verify each other "
                                             "against it (mutual TLS between services)", unset="none")
    insecure: bool = setting(False, help="no TLS, no client certificates, no API key: anyone who reaches the "
                                         "port may call (debugging only)")

    def problem(self) -> str | None:
        """Why these settings cannot serve securely (None if they can, or if --insecure)."""
        if self.insecure:
            return None
        files = {"tls-cert": self.tls_cert, "tls-key": self.tls_key, "tls-ca": self.tls_ca}
        missing = [f"--{name}" for name, path in files.items() if path is None]
        if missing:
            return (f"TLS is on by default and needs {', '.join(missing)} (LLMSERVE_TLS_*; a set for a deployment:"
                    f" `llmserve certs --out DIR`), or --insecure to run without TLS (debugging only)")
        for name, path in files.items():
            if not Path(path).is_file():
                return f"--{name} {path}: no such file"
        return None

    def warn_if_insecure(self, what: str) -> None:
        if self.insecure:
            ignored = [str(p) for p in (self.tls_cert, self.tls_key, self.tls_ca) if p is not None]
            logger.warning("--insecure: %s runs WITHOUT TLS and without authentication: anyone who can reach its "
                           "port can call it. For debugging only.%s", what,
                           f" (TLS files ignored: {', '.join(ignored)})" if ignored else "")


def server_credentials(options: SecurityOptions, client_auth: bool) -> tuple[grpc.ServerCredentials,
                                                                               CertificateFiles]:
    """Credentials that re-read the certificate files when they change. `client_auth`:
    clients must present a certificate signed by --tls-ca."""
    files = CertificateFiles(options.tls_cert, options.tls_key, options.tls_ca if client_auth else None)
    creds = grpc.dynamic_ssl_server_credentials(files.load(), files.fetch,
                                                require_client_authentication=client_auth)
    return creds, files


def read_pem(source: str | Path | bytes | None) -> bytes | None:
    """PEM bytes from a path, or the bytes themselves."""
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


def channel_credentials(ca: str | Path | bytes | None, cert: str | Path | bytes | None = None,
                        key: str | Path | bytes | None = None, api_key: str | None = None) -> grpc.ChannelCredentials:
    """TLS to a server verified against `ca` (None: the system's roots), presenting
    `cert`/`key` if given, and `authorization: Bearer <api_key>` on every call if given."""
    creds = grpc.ssl_channel_credentials(root_certificates=read_pem(ca), private_key=read_pem(key),
                                         certificate_chain=read_pem(cert))
    if api_key:
        # gRPC's own call credentials: the metadata an ApiKeyInterceptor reads.
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(api_key))
    return creds


def internal_credentials(options: SecurityOptions) -> grpc.ChannelCredentials:
    """What a service presents to the next hop: its own certificate, verifying the peer
    against the cluster's CA. Read when a channel is made (a rotated client certificate
    is used by the next channel)."""
    return channel_credentials(options.tls_ca, options.tls_cert, options.tls_key)
