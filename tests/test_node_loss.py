"""The node-loss drill (issue 35, item 4): four simulated nodes on this machine
(four fastpersistd processes, separate roots, replicating to each other over
TCP with TLS and the job's token, two failure domains), a node-local job with
its ranks spread over them; then one node is lost (its daemon SIGKILLed, its
root deleted), and a replacement node restores the whole job, bit for bit,
from the replicas its peers hold: no object store is configured, and no
surviving node's disk is read (the restore asks only the replacement's own
daemon and its peers).

Also: a checkpoint whose replication the lost node had not finished is
never restored in part; the one before it still is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_support import check_loaded, describe_here, ok, run_job
from peer_support import Node, PeerGroup, wait_for

from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.cli import main as fpctl
from fastpersist.format.manifest import MANIFEST_NAME, Manifest

REPO = Path(__file__).resolve().parent.parent
DOMAINS = {"a": "rack-1", "b": "rack-1", "c": "rack-2", "d": "rack-2"}
REPLICAS = 2

pytestmark = pytest.mark.slow



def start_cluster(group: PeerGroup, disks: Path, slow: str = "") -> dict[str, Node]:
    """Four daemons, each a peer of the other three; `slow`: a node whose
    replication is rate-limited (so a test can cut it off half-way)."""
    ports = {}
    nodes: dict[str, Node] = {}
    # Peers name each other by address: start them with each other's ports,
    # which PeerGroup allots at add(); so add all first, then start.
    for name in DOMAINS:
        nodes[name] = group.add(name, DOMAINS[name], "--replicas", str(REPLICAS),
                                "--replica-bytes", "64M",
                                *(("--replication-rate", "128K") if name == slow else ()),
                                start=False, root=disks / name)
        ports[name] = nodes[name].target
    for name, node in nodes.items():
        node.daemon.args += [a for other in DOMAINS if other != name
                             for a in ("--peer", ports[other])]
        node.daemon.start()
    return nodes


def node_env(nodes: dict[str, Node]) -> dict[str, dict[str, str]]:
    return {n: {"FASTPERSIST_DAEMON": node.daemon.address,
                "FASTPERSIST_SHM_DIR": str(node.daemon.shm_dir)} for n, node in nodes.items()}


def info(node: Node) -> pb.InfoResponse:
    client = node.daemon.client()
    try:
        return client.info(timeout=10)
    finally:
        client.close()


def held_by(nodes: dict[str, Node], path: str) -> dict[str, list[str]]:
    """node -> the peers holding a complete replica of its part of `path`."""
    out: dict[str, list[str]] = {}
    for peer, node in nodes.items():
        for r in node.replicas():
            if r.complete and r.path == path:
                out.setdefault(r.node, []).append(peer)
    return out


def fully_replicated(nodes: dict[str, Node], path: str) -> bool:
    held = held_by(nodes, path)
    return all(len(held.get(n, [])) >= REPLICAS for n in nodes) and \
        all(info(node).replication_pending == 0 for node in nodes.values())


def restore_in_new_process(node: Node, ckpt: Path) -> subprocess.CompletedProcess[str]:
    """A trainer on the replacement node: fastpersist.load of the job's
    checkpoint through its node's daemon, in a fresh interpreter; prints each
    tensor's bytes as hex digests (JSON)."""
    code = ("import json, fastpersist\nfrom test_node_loss import digests\n"
            f"out = fastpersist.load({str(ckpt)!r}, daemon={node.daemon.address!r})\n"
            "print(json.dumps(digests(out)))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "FASTPERSIST_DAEMON_CA_FILE": str(node.files["cert"]),
           "FASTPERSIST_DAEMON_TOKEN_FILE": str(node.files["token"]),
           "FASTPERSIST_SHM_DIR": str(node.daemon.shm_dir)}
    env.pop("FASTPERSIST_TIER", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)


def digests(obj: Any, prefix: str = "") -> dict[str, str]:
    """Every tensor of a loaded state, by its path: dtype, shape and the
    SHA-256 of its bytes (the restoring process imports this too)."""
    flat: dict[str, str] = {}
    if isinstance(obj, torch.Tensor):
        data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        flat[prefix] = f"{obj.dtype} {tuple(obj.shape)} {hashlib.sha256(data).hexdigest()}"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flat.update(digests(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flat.update(digests(v, f"{prefix}/{i}"))
    return flat


def save_job(tmp_path: Path, nodes: dict[str, Node], disks: Path, name: str) -> None:
    reports = run_job(tmp_path, "save", ["a", "b", "c", "d"],
                      {"path": str(disks / "{node}" / name), "node_local": True},
                      env_by_node=node_env(nodes), timeout=240)
    ok(reports)


def gathered(tmp_path: Path, disks: Path, name: str) -> dict[str, str]:
    """The job's checkpoint gathered from every node's disk (the reference)."""
    into = tmp_path / f"gathered-{name}"
    assert fpctl(["gather", *(str(disks / n / name) for n in DOMAINS), "--to", str(into)]) == 0
    import fastpersist

    loaded = fastpersist.load(into, daemon="")
    check_loaded(describe_here(loaded), tp=False)
    return digests(loaded)


def lose(node: Node, disks: Path) -> None:
    node.daemon.kill()  # SIGKILL
    shutil.rmtree(disks / node.name)


def test_a_replacement_node_restores_the_job_from_its_peers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    disks = tmp_path / "disks"
    group = PeerGroup(tmp_path)
    try:
        nodes = start_cluster(group, disks)
        save_job(tmp_path, nodes, disks, "ckpt")
        for n in DOMAINS:  # node-local: each node's disk has its own files only
            files = Manifest.from_json((disks / n / "ckpt" / MANIFEST_NAME).read_bytes(),
                                       "ckpt").files
            assert {f.node for f in files} == set(DOMAINS)
        wait_for("every node's part on two peers", lambda: fully_replicated(nodes, "ckpt"),
                 timeout=120)
        held = held_by(nodes, "ckpt")
        for n, peers in held.items():  # placement: outside the node's failure domain first
            assert n not in peers, (n, peers)
            assert any(DOMAINS[p] != DOMAINS[n] for p in peers), (n, peers)
        expected = gathered(tmp_path, disks, "ckpt")
        # fpctl ls on node a: its checkpoint is on its disk and on peers.
        monkeypatch.setenv("FASTPERSIST_DAEMON_CA_FILE", str(group.files["cert"]))
        monkeypatch.setenv("FASTPERSIST_DAEMON_TOKEN_FILE", str(group.files["token"]))
        capsys.readouterr()
        assert fpctl(["ls", str(disks / "a"), "--daemon", nodes["a"].daemon.address,
                      "--json"]) == 0
        rows = {r["name"]: r["copies"] for r in json.loads(capsys.readouterr().out)}
        assert rows == {"ckpt": ["disk", "peer"]}, rows

        lose(nodes["c"], disks)
        replacement = group.add("c", DOMAINS["c"], "--replicas", str(REPLICAS),
                                "--replica-bytes", "64M",
                                *[a for n in "abd" for a in ("--peer", nodes[n].target)],
                                root=disks / "c")
        assert not (disks / "c" / "ckpt").exists()
        for n in "abd":  # nor is any surviving node's disk read: the replicas alone
            (disks / n / "ckpt").rename(disks / n / "ckpt.aside")
        done = restore_in_new_process(replacement, disks / "c" / "ckpt")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "reading it from the peers' replicas" in done.stderr, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == expected
    finally:
        group.cleanup()


def test_a_checkpoint_whose_replication_was_cut_off_is_never_restored(tmp_path: Path
                                                                      ) -> None:
    disks = tmp_path / "disks"
    group = PeerGroup(tmp_path)
    try:
        nodes = start_cluster(group, disks, slow="c")
        save_job(tmp_path, nodes, disks, "ckpt")
        wait_for("every node's part on two peers", lambda: fully_replicated(nodes, "ckpt"),
                 timeout=180)
        expected = gathered(tmp_path, disks, "ckpt")
        save_job(tmp_path, nodes, disks, "ckpt2")

        survivors = {n: nodes[n] for n in "abd"}

        def cut_off_possible() -> bool:  # arriving somewhere, complete nowhere yet
            return "c" not in held_by(survivors, "ckpt2") and any(
                r.node == "c" and r.path == "ckpt2" and not r.complete
                for n in "abd" for r in nodes[n].replicas())

        wait_for("node c's part of ckpt2 arriving at a peer", cut_off_possible, timeout=60)
        lose(nodes["c"], disks)  # mid-way through its replication (128 KiB/s)
        assert "c" not in held_by(survivors, "ckpt2")
        replacement = group.add("c", DOMAINS["c"], "--replicas", str(REPLICAS),
                                "--replica-bytes", "64M",
                                *[a for n in "abd" for a in ("--peer", nodes[n].target)],
                                root=disks / "c")
        cut = restore_in_new_process(replacement, disks / "c" / "ckpt2")
        assert cut.returncode != 0, cut.stdout[-2000:]
        assert "did not finish" in cut.stderr, cut.stderr[-3000:]
        whole = restore_in_new_process(replacement, disks / "c" / "ckpt")
        assert whole.returncode == 0, whole.stderr[-3000:]
        assert json.loads(whole.stdout.strip().splitlines()[-1]) == expected
    finally:
        group.cleanup()
