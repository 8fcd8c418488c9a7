"""Requests and file-system attacks for the daemon's fuzz test (test_daemon_fuzz.py).

A seeded generator: every case is one call of one of the daemon's 15 RPCs,
its request random (any field any value), structured (ids, paths, segments
and headers the daemon gave out or would accept) or a valid one with one field
mutated; or a whole save, raw or compressed (Begin's compression), whose
client may truncate its segment right after handing it over (the daemon reads
it then: a SIGBUS); or a call over TCP from a peer without the token (none,
or a wrong one), of any method and up to 4 MiB, which must be refused
(UNAUTHENTICATED) without the daemon reading it. Between calls, attacks on
what lies in the root and in the shm directory: a staging directory or a path
component swapped for a symlink to a sentinel outside the root, planted
manifest.json links and FIFOs, FIFO job markers, hard links and odd entries
named as segments.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import socket
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from daemon_raw import Raw, entry, file_header, raw_header, valid_tree
from daemon_support import Daemon

from fastpersist import _engine
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.protocol.shm import Segment
from fastpersist.storage.commit import leftover_name

SECRET = b"FUZZ-SECRET-7f3a"
OLD = time.time() - 3600
U32, U64 = 2**32 - 1, 2**64 - 1
METHODS = {"Info": "uu", "Begin": "uu", "Open": "us", "SubmitShm": "uu", "SubmitStream": "su",
           "Commit": "uu", "Abort": "uu", "Wait": "uu", "Watch": "us", "List": "uu",
           "Delete": "uu", "BeginJob": "uu", "CommitJob": "uu", "ResolvePrepared": "uu",
           "AbortJob": "uu", "MemoryCopy": "uu", "Replicate": "su", "Replicas": "uu",
           "ReadReplica": "us"}


def _regular_bytes(path: Path) -> bytes:
    """A regular file's bytes; OSError for anything else (a planted FIFO would block)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


class Stranger:
    """A TLS peer of the daemon's TCP port without its token (none, or a wrong one)."""

    def __init__(self, port: int, cert: bytes) -> None:
        creds = grpc.ssl_channel_credentials(cert)
        wrong = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials("not-the-token"))
        options = [("grpc.max_send_message_length", -1)]
        self.channels = [grpc.secure_channel(f"127.0.0.1:{port}", c, options)
                         for c in (creds, wrong)]

    def call(self, rng: random.Random, method: str, payload: bytes) -> None:
        channel = rng.choice(self.channels)
        path = f"/fastpersist.v1.FastPersist/{method}"
        kind = METHODS[method]
        if kind == "su":
            channel.stream_unary(path)(iter([payload] * rng.randrange(1, 4)), timeout=10)
        elif kind == "us":
            next(channel.unary_stream(path)(payload, timeout=10))
        else:
            channel.unary_unary(path)(payload, timeout=10)

    def close(self) -> None:
        for c in self.channels:
            c.close()


class Fuzzer:
    def __init__(self, daemon: Daemon, raw: Raw, sentinel: Path, seed: int) -> None:
        self.d = daemon
        self.raw = raw
        self.sentinel = sentinel
        self.rng = random.Random(seed)
        self.ids: list[str] = []  # checkpoint ids the daemon gave out
        self.jobs: list[str] = []  # job ids, real and planted
        self.prepared: list[str] = []  # prepared parts' names, real and planted
        self.paths = ["a/ck", "a/b/ck", "p/ck", "p/q/ck", "escape/x", "planted", "fifo",
                      "j/ck", "a", "deep/" * 20 + "ck"]
        self.segments: list[Segment] = []
        self.watches: list[Any] = []
        # The symlinks the attacks made, by inode: each with the name it was made
        # under (a directory above it may move; its own name may not).
        self.planted_links: dict[int, str] = {}
        self.sockets: list[socket.socket] = []
        self.stranger: Stranger | None = None  # set where the daemon serves TCP
        self.n = 0
        (daemon.root / "p").mkdir()
        self._link(daemon.root / "p-link", sentinel)
        self._link(daemon.root / "escape", sentinel)

    # -- values -------------------------------------------------------------------

    def pick(self, xs: list[Any]) -> Any:
        return self.rng.choice(xs)

    def u32(self) -> int:
        return self.pick([0, 1, 2, 3, 7, 4096, 2**31, U32, self.rng.randrange(U32)])

    def u64(self) -> int:
        return self.pick([0, 1, 16, 4096, 1 << 20, 2**32, 2**63, U64, self.rng.randrange(U64)])

    def text(self) -> str:
        r = self.rng
        return self.pick(["", "a", "..", "/etc/passwd", "a/../../x", "x\x00y", ".hidden",
                          "n" * 300, "é/ü/ck", "a//b", "p-link/x", "escape", "planted",
                          "fastpersist-" + "z" * 140, "../" * 50, "a/" * 600,
                          "".join(chr(r.randrange(32, 0x2FFF)) for _ in range(r.randrange(20))),
                          *self.paths])

    def ident(self) -> str:
        if self.ids and self.rng.random() < 0.7:
            i = self.pick(self.ids)
            return self.pick([i, i, i[:-1], i.upper(), i + "0"])
        return self.text()

    def job_id(self) -> str:
        if self.jobs and self.rng.random() < 0.7:
            j = self.pick(self.jobs)
            return self.pick([j, j, j.rpartition(":")[0] + ":00", j + "x"])
        return self.pick([self.text(), "a:b", ":", "x" * 600 + ":s", ".a.fp-tmp-1-0@h:s"])

    def path(self) -> str:
        return self.pick(self.paths) if self.rng.random() < 0.6 else self.text()

    def segment(self) -> tuple[str, int, int]:
        r = self.rng
        if self.segments and r.random() < 0.7:
            s = self.pick(self.segments)
            return s.name, s.data_offset + self.pick([0, 0, 0, 100, 4096, -4096]), \
                self.pick([0, 16, 64, s.size, s.size + 1])
        name = self.pick(["fastpersist-hl", "fastpersist-dir", "fastpersist-fifo",
                          "fastpersist-sock", "fastpersist-link", "../x", "", self.text()])
        return name, self.u64(), self.u64()

    def header(self) -> tuple[bytes, int]:
        """A data file's header and its data length: valid, odd or garbage."""
        r = self.rng
        kind = r.randrange(6)
        if kind == 0:
            n = r.randrange(1, 5)
            return file_header([(f"t{i}", r.randrange(1, 64)) for i in range(n)])
        if kind == 1:
            shape = [self.pick([0, 1, 2, 999_999_999, 2**62, 2**64, -1])
                     for _ in range(self.pick([1, 3, 65, 300, 3000]))]
            return raw_header({"w": entry(self.pick(["F32", "F33", 5, None]), shape, 0,
                                          self.pick([0, 16, 2**70]))}), 16
        if kind == 2:
            return raw_header({f"t{i}": entry("U8", [1], i, i + 1) for i in range(r.randrange(
                1, 3000))}), self.pick([0, 1, 100, 3000])
        if kind == 3:
            return struct.pack("<Q", self.u64()) + r.randbytes(r.randrange(64)), self.u64()
        if kind == 4:
            return raw_header(self.pick([[], "x", {"w": 1}, {"__metadata__": {"a": "b"}},
                                         json.loads("[" * 50 + "]" * 50)])), 0
        return r.randbytes(r.randrange(0, 8192)), self.u64()

    def manifest(self) -> bytes:
        r = self.rng
        doc = {"format": "fastpersist-checkpoint", "schema_version": self.pick([1, 2, 3, -1]),
               "files": [{"name": self.pick(["data-r000000-000.safetensors", "../x", "a"]),
                          "size": self.u64(), "data_start": 4096, "header_crc32c": 0}],
               "tensors": [], "tree": None, "globals": self.pick([[], None, [{"name": "w"}]])}
        return self.pick([json.dumps(doc).encode(), b"[" * 1000, r.randbytes(100), b"{}", b""])

    # -- requests -------------------------------------------------------------------

    def calls(self) -> list[Callable[[], Any]]:
        s = self.raw.stub
        t = 10
        return [
            lambda: s.Info(pb.InfoRequest(), timeout=t),
            lambda: self._begin(self.begin_request()),
            lambda: self._open(self.begin_request()),
            lambda: self._submit_shm(),
            lambda: s.SubmitStream(iter(self._stream()), timeout=t),  # a list: built first
            lambda: s.Commit(pb.CommitRequest(
                checkpoint_id=self.ident(), tree_json=self.pick([valid_tree(), "{", "[" * 5000,
                                                                 "NaN", "null", self.text()]),
                tensor_order=self.pick([["w"], [], ["t0"], ["w", "w"], [self.text()] * 3]),
                after_commit=self.after_commit()), timeout=t),
            lambda: s.Abort(pb.AbortRequest(checkpoint_id=self.ident()), timeout=t),
            lambda: s.Wait(pb.WaitRequest(checkpoint_id=self.ident(),
                                          min_files_written=self.u32()), timeout=2),
            lambda: self._watch(),
            lambda: s.List(pb.ListRequest(path=self.path()), timeout=t),
            lambda: s.Delete(pb.DeleteRequest(path=self.path()), timeout=t),
            lambda: self._begin_job(),
            lambda: self._commit_job(),
            lambda: s.ResolvePrepared(pb.ResolvePreparedRequest(
                path=self.path(), prepared=self.prepared_name(), publish=self.rng.random() < 0.5),
                timeout=t),
            lambda: s.AbortJob(pb.AbortJobRequest(job_id=self.job_id()), timeout=t),
            lambda: s.MemoryCopy(pb.MemoryCopyRequest(path=self.path()), timeout=t),
            lambda: self._replicate(),
            lambda: s.Replicas(pb.ReplicasRequest(), timeout=t),
            lambda: self._read_replica(),
            lambda: self._save(),
            lambda: self._save_compressed(),
            lambda: self._stranger(),
        ]

    def prepared_name(self) -> str:
        if self.prepared and self.rng.random() < 0.7:
            p = self.pick(self.prepared)
            return self.pick([p, p, p + "x", p.replace("prep", "tmp")])
        return self.pick([self.text(), ".a.fp-prep-1-00@h", ".ckpt.fp-prep-1-00@h", "/x", "."])

    def _commit_job(self) -> None:
        """CommitJob, sometimes preparing the part (prepare_for) instead."""
        prepare_for = self.pick(["", "", "n0", "x" * 600])
        reply = self.raw.stub.CommitJob(pb.CommitJobRequest(
            job_id=self.job_id(), manifest=self.manifest(), node=self.pick(["", "n0", "x" * 600]),
            after_commit=self.after_commit(), prepare_for=prepare_for), timeout=10)
        if reply.prepared:
            self.prepared = [*self.prepared, reply.prepared][-20:]

    def begin_request(self) -> pb.BeginRequest:
        r = self.rng
        return pb.BeginRequest(
            path=self.path(), client_id=self.pick(["c", "", "x" * 300, f"c{r.randrange(40)}"]),
            staging_bytes=self.pick([4096, 1 << 20, self.u64()]),
            file_count=self.pick([0, 1, 2, self.u32()]),
            job_id=self.job_id() if r.random() < 0.3 else "", rank=self.u32(),
            compression=self.pick(["", "", "zstd", "zstd", "lz4", "ZSTD", self.text()]),
            frame_bytes=self.pick([0, 0, 4096, 1 << 20, 4097, 64 << 20, 128 << 20, self.u32()]))

    def after_commit(self) -> pb.AfterCommit | None:
        """A Checkpointer's policy, sometimes (on paths that are rarely step-N)."""
        r = self.rng
        if r.random() < 0.5:
            return None
        return pb.AfterCommit(point_latest=r.random() < 0.5, keep_last=self.pick([0, 1, 2]),
                              keep_every=self.pick([0, 1, 3, self.u32()]))

    def _open(self, req: pb.BeginRequest) -> None:
        """Begin answered by a stream, kept open (the lease) or dropped at once."""
        call = self.raw.stub.Open(req, timeout=10)
        first = next(call)
        self.ids = [*self.ids, first.checkpoint_id][-50:]
        if self.rng.random() < 0.3:
            call.cancel()  # a client gone before anything else: the daemon aborts it
            return
        self.watches.append(call)
        while len(self.watches) > 8:
            self.watches.pop(0).cancel()

    def _begin(self, req: pb.BeginRequest) -> None:
        reply = self.raw.stub.Begin(req, timeout=10)
        self.ids = [*self.ids, reply.checkpoint_id][-50:]

    def _begin_job(self) -> None:
        reply = self.raw.stub.BeginJob(pb.BeginJobRequest(path=self.path(), client_id="c"),
                                       timeout=10)
        self.jobs = [*self.jobs, reply.job_id][-20:]

    def fresh(self) -> str:
        """A checkpoint just begun (RECEIVING), raw or compressed, for a
        submission to reach deep."""
        self.n += 1
        reply = self.raw.stub.Begin(pb.BeginRequest(
            path=f"f/{self.n}", client_id=f"f{self.rng.randrange(8)}",
            staging_bytes=self.pick([4096, 1 << 20, 64 << 20]), file_count=self.pick([1, 2]),
            compression=self.pick(["", "zstd"]), frame_bytes=self.pick([0, 4096])), timeout=10)
        ident = str(reply.checkpoint_id)
        self.ids = [*self.ids, ident][-50:]
        return ident

    def _submit_shm(self) -> None:
        header, n = self.header()
        name, offset, length = self.segment()
        if self.segments and self.rng.random() < 0.5:
            seg = self.pick(self.segments)
            name, offset, length = seg.name, seg.data_offset, n
        ident = self.fresh() if self.rng.random() < 0.5 else self.ident()
        for seg in self.segments:
            if seg.name == name and self.rng.random() < 0.8:
                seg.seal(ident)
        self.raw.stub.SubmitShm(pb.SubmitShmRequest(
            checkpoint_id=ident, file=pb.DataFile(index=self.pick([0, 1, self.u32()]),
                                                  header=header),
            data=pb.ShmRef(segment=name, offset=max(0, min(offset, U64)),
                           length=max(0, min(length, U64)))), timeout=10)

    def _stream(self) -> list[pb.StreamChunk]:
        header, n = self.header()
        r = self.rng
        chunks = []
        if r.random() < 0.9:
            ident = self.fresh() if r.random() < 0.5 else self.ident()
            chunks.append(pb.StreamChunk(header=pb.StreamHeader(
                checkpoint_id=ident, file=pb.DataFile(index=self.pick([0, 1, self.u32()]),
                                                      header=header),
                data_length=min(self.pick([n, n + 1, 0, self.u64()]), U64))))
        for _ in range(r.randrange(4)):
            if r.random() < 0.1:
                chunks.append(pb.StreamChunk(header=pb.StreamHeader(checkpoint_id="x")))
            else:
                chunks.append(pb.StreamChunk(data=b"\0" * self.pick([0, 1, 16, 4096, 70_000])))
        return chunks

    def _watch(self) -> None:
        call = self.raw.stub.Watch(pb.WaitRequest(checkpoint_id=self.ident()), timeout=10)
        self.watches.append(call)
        next(call)
        while len(self.watches) > 8:
            self.watches.pop(0).cancel()

    def _save(self) -> None:
        """A whole valid save, sometimes left half-way (no Watch, no Commit)."""
        r = self.rng
        header, n = file_header([("w", 4)])
        seg = self.new_segment(b"\x01" * n)
        ident = self.raw.begin(self.pick(self.paths), client=f"s{r.randrange(4)}",
                               staging=seg.size)
        self.ids = [*self.ids, ident][-50:]
        self.raw.submit(ident, 0, header, seg.name, 0, n)
        if r.random() < 0.7:
            self._watch_id(ident)
            self.raw.commit(ident, valid_tree(), ["w"])
            self.raw.wait(ident)

    def _save_compressed(self) -> None:
        """A whole compressed save of two files, whose client truncates the
        second file's segment at once, half the time: the daemon encodes that
        file (reading the segment) after it wrote the first, so the truncation
        comes first (a SIGBUS in the codec, which must fail only this save)."""
        r = self.rng
        big, small = r.randrange(1 << 16, 1 << 18), r.randrange(1024, 1 << 14)  # F32 elements
        header0, n0 = file_header([("a", big)])
        header1, n1 = file_header([("b", small)])
        seg0 = self.new_segment((r.randbytes(64) * (n0 // 64 + 1))[:n0])
        seg1 = self.new_segment((struct.pack("<f", 0.5) * (n1 // 4 + 1))[:n1])
        reply = self.raw.stub.Begin(pb.BeginRequest(
            path=self.pick(self.paths), client_id=f"z{r.randrange(4)}",
            staging_bytes=seg0.size + seg1.size, file_count=2, compression="zstd",
            frame_bytes=self.pick([0, 4096, 1 << 16])), timeout=10)
        ident = str(reply.checkpoint_id)
        self.ids = [*self.ids, ident][-50:]
        self._watch_id(ident)
        self.raw.submit(ident, 0, header0, seg0.name, 0, n0)
        self.raw.submit(ident, 1, header1, seg1.name, 0, n1)
        if r.random() < 0.5:
            os.truncate(seg1.path, self.pick([0, 4096, 8192]))
            # Not for the structured requests: sealing it would fault here.
            self.segments = [s for s in self.segments if s is not seg1]
        self.raw.commit(ident, json.dumps({"t": "dict", "k": ["a", "b"], "v": [
            {"t": "tensor", "e": 0}, {"t": "tensor", "e": 1}]}), ["a", "b"])
        self.raw.wait(ident)

    def _committed(self) -> Path | None:
        """A checkpoint committed under the root now, if any."""
        found = []
        for top, dirs, files in os.walk(self.d.root):  # never through the planted links
            dirs[:] = [n for n in dirs if not n.startswith(".")]
            if MANIFEST_NAME in files and not os.path.islink(top):
                found.append(Path(top))
        return self.pick(found) if found else None

    def _replicate(self) -> None:
        """A replica from a peer (the socket needs no token): a committed
        checkpoint's files, sent whole, cut, out of order, with wrong CRCs or
        sizes; or a header of odd names, jobs and manifests."""
        r = self.rng
        ck = self._committed()
        header = pb.ReplicaHeader(job=self.pick(["", "", "", "other", "x" * 600]),
                                  node=self.pick(["n0", "n1", "", "x" * 600, self.text()]),
                                  path=self.path(), failure_domain=self.pick(["", "r", "x" * 700]))
        blobs: list[bytes] = []
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if ck is not None and r.random() < 0.7:
                header.manifest = _regular_bytes(ck / MANIFEST_NAME)
                for f in json.loads(header.manifest)["files"]:
                    blobs.append(_regular_bytes(ck / f["name"]))
                    header.files.add(name=f["name"], size=self.pick([f["size"]] * 4 + [
                        f["size"] + 1, 0, self.u64()]))
        if not blobs:
            header.manifest = self.manifest()
            for _ in range(self.pick([0, 1, 2, 3])):
                header.files.add(name=self.pick(["data-r000000-000.safetensors", "../x", ".h",
                                                 self.text()]), size=self.u64())
        chunks = [pb.ReplicaChunk(header=header)] if r.random() < 0.95 else []
        for i, blob in enumerate(blobs):
            for off in range(0, len(blob), 1 << 16):
                data = blob[off:off + (1 << 16)]
                crc = _engine.crc32c(data) if r.random() < 0.97 else self.u32()
                chunks.append(pb.ReplicaChunk(data=pb.ReplicaData(
                    file=i if r.random() < 0.97 else self.u32(), offset=off, data=data,
                    crc32c=crc)))
        if chunks and r.random() < 0.2:
            chunks = chunks[:r.randrange(1, len(chunks) + 1)]  # cut off
        if r.random() < 0.05:
            chunks.append(pb.ReplicaChunk(header=header))  # a second header
        self.raw.stub.Replicate(iter(chunks), timeout=10)

    def _read_replica(self) -> None:
        """Ranges of a held replica, or of none: in and out of its files."""
        held = list(self.raw.stub.Replicas(pb.ReplicasRequest(), timeout=10).replicas)
        request = pb.ReadReplicaRequest(node=self.pick(["n0", "", self.text()]),
                                        path=self.path(), manifest_sha256=self.rng.randbytes(32))
        names = [self.text(), "data-r000000-000.safetensors"]
        if held and self.rng.random() < 0.7:
            h = self.pick(held)
            request.node, request.path = h.node, h.path
            request.manifest_sha256 = hashlib.sha256(h.manifest).digest()
            names = [f.name for f in h.files] or names
        for _ in range(self.pick([0, 1, 3, 5000])):
            request.ranges.add(file=self.pick(names), offset=self.pick([0, 0, 4096, self.u64()]),
                               length=self.pick([0, 1, 4096, 1 << 20, self.u64()]))
        for _ in self.raw.stub.ReadReplica(request, timeout=10):
            pass

    def _stranger(self) -> None:
        """Any method over TCP without the token, its request any bytes, up to 4 MiB."""
        if self.stranger is None:
            return  # no openssl here to make the daemon's certificate: no TCP
        r = self.rng
        size = self.pick([0, 1, 100, 64 << 10, 1 << 20, 4 << 20])
        self.stranger.call(r, self.pick(list(METHODS)), r.randbytes(min(size, 4096)) *
                           max(1, size // 4096))

    def _watch_id(self, ident: str) -> None:
        self.watches.append(self.raw.watch(ident))
        while len(self.watches) > 8:
            self.watches.pop(0).cancel()

    def new_segment(self, data: bytes) -> Segment:
        seg = self.raw.segment(data)
        self.segments = [*self.segments, seg][-10:]
        return seg

    # -- attacks on the file system ---------------------------------------------------------

    def _link(self, at: Path, to: Path) -> None:
        at.symlink_to(to, target_is_directory=to.is_dir())
        self.planted_links[os.lstat(at).st_ino] = at.name

    def attack(self) -> None:
        self.n += 1
        root, shm, r, k = self.d.root, self.d.shm_dir, self.rng, self.n
        kind = r.randrange(9)
        if kind == 0:  # a staging directory swapped for a link out
            staging = [p for p in root.rglob(".*.fp-tmp-*") if p.is_dir() and not p.is_symlink()]
            if staging:
                victim = self.pick(staging)
                try:
                    victim.rename(victim.with_name(f"moved-{k}"))
                except OSError:
                    return
                self._link(victim, self.sentinel)
        elif kind == 1:  # root/p and root/p-link swap places
            _engine.rename_exchange(str(root / "p"), str(root / "p-link"))
            link = root / ("p" if (root / "p").is_symlink() else "p-link")
            self.planted_links[os.lstat(link).st_ino] = link.name
        elif kind == 2:  # a checkpoint whose manifest.json is a link out, or a FIFO
            d = root / f"planted-{k}"
            d.mkdir()
            if r.random() < 0.5:
                self._link(d / "manifest.json", self.sentinel / "secret")
            else:
                os.mkfifo(d / "manifest.json")
        elif kind == 3:  # a job directory whose marker is a FIFO
            (root / "j").mkdir(exist_ok=True)
            name = leftover_name("ck", "tmp")
            (root / "j" / name).mkdir()
            os.mkfifo(root / "j" / name / ".fastpersist-job")
            self.jobs.append(f"{name}:secret")
        elif kind == 4:  # a hard link to someone's file, named as a segment
            hl = shm / "fastpersist-hl"
            if not hl.exists():
                os.link(self.sentinel_shm, hl)
        elif kind == 5:  # odd entries named as segments, old enough to be reclaimed
            for name, make in (("fastpersist-dir", lambda p: p.mkdir()),
                               ("fastpersist-fifo", os.mkfifo),
                               ("fastpersist-link", lambda p: self._link(p, self.sentinel))):
                p = shm / name
                if not os.path.lexists(p):
                    make(p)
                    os.utime(p, (OLD, OLD), follow_symlinks=False)
            if not os.path.lexists(shm / "fastpersist-sock"):
                sock = socket.socket(socket.AF_UNIX)
                sock.bind(str(shm / "fastpersist-sock"))
                self.sockets.append(sock)
        elif kind == 6:  # a fresh segment for the structured requests
            self.new_segment(r.randbytes(r.randrange(1, 8192)))
        elif kind == 7:  # prepared parts for ResolvePrepared: real-looking, or a link out
            parent = root / self.pick(["a", "p", "j"])
            if parent.is_dir() and not parent.is_symlink():
                name = leftover_name("ck", "prep")
                if r.random() < 0.5:
                    (parent / name).mkdir()
                    (parent / name / "manifest.json").write_bytes(b"{}")
                    if r.random() < 0.5:  # its marker a link out
                        self._link(parent / name / ".fastpersist-prepared",
                                   self.sentinel / "secret")
                else:
                    self._link(parent / name, self.sentinel)
                self.prepared = [*self.prepared, name][-20:]
        else:  # a directory of the paths replaced by a file
            victim = root / self.pick(["a", "a/b", "deep"])
            if victim.is_dir() and not victim.is_symlink() and r.random() < 0.2:
                victim.rename(root / f"aside-{k}")
                victim.write_bytes(b"not a directory")

    sentinel_shm: Path  # a secret file on the shm tmpfs, outside the shm directory
