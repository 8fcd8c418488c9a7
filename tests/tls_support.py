"""Certificates for the daemon's TCP tests, made with the openssl command.

    server_files(dir)       the daemon's self-signed certificate (localhost and
                            127.0.0.1), its key, and a bearer token
    authority(dir, name)    a CA's certificate and key
    client(dir, ca, name)   a client certificate and key signed by that CA

P-256 keys: quick to make. Tests skip where openssl is not installed.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def server_files(directory: Path) -> dict[str, Path]:
    """{"cert", "key", "token"}: what --tls-cert, --tls-key and --token-file take."""
    cert, key, token = directory / "server.pem", directory / "server.key", directory / "token"
    _openssl("req", "-x509", *_KEY, "-keyout", str(key), "-out", str(cert), "-days", "1",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1")
    token.write_text(secrets.token_hex(16) + "\n")
    return {"cert": cert, "key": key, "token": token}


def authority(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl("req", "-x509", *_KEY, "-keyout", str(key), "-out", str(cert), "-days", "1",
             "-subj", f"/CN={name}")
    return cert, key


def client(directory: Path, ca: tuple[Path, Path], name: str) -> tuple[Path, Path]:
    cert, key, csr = (directory / f"{name}.pem", directory / f"{name}.key",
                      directory / f"{name}.csr")
    _openssl("req", "-new", *_KEY, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext = directory / f"{name}.ext"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
                   "extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext))
    return cert, key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
