"""Optional TLS for the gRPC server (`--tls-cert` / `--tls-key`); clients pass their roots to
`service.rpc.auth.bearer_credentials`.

The certificate chain and key are PEM files. They are checked when the server starts, with the
standard library's TLS stack, so a wrong path, a non-PEM file or a key that does not belong to
the certificate is a clear startup error instead of every handshake failing later.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc


class TLSConfigError(ValueError):
    """The TLS files cannot be used; the message names the file and the problem."""


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None


def load_key_pair(cert_path: str | Path, key_path: str | Path) -> tuple[bytes, bytes]:
    """(certificate chain PEM, private key PEM), checked to be PEM and to match each other."""
    cert, key = _read(cert_path, "certificate"), _read(key_path, "key")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise TLSConfigError(f"{cert_path} is not a PEM certificate (no 'BEGIN CERTIFICATE' block)")
    if b"PRIVATE KEY-----" not in key:
        raise TLSConfigError(f"{key_path} is not a PEM private key (no 'PRIVATE KEY' block)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as exc:
        raise TLSConfigError(f"{key_path} does not match {cert_path}, or one is damaged: {exc.reason or exc}") from None
    return cert, key


def server_credentials(cert_path: str | Path, key_path: str | Path) -> grpc.ServerCredentials:
    """Server-side TLS credentials (no client certificates asked for)."""
    cert, key = load_key_pair(cert_path, key_path)
    return grpc.ssl_server_credentials([(key, cert)])


def tls_paths(cert: str | None, key: str | None) -> tuple[str, str] | None:
    """Both paths or neither: one alone is a configuration mistake, not "TLS off"."""
    if (cert is None) != (key is None):
        raise TLSConfigError("--tls-cert and --tls-key go together: give both or neither")
    return None if cert is None else (cert, key)
