"""How a client reaches fastpersistd: its address, and the gRPC channel to it.

    unix:///PATH (or gRPC's unix:PATH)   the node's daemon, through its socket
    https://HOST:PORT                    TCP with TLS: the daemon's CA from
                                         FASTPERSIST_DAEMON_CA_FILE (default: the
                                         system's), the bearer token from
                                         FASTPERSIST_DAEMON_TOKEN_FILE, and for a
                                         daemon that asks for client certificates
                                         (--tls-client-ca) this client's from
                                         FASTPERSIST_DAEMON_CERT_FILE and _KEY_FILE

Torch-free (fpctl daemon status uses it).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from .. import knobs
from ..errors import DaemonError

MAX_MESSAGE_BYTES = 64 << 20  # the daemon's (daemon/transport.py)


def grpc_target(address: str) -> tuple[str, bool]:
    """(gRPC target, whether it is TCP with TLS) for a daemon address."""
    if address.startswith("unix://"):
        return "unix:" + address.removeprefix("unix://"), False
    if address.startswith("unix:"):
        return address, False
    if address.startswith("https://"):
        return address.removeprefix("https://").rstrip("/"), True
    raise DaemonError(
        f"daemon address {address!r} is not unix:///PATH or https://HOST:PORT", "INVALID_ARGUMENT"
    )


def open_channel(address: str) -> grpc.Channel:
    """A channel to the daemon at `address` (DaemonError for one it cannot use)."""
    target, tls = grpc_target(address)
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    if tls:
        return grpc.secure_channel(target, _tls_credentials(), options)
    return grpc.insecure_channel(target, options)


def _tls_credentials() -> grpc.ChannelCredentials:
    files = knobs.daemon_tls()
    if not files.token_file:
        raise DaemonError("a TCP daemon address needs FASTPERSIST_DAEMON_TOKEN_FILE",
                          "UNAUTHENTICATED")
    if bool(files.cert_file) != bool(files.key_file):
        raise DaemonError("a client certificate needs both FASTPERSIST_DAEMON_CERT_FILE and "
                          "FASTPERSIST_DAEMON_KEY_FILE", "UNAUTHENTICATED")

    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials(read(files.ca_file), private_key=read(files.key_file),
                                     certificate_chain=read(files.cert_file)),
        grpc.access_token_call_credentials(Path(files.token_file).read_text().strip()),
    )
