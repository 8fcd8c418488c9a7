"""A fault-injecting HTTP proxy between boto3 and a real S3 server (moto).

Imported as `tier_faults` (tests/ is on sys.path). The server stays real; the
proxy, on a port of its own, forwards each request to it and, as a schedule
decides, answers instead what a store or a network does on a bad day:

    "503"             503 SlowDown (throttling), the request not forwarded
    "500"             500 InternalError, not forwarded
    "reset-body"      the connection reset (RST) halfway through the request's
                      body: a part cut short; not forwarded
    "reset-response"  the request forwarded (the server did it), the connection
                      reset before the answer: the client cannot tell
    "stall"           nothing answered until `stall_s` (set it past the
                      client's FASTPERSIST_TIER_TIMEOUT), then the connection
                      closed; not forwarded

One request per connection (answers carry `Connection: close`): simpler
framing, and every request is a new connection that a fault may cut.
`Expect: 100-continue` is answered by the proxy itself. The schedule is a
function of the parsed request (operation, key, index); `Rules` serves
chosen requests a fault a number of times, `RandomFaults` a seeded random
mix until it is switched off. `stats` counts requests and faults served.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

FAULTS = ("503", "500", "reset-body", "reset-response", "stall")
_ERRORS = {
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "500": (500, "Internal Server Error", "InternalError",
            "We encountered an internal error. Please try again."),
}


@dataclass(frozen=True)
class Request:
    index: int  # the proxy's count of requests, from 0
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names

    @property
    def key(self) -> str:
        """The object key (path-style addressing: /BUCKET/KEY)."""
        return unquote(self.path.lstrip("/").partition("/")[2])

    @property
    def operation(self) -> str:
        q, m = self.query, self.method
        if m == "PUT" and "partNumber" in q:
            return "UploadPart"
        if m == "PUT":
            return "PutObject"
        if m == "POST" and "uploads" in q:
            return "CreateMultipartUpload"
        if m == "POST" and "uploadId" in q:
            return "CompleteMultipartUpload"
        if m == "POST" and "delete" in q:
            return "DeleteObjects"
        if m == "DELETE" and "uploadId" in q:
            return "AbortMultipartUpload"
        if m == "DELETE":
            return "DeleteObject"
        if m == "HEAD":
            return "HeadObject"
        if m == "GET" and "uploads" in q:
            return "ListMultipartUploads"
        if m == "GET" and "uploadId" in q:
            return "ListParts"
        if m == "GET" and ("list-type" in q or not self.key):
            return "ListObjects"
        return "GetObject"


Schedule = Callable[[Request], str | None]  # the fault to serve, or None: forward


@dataclass
class Rule:
    operation: str  # Request.operation, or "*"
    fault: str
    times: int = 1  # how many matching requests get it
    key: str = ""  # a substring of the key to match ("": any)
    after: int = 0  # matching requests to let through first

    def take(self, req: Request) -> str | None:
        if self.operation not in ("*", req.operation) or self.key not in req.key:
            return None
        if self.after > 0:
            self.after -= 1
            return None
        if self.times <= 0:
            return None
        self.times -= 1
        return self.fault


class Rules:
    """Chosen requests get chosen faults (the first rule that takes one)."""

    def __init__(self, *rules: Rule) -> None:
        self.rules = list(rules)
        self._lock = threading.Lock()

    def __call__(self, req: Request) -> str | None:
        with self._lock:
            for rule in self.rules:
                fault = rule.take(req)
                if fault is not None:
                    return fault
        return None

    @property
    def spent(self) -> bool:
        return all(r.times <= 0 for r in self.rules)


class RandomFaults:
    """Each request gets a fault with probability `rate` (from `faults`, a
    seeded choice), while `on`."""

    def __init__(self, seed: int, rate: float, faults: Sequence[str] = FAULTS) -> None:
        self.rng = random.Random(seed)
        self.rate, self.faults = rate, list(faults)
        self.on = True
        self._lock = threading.Lock()

    def __call__(self, req: Request) -> str | None:
        with self._lock:
            if not self.on or self.rng.random() >= self.rate:
                return None
            return self.rng.choice(self.faults)


@dataclass
class Stats:
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)


class FaultProxy:
    def __init__(self, upstream: str, schedule: Schedule | None = None,
                 stall_s: float = 5.0) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.schedule: Schedule = schedule or (lambda _: None)
        self.stall_s = stall_s
        self.stats = Stats()
        self.active = 0  # connections being served now
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name="fault-proxy")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- serving -------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self.active += 1
        try:
            self._serve_one(conn)
        finally:
            with self._lock:
                self.active -= 1

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(60)
                reader = _Reader(conn)
                head = reader.until(b"\r\n\r\n")
                if head is None:
                    return
                req, raw_headers = self._parse(head)
                fault = self.schedule(req)
                with self._lock:
                    self.stats.requests += 1
                    self.stats.operations[req.operation] += 1
                    if fault is not None:
                        self.stats.faults[fault] += 1
                if fault in _ERRORS and "100-continue" in req.headers.get("expect", ""):
                    _answer_error(conn, fault)  # before the body, as a store may
                    return
                if "100-continue" in req.headers.get("expect", ""):
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                if fault == "reset-body":
                    length = int(req.headers.get("content-length", "0") or 0)
                    reader.take(length // 2)
                    _reset(conn)
                    return
                body = reader.body(req.headers)
                if fault in _ERRORS:
                    _answer_error(conn, fault)
                    return
                if fault == "stall":
                    self._closed.wait(self.stall_s)
                    return
                answer = self._forward(raw_headers, body)
                if fault == "reset-response":
                    _reset(conn)
                    return
                conn.sendall(answer)
        except OSError:
            pass  # the client went away (it timed out, or was reset)

    def _parse(self, head: bytes) -> tuple[Request, list[bytes]]:
        lines = head.split(b"\r\n")
        method, target, _ = lines[0].decode("latin-1").split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
        u = urlsplit(target)
        with self._lock:
            index = self.stats.requests
        query = parse_qs(u.query, keep_blank_values=True)
        return Request(index, method, u.path, query, headers), lines

    def _forward(self, lines: list[bytes], body: bytes) -> bytes:
        """The request to the server (one connection, closed after it), and
        its answer for the client, `Connection: close`."""
        keep = [ln for ln in lines[1:] if ln and not re.match(
            rb"(?i)(connection|expect|transfer-encoding|content-length)\s*:", ln)]
        head = b"\r\n".join([lines[0], *keep, b"Connection: close",
                             f"Content-Length: {len(body)}".encode(), b"", b""])
        with socket.create_connection(self.upstream, timeout=120) as up:
            up.sendall(head + body)
            chunks = []
            while True:
                chunk = up.recv(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        answer = b"".join(chunks)
        top, _, rest = answer.partition(b"\r\n\r\n")
        resp_lines = [ln for ln in top.split(b"\r\n")
                      if not re.match(rb"(?i)connection\s*:", ln)]
        return b"\r\n".join([*resp_lines, b"Connection: close", b"", b""]) + rest


class _Reader:
    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buf = conn, b""

    def _more(self) -> bool:
        chunk = self.conn.recv(1 << 20)
        self.buf += chunk
        return bool(chunk)

    def until(self, mark: bytes) -> bytes | None:
        while mark not in self.buf:
            if not self._more():
                return None
        out, _, self.buf = self.buf.partition(mark)
        return out

    def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._more():
                raise OSError("the client closed mid-body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def body(self, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out: list[bytes] = []
            while True:
                size_line = self.until(b"\r\n")
                if size_line is None:
                    raise OSError("the client closed mid-body")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while self.until(b"\r\n"):  # trailers, up to the empty line
                        pass
                    return b"".join(out)
                out.append(self.take(size))
                self.take(2)
        return self.take(int(headers.get("content-length", "0") or 0))


def _answer_error(conn: socket.socket, fault: str) -> None:
    status, reason, code, message = _ERRORS[fault]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
            ).encode()
    conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


def _reset(conn: socket.socket) -> None:
    """Close with an RST, as a connection cut by the network is seen."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def wait_until(what: str, check: Callable[[], object], timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
