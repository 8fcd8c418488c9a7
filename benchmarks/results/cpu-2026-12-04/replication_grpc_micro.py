"""gRPC Python client-stream throughput with no other work (issue 35: what caps replication).

    PYTHONPATH=. python benchmarks/results/cpu-2026-12-04/replication_grpc_micro.py GIB SPEC...

A server process (this script, "server") takes a stream of messages and counts their
bytes. SPEC: tcp (a plain loopback socket, 4 MiB sendall, the receiver a thread) or
KIND:TLS:MIB[:STREAMS]; KIND Raw (bytes through identity serializers), Fast
(replica_wire.encode_data / decode_chunk with a CRC32C per message on each side, as
fastpersistd replicates), Pb (generated ReplicaChunk messages, the code before
replica_wire); TLS 0/1; MIB per message; STREAMS concurrent streams (a channel each).
GOPTS='[(option, value), ...]' adds gRPC channel/server options on both sides.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.checksum import crc32c
from fastpersist.daemon import replica_wire as rw

GB = 1e9
OPTS: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 256 << 20),
                               ("grpc.max_send_message_length", 256 << 20),
                               *ast.literal_eval(os.environ.get("GOPTS", "[]"))]


def ident(b: bytes) -> bytes:
    return b


def count(messages: Iterator[Any], kind: str) -> bytes:
    n = 0
    for m in messages:
        if kind == "Raw":
            n += len(m)
        else:
            data = m.data if kind == "Fast" else m.data.data
            crc32c(data)
            n += len(data)
    return n.to_bytes(8, "little")


def serve(directory: str) -> None:
    cert, key = (Path(f"{directory}/{n}.pem").read_bytes() for n in ("cert", "key"))
    handlers = grpc.method_handlers_generic_handler("b.B", {
        "Raw": grpc.stream_unary_rpc_method_handler(lambda it, _: count(it, "Raw"), ident,
                                                    ident),
        "Fast": grpc.stream_unary_rpc_method_handler(lambda it, _: count(it, "Fast"),
                                                     rw.decode_chunk, ident),
        "Pb": grpc.stream_unary_rpc_method_handler(lambda it, _: count(it, "Pb"),
                                                   pb.ReplicaChunk.FromString, ident)})
    server = grpc.server(futures.ThreadPoolExecutor(8), options=OPTS)
    server.add_generic_rpc_handlers((handlers,))
    insecure = server.add_insecure_port("127.0.0.1:0")
    tls = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    print(insecure, tls, flush=True)
    server.wait_for_termination()


def messages(kind: str, total: int, size: int, src: bytes) -> Iterator[Any]:
    buf = memoryview(bytearray(size))
    sent = 0
    while sent < total:
        if kind == "Raw":
            yield src[:size]
        elif kind == "Fast":
            buf[:] = src[:size]
            yield rw.encode_data(0, sent, buf, crc32c(buf))
        else:
            data = bytes(memoryview(src)[:size])
            yield pb.ReplicaChunk(data=pb.ReplicaData(file=0, offset=sent, data=data,
                                                      crc32c=crc32c(data)))
        sent += size


def stream(port: int, cert: bytes | None, kind: str, total: int, size: int, src: bytes
           ) -> int:
    target = f"127.0.0.1:{port}"
    ch = (grpc.secure_channel(target, grpc.ssl_channel_credentials(cert), OPTS)
          if cert is not None else grpc.insecure_channel(target, OPTS))
    grpc.channel_ready_future(ch).result(10)
    serializer = rw.encode_chunk if kind != "Raw" else ident
    call = ch.stream_unary(f"/b.B/{kind}", request_serializer=serializer,
                           response_deserializer=ident)
    try:
        return int.from_bytes(call(messages(kind, total, size, src)), "little")
    finally:
        ch.close()


def tcp(total: int, src: bytes) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def receive() -> None:
        conn, _ = srv.accept()
        view, got = memoryview(bytearray(4 << 20)), 0
        while got < total and (n := conn.recv_into(view)):
            got += n
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    t0 = time.perf_counter()
    with socket.create_connection(srv.getsockname()) as s:
        sent, view = 0, memoryview(src)[:4 << 20]
        while sent < total:
            s.sendall(view)
            sent += len(view)
        s.recv(1)
    seconds = time.perf_counter() - t0
    thread.join()
    srv.close()
    return total / seconds


def main() -> None:
    directory = os.environ.get("GRPC_MICRO_DIR") or tempfile.mkdtemp(prefix="grpc-micro-")
    if sys.argv[2:3] == ["server"]:
        serve(directory)
        return
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{directory}/key.pem",
                    "-out", f"{directory}/cert.pem", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    cert = Path(f"{directory}/cert.pem").read_bytes()
    server = subprocess.Popen([sys.executable, __file__, sys.argv[1], "server"],
                              stdout=subprocess.PIPE, env={**os.environ,
                                                           "GRPC_MICRO_DIR": directory})
    try:
        assert server.stdout is not None
        insecure, tls = map(int, server.stdout.readline().split())
        total = int(float(sys.argv[1]) * (1 << 30))
        src = os.urandom(64 << 20)
        for spec in sys.argv[2:]:
            if spec == "tcp":
                print(f"tcp {tcp(total, src) / GB:.2f}", flush=True)
                continue
            kind, use_tls, mib, *rest = spec.split(":")
            n = int(rest[0]) if rest else 1
            port, ca = (tls, cert) if use_tls == "1" else (insecure, None)
            args = (port, ca, kind, total // n, int(mib) << 20, src)
            t0 = time.perf_counter()
            with futures.ThreadPoolExecutor(n) as pool:
                got = sum(pool.map(lambda a: stream(*a), [args] * n))
            print(f"{spec} {got / (time.perf_counter() - t0) / GB:.2f}", flush=True)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
