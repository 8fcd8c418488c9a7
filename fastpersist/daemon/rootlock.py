"""One daemon per root and node: an exclusive flock on a file in the root, held for life.

Two daemons of one node on one root would each take the other's checkpoints
for their own: the second's start-up cleanup removes the first's staging
directories when their PIDs look dead to it (another PID namespace, or a
container's PID 1 on both), both apply retention and `latest`, and both queue
uploads. The lock file, `ROOT/.fastpersistd@NODE.lock` (hidden: no request
may name it, List skips it), holds the owner's pid, host, socket and TCP
address, so that a second daemon exits naming the first. The kernel drops the
lock when its holder dies, however it dies (SIGKILL included): a stale file
locks nothing.

Per node (FASTPERSIST_NODE, by default the host name, which is also what a
leftover's name says it belongs to): on shared storage each node's daemon
serves the same root (joining the jobs of the others), and a file system
whose flocks reach across nodes (GPFS, Lustre with -o flock) must not stop it.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import stat

from . import logs

_MAX_LOCK_BYTES = 4096
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def lock_name(node: str) -> str:
    """The lock file of `node`'s daemon: a plain name, whatever the node is called."""
    return f".fastpersistd@{_UNSAFE.sub('_', node)[:200]}.lock"


def lock_root(root_fd: int, root: str, node: str, unix_socket: str, listen: str
              ) -> int | None:
    """Take the root's lock and write who holds it; the returned descriptor
    holds the lock until the process ends (never close it). SystemExit (its
    message goes to stderr, the status is 1) names the daemon that holds it.
    None where the file system cannot lock (logged: this daemon then runs
    unguarded)."""
    name = lock_name(node)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, 0o644, dir_fd=root_fd)
    except OSError as exc:
        planted = " (a symbolic link planted there?)" if exc.errno == errno.ELOOP else ""
        raise SystemExit(f"fastpersistd: cannot open the lock file {root}/{name}: "
                         f"{exc.strerror}{planted}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SystemExit(f"fastpersistd: {root}/{name} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                logs.warning("root-not-locked", root=root, error=exc.strerror,
                             reason="the root's file system cannot flock: nothing stops a "
                                    "second daemon on this root")
                os.close(fd)
                return None
            raise SystemExit(f"fastpersistd: {root} is served by another fastpersistd "
                             f"({_holder(fd)}); one daemon per root on node {node!r}: stop "
                             "it, or give this one another --root") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "node": node,
                  "socket": unix_socket, "listen": listen}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode() + b"\n", 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says: 'pid P on HOST, socket S'."""
    try:
        doc = json.loads(os.pread(fd, _MAX_LOCK_BYTES, 0))
        parts = [f"pid {int(doc['pid'])} on {doc['host']}", f"socket {doc['socket']}"]
        if doc.get("listen"):
            parts.append(f"listening on {doc['listen']}")
        return ", ".join(parts)
    except (OSError, ValueError, KeyError, TypeError):
        # Between its lock and its write, or a file it did not write.
        return "its pid and socket are not written in the lock file yet"
