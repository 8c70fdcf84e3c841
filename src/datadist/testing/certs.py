"""Throwaway certificates for TLS tests: a CA and leaves it signs, made with the ``openssl``
command in a directory the caller owns (a pytest tmp_path). Called by the TLS tests and the
``datadist probe`` tests; blocks for the few hundred milliseconds openssl takes; raises
CalledProcessError if openssl fails (callers skip where ``shutil.which("openssl")`` is None)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from datadist.core.config import TlsConfig


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    """A self-signed CA: ``d/name.pem`` and ``d/name.key``, valid two days."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def make_leaf(d: Path, name: str, ca: str) -> TlsConfig:
    """A certificate ``d/name.pem`` (key ``d/name.key``) signed by the CA ``ca`` made with
    :func:`make_ca` in ``d``; returned as the TlsConfig a link would be given."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", cwd=d)
    return TlsConfig(str(d / f"{name}.pem"), str(d / f"{name}.key"), str(d / f"{ca}.pem"))


__all__ = ["make_ca", "make_leaf"]
