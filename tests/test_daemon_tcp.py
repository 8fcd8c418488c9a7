"""fastpersistd against peers it does not trust: refused before it reads their requests.

- A TCP call without the bearer token is refused before its body is received
  or parsed: the daemon's memory does not grow with what such peers send.
- Every method parses only requests of the size its fields need.
- A connection holds at most 64 calls (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS;
  the calls of a peer that ignores it are refused).
- With --tls-client-ca, a peer without a certificate signed by that CA is
  refused at the TLS handshake, before it can send an HTTP/2 frame.

Real daemon processes (tests/daemon_support.py), certificates from openssl
(tests/tls_support.py); the HTTP/2 settings are read off the wire.
"""

from __future__ import annotations

import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import tls_support
from daemon_raw import assert_serving, close_remote_savers, file_header, peak_rss
from daemon_support import Daemon
from grpc import StatusCode as Code
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc
from fastpersist.errors import DaemonUnavailableError
from fastpersist.protocol.client import DaemonClient

MIB = 1 << 20
SERVICE = "/fastpersist.v1.FastPersist/"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, MAX_CONCURRENT_STREAMS = 0x4, 0x3


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)


class TCP:
    """A daemon serving TCP too (TLS and a token); `port` and the files."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.files = tls_support.server_files(tmp_path)
        self.port = tls_support.free_port()
        self.daemon = Daemon(tmp_path / "d", "--listen", f"127.0.0.1:{self.port}",
                             "--tls-cert", str(self.files["cert"]),
                             "--tls-key", str(self.files["key"]),
                             "--token-file", str(self.files["token"]), *extra)

    def start(self) -> TCP:
        self.daemon.start()
        # The TCP server starts just after the Unix one.
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def channel(self, token: str | None) -> grpc.Channel:
        """A connection of its own (not shared with this process's other channels)."""
        creds = grpc.ssl_channel_credentials(self.files["cert"].read_bytes())
        if token is not None:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token))
        return grpc.secure_channel(f"127.0.0.1:{self.port}", creds,
                                   [("grpc.use_local_subchannel_pool", 1),
                                    ("grpc.max_send_message_length", -1)])


@pytest.fixture
def tcp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TCP]:
    t = TCP(tmp_path)
    try:
        t.start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(t.daemon.shm_dir))
        yield t
    finally:
        close_remote_savers()
        t.daemon.cleanup()


@pytest.mark.slow
def test_unauthenticated_calls_are_refused_before_their_body_is_read(tcp: TCP) -> None:
    """Five peers without the token (or with a wrong one) send 60 MiB each.
    gRPC received and parsed each whole message before the token was looked
    at (three such calls took the daemon from 47 to 341 MiB); now it reads
    none of it, so its peak memory grows by far less than one message."""
    assert tcp.daemon.proc is not None
    pid = tcp.daemon.proc.pid
    big = "x" * (60 * MIB)
    chunk = pb.StreamChunk(data=bytes(4 * MIB))
    calls: list[tuple[str | None, str]] = [(None, "Commit"), ("wrong", "Commit"),
                                           (None, "Begin"), ("wrong", "SubmitShm"),
                                           (None, "SubmitStream")]
    codes: list[Any] = []

    def call(token: str | None, method: str) -> None:
        with tcp.channel(token) as channel:
            stub = pb_grpc.FastPersistStub(channel)
            requests = {
                "Commit": lambda: stub.Commit(pb.CommitRequest(checkpoint_id="x",
                                                               tree_json=big), timeout=60),
                "Begin": lambda: stub.Begin(pb.BeginRequest(path=big), timeout=60),
                "SubmitShm": lambda: stub.SubmitShm(pb.SubmitShmRequest(
                    checkpoint_id="x", file=pb.DataFile(header=big.encode())), timeout=60),
                "SubmitStream": lambda: stub.SubmitStream(iter([chunk] * 15), timeout=60),
            }
            try:
                requests[method]()
                codes.append((method, Code.OK))
            except grpc.RpcError as exc:
                codes.append((method, exc.code()))

    before = peak_rss(pid)
    threads = [threading.Thread(target=call, args=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grown = peak_rss(pid) - before
    assert sorted(codes) == sorted((m, Code.UNAUTHENTICATED) for _, m in calls), codes
    assert grown < 60 * MIB, (
        f"the daemon's peak RSS grew by {grown / MIB:.0f} MiB while it refused "
        f"{len(calls)} unauthenticated calls of 60 MiB")
    # The token still lets a client in, over the same port.
    with tcp.channel(tcp.files["token"].read_text().strip()) as channel:
        assert pb_grpc.FastPersistStub(channel).Info(pb.InfoRequest(), timeout=10).version
    assert_serving(tcp.daemon)


def _field(number: int, data: bytes) -> bytes:
    """A protobuf length-delimited field (unknown to every request type here)."""
    def varint(v: int) -> bytes:
        out = b""
        while True:
            out += bytes([(v & 0x7F) | (0x80 if v > 0x7F else 0)])
            v >>= 7
            if not v:
                return out
    return varint(number << 3 | 2) + varint(len(data)) + data


def test_each_method_parses_only_requests_of_the_size_it_needs(daemon: Daemon) -> None:
    """gRPC knows one message limit (on the Unix socket the largest a client
    needs, a stream's 4 MiB chunk); every other method is refused
    (RESOURCE_EXHAUSTED, naming its limit) above the size its fields need,
    before the request is parsed. Commit and CommitJob take a few MiB: more is
    streamed. SubmitShm takes a header of 1 MiB: a larger one comes in shared
    memory."""
    header, n = file_header([("w", 4)])
    channel = grpc.insecure_channel(f"unix:{daemon.socket}",
                                    [("grpc.max_send_message_length", -1)])
    try:
        def raw(method: str, payload: bytes, stream: bool = False) -> tuple[Code, str]:
            try:
                if stream:
                    call = channel.unary_stream(SERVICE + method)(payload, timeout=10)
                    next(call)
                else:
                    channel.unary_unary(SERVICE + method)(payload, timeout=10)
                return Code.OK, ""
            except grpc.RpcError as exc:
                return exc.code(), exc.details() or ""

        junk = _field(1000, bytes(MIB))
        begun = pb_grpc.FastPersistStub(channel).Begin(pb.BeginRequest(
            path="streamed", client_id="t", staging_bytes=1 << 20, file_count=1), timeout=10)
        head = pb.StreamHeader(checkpoint_id=begun.checkpoint_id,
                               file=pb.DataFile(index=0, header=header), data_length=n)
        cases = {
            "Info": raw("Info", junk),
            "Begin": raw("Begin", pb.BeginRequest(path="a/" * (MIB // 2)).SerializeToString()),
            "Watch": raw("Watch", junk, stream=True),
            "Abort": raw("Abort", junk),
            "health": _health_check(channel, junk),
            "SubmitShm": raw("SubmitShm", pb.SubmitShmRequest(
                checkpoint_id="x", file=pb.DataFile(header=bytes(2 * MIB))).SerializeToString()),
            "SubmitShm 40 MiB": raw("SubmitShm", pb.SubmitShmRequest(
                checkpoint_id="x", file=pb.DataFile(header=bytes(40 * MIB))).SerializeToString()),
        }
        stream = channel.stream_unary(SERVICE + "SubmitStream")
        for name, chunks in {
                "SubmitStream header": [pb.StreamChunk(header=pb.StreamHeader(
                    checkpoint_id="x", file=pb.DataFile(header=bytes(40 * MIB))))],
                "SubmitStream data": [pb.StreamChunk(header=head),
                                      pb.StreamChunk(data=bytes(40 * MIB))]}.items():
            try:
                stream(iter([c.SerializeToString() for c in chunks]), timeout=30)
                cases[name] = (Code.OK, "")
            except grpc.RpcError as exc:
                cases[name] = (exc.code(), exc.details() or "")
        cases["Commit"] = raw("Commit", pb.CommitRequest(
            checkpoint_id="nope", tree_json="x" * (5 * MIB)).SerializeToString())
        cases["CommitJob"] = raw("CommitJob", pb.CommitJobRequest(
            job_id="nope", manifest=bytes(5 * MIB)).SerializeToString())
        # (A stream's chunk is the largest a client needs: gRPC's own limit on
        # the Unix socket, which it checks from the length prefix.)
        largest = 4 * MIB + 64 * 1024
        limits = {"SubmitShm": MIB + 64 * 1024, "SubmitShm 40 MiB": largest,
                  "SubmitStream header": largest, "SubmitStream data": largest,
                  "Commit": largest, "CommitJob": largest}
        wrong = {name: f"{code.name}: {details[:200]}" for name, (code, details) in cases.items()
                 if code != Code.RESOURCE_EXHAUSTED
                 or (f"limited to {limits.get(name, 64 * 1024)} bytes" not in details
                     and f"vs. {limits.get(name)})" not in details)}
        assert wrong == {}
        # A Commit of a few MiB is parsed (and its tree refused); larger ones are streamed.
        fits = pb.CommitRequest(checkpoint_id="nope", tree_json="x" * (4 * MIB))
        code, details = raw("Commit", fits.SerializeToString())
        assert code == Code.INVALID_ARGUMENT and "limited to" not in details, details
    finally:
        channel.close()
    assert_serving(daemon)


def _health_check(channel: grpc.Channel, payload: bytes) -> tuple[Code, str]:
    try:
        channel.unary_unary("/grpc.health.v1.Health/Check")(payload, timeout=10)
        return Code.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def _settings(sock: socket.socket) -> dict[int, int]:
    """Send the HTTP/2 preface; the server's first SETTINGS frame, as {id: value}."""
    sock.sendall(PREFACE + struct.pack(">I", 0)[1:] + bytes([SETTINGS, 0]) + bytes(4))
    data = b""
    while True:
        while len(data) < 9:
            more = sock.recv(65536)
            if not more:
                raise ConnectionError(f"the server closed the connection ({len(data)} bytes)")
            data += more
        length = int.from_bytes(data[:3], "big")
        kind, flags = data[3], data[4]
        while len(data) < 9 + length:
            data += sock.recv(65536)
        payload, data = data[9:9 + length], data[9 + length:]
        if kind == SETTINGS and not flags & 1:  # not an ACK
            return {int.from_bytes(payload[i:i + 2], "big"):
                    int.from_bytes(payload[i + 2:i + 6], "big")
                    for i in range(0, len(payload), 6)}


def _tls_settings(t: TCP, cert: tuple[Path, Path] | None = None) -> dict[int, int]:
    ctx = ssl.create_default_context(cafile=str(t.files["cert"]))
    ctx.set_alpn_protocols(["h2"])
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    with socket.create_connection(("127.0.0.1", t.port), timeout=10) as plain, \
            ctx.wrap_socket(plain, server_hostname="localhost") as sock:
        return _settings(sock)


def test_a_connection_holds_at_most_64_calls(tcp: TCP) -> None:
    """maximum_concurrent_rpcs (128) is the daemon's; each connection, on
    either socket, may hold 64 of them at once (the HTTP/2 setting every
    server announces first; gRPC refuses a stream over it)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(tcp.daemon.socket))
        unix = _settings(sock)
    assert unix.get(MAX_CONCURRENT_STREAMS) == 64, unix
    over_tcp = _tls_settings(tcp)
    assert over_tcp.get(MAX_CONCURRENT_STREAMS) == 64, over_tcp


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + struct.pack(">I", stream) \
        + payload


def _call_headers(method: str) -> bytes:
    """HPACK for a gRPC call's HEADERS: :method POST, :scheme http (static
    table), :path and :authority (indexed names), content-type and te (literal)."""
    def literal(name: bytes, value: bytes) -> bytes:
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value
    path = (SERVICE + method).encode()
    return (b"\x83\x86" + b"\x04" + bytes([len(path)]) + path + b"\x01\x09localhost"
            + literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers"))


def test_a_peer_that_ignores_the_limit_has_its_extra_calls_refused(daemon: Daemon) -> None:
    """A peer that opens 70 calls on one connection regardless of the
    announced 64 (a Wait each, its request never sent, so each stays open):
    gRPC refuses the 65th to 70th (RST_STREAM, REFUSED_STREAM); the daemon
    serves on. Before, all 70 stood (maximum_concurrent_rpcs is 128)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(daemon.socket))
        _settings(sock)
        sock.sendall(_frame(SETTINGS, 1, 0))  # acknowledged: the limit now holds
        for i in range(70):
            sock.sendall(_frame(0x1, 0x4, 1 + 2 * i, _call_headers("Wait")))  # END_HEADERS
        refused: list[tuple[int, int]] = []
        data = b""
        deadline = time.monotonic() + 60
        while len(refused) < 6 and time.monotonic() < deadline:
            try:
                more = sock.recv(65536)
            except TimeoutError:  # nothing more within 30 s: none refused (the assert says)
                break
            if not more:
                break
            data += more
            while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
                length = int.from_bytes(data[:3], "big")
                if data[3] == 0x3:  # RST_STREAM: (stream, error code)
                    refused.append((int.from_bytes(data[5:9], "big") & 0x7FFFFFFF,
                                    int.from_bytes(data[9:13], "big")))
                data = data[9 + length:]
    assert refused == [(1 + 2 * i, 0x7) for i in range(64, 70)], refused
    assert_serving(daemon)


def test_client_certificates_are_checked_at_the_handshake(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--tls-client-ca: a peer with no certificate, or one the CA did not
    sign, is refused by TLS before any HTTP/2 frame; a client with its
    certificate (FASTPERSIST_DAEMON_CERT_FILE/_KEY_FILE) and the token gets in."""
    ca = tls_support.authority(tmp_path, "client-ca")
    other_ca = tls_support.authority(tmp_path, "other-ca")
    good = tls_support.client(tmp_path, ca, "trainer")
    stranger = tls_support.client(tmp_path, other_ca, "stranger")
    t = TCP(tmp_path, "--tls-client-ca", str(ca[0]))
    try:
        t.start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(t.daemon.shm_dir))
        assert _tls_settings(t, good).get(MAX_CONCURRENT_STREAMS) == 64
        for who, cert in (("no certificate", None), ("another CA's", stranger)):
            with pytest.raises((ssl.SSLError, ConnectionError)) as refused:
                _tls_settings(t, cert)
            assert "HTTP/2" not in str(refused.value), who

        monkeypatch.setenv("FASTPERSIST_DAEMON_CA_FILE", str(t.files["cert"]))
        monkeypatch.setenv("FASTPERSIST_DAEMON_TOKEN_FILE", str(t.files["token"]))
        for cert in (None, stranger):
            if cert is not None:
                monkeypatch.setenv("FASTPERSIST_DAEMON_CERT_FILE", str(cert[0]))
                monkeypatch.setenv("FASTPERSIST_DAEMON_KEY_FILE", str(cert[1]))
            client = DaemonClient(t.address)
            try:
                with pytest.raises(DaemonUnavailableError):
                    client.info()
            finally:
                client.close()
        monkeypatch.setenv("FASTPERSIST_DAEMON_CERT_FILE", str(good[0]))
        monkeypatch.setenv("FASTPERSIST_DAEMON_KEY_FILE", str(good[1]))
        client = DaemonClient(t.address)
        try:
            assert client.info().version
            assert client.list("").entries is not None
        finally:
            client.close()
        assert t.daemon.events("ready")[0]["client_certificates"] is True
    finally:
        close_remote_savers()
        t.daemon.cleanup()


def test_client_ca_needs_tcp(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "ca.pem").write_text("x")
    r = subprocess.run([sys.executable, "-m", "fastpersist.daemon", "--root",
                        str(tmp_path / "root"), "--socket", str(tmp_path / "s.sock"),
                        "--shm-dir", str(tmp_path), "--tls-client-ca", str(tmp_path / "ca.pem")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tls-client-ca is for TCP clients: it needs --listen" in \
        r.stderr, r.stderr


def test_a_second_daemon_on_a_port_in_use_is_refused(tcp: TCP, tmp_path: Path) -> None:
    # gRPC servers bind with SO_REUSEPORT by default: a second daemon on the
    # same --listen started, and the kernel split peers' connections between
    # the two (a leftover daemon answered a docs example with its own
    # certificate). It must fail to start instead, saying why.
    (tmp_path / "root2").mkdir()
    r = subprocess.run([sys.executable, "-m", "fastpersist.daemon", "--root",
                        str(tmp_path / "root2"), "--socket", str(tmp_path / "s2.sock"),
                        "--shm-dir", str(tmp_path), "--listen", f"127.0.0.1:{tcp.port}",
                        "--tls-cert", str(tcp.files["cert"]), "--tls-key", str(tcp.files["key"]),
                        "--token-file", str(tcp.files["token"])],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-800:])
    assert f"--listen 127.0.0.1:{tcp.port}: cannot listen there" in r.stderr, r.stderr[-800:]
    # The first daemon still answers.
    with tcp.channel(tcp.files["token"].read_text().strip()) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
