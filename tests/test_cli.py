"""fpctl: each command run in-process through main(), plus the installed script."""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import socket
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from support import Mounter, flip_bit

import fastpersist
from fastpersist.cli import main
from fastpersist.storage import commit
from fastpersist.tensors.checkpoint import read_manifest

DATA = "data-00000.safetensors"


def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g)
    return {
        "model": OrderedDict(
            w=w,
            tied=w,  # tied weights: one object twice
            b=torch.randn(5, generator=g).to(torch.bfloat16),
            ids=torch.arange(6, dtype=torch.int64).reshape(2, 3),
        ),
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(3, 4, generator=g), "step": torch.tensor(7.0)},
                      1: {"exp_avg": torch.randn(5, generator=g), "step": torch.tensor(7.0)}},
            "param_groups": [{"lr": 0.01, "betas": [0.9, 0.999], "params": [0, 1]}],
        },
        "epoch": 3,
        "name": "run-1",
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


@pytest.fixture
def state() -> dict[str, Any]:
    return make_state()


@pytest.fixture
def ckpt(tmp_path: Path, state: dict[str, Any]) -> Path:
    path = tmp_path / "root" / "step-100"
    fastpersist.save(state, path)
    return path


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    proc.wait()
    return proc.pid


def leftover_dir(root: Path, target: str, kind: str, pid: int) -> Path:
    """A directory named as commit.leftover_name names it, for process `pid`."""
    name = commit.leftover_name(target, kind)
    name = re.sub(rf"-{os.getpid()}-([0-9a-f]+@)", rf"-{pid}-\1", name, count=1)
    path = root / name
    path.mkdir()
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---- ls ----------------------------------------------------------------------------------


def test_ls_shows_committed_corrupt_and_leftover_states(
    ckpt: Path, dead_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    root = ckpt.parent
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text('{"format": "something-else"}')
    (root / "not-a-checkpoint").mkdir()  # no manifest: not listed
    dead = leftover_dir(root, "step-200", "tmp", dead_pid)
    live = leftover_dir(root, "step-300", "tmp", os.getpid())
    old = leftover_dir(root, "step-100", "old", dead_pid)
    deleting = leftover_dir(root, "step-050", "del", dead_pid)

    rc, out, _ = run(capsys, "ls", str(root))
    assert rc == 0
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert out.splitlines()[0].split() == ["NAME", "SIZE", "TENSORS", "CREATED", "COPIES",
                                           "STATE"]
    assert set(lines) == {"step-100", "broken", dead.name, live.name, old.name, deleting.name}
    assert lines["step-100"].endswith("committed")
    assert " 7 " in lines["step-100"]  # seven stored tensors (the tied pair is one)
    assert "KiB" in lines["step-100"]
    assert "corrupt: malformed manifest" in lines["broken"]
    host = socket.gethostname()
    assert f"incomplete (save by pid {dead_pid} on {host}, dead)" in lines[dead.name]
    assert f"incomplete (save by pid {os.getpid()} on {host}, running)" in lines[live.name]
    assert "replaced (old copy" in lines[old.name]
    assert f"being deleted (by pid {dead_pid} on {host}, dead)" in lines[deleting.name]

    rc, out, _ = run(capsys, "ls", str(root), "--json")
    assert rc == 0
    entries = json.loads(out)
    assert [e["name"] for e in entries] == sorted(e["name"] for e in entries)
    for e in entries:
        assert set(e) == {"name", "path", "state", "bytes", "tensors", "created_unix",
                          "latest", "copies"}
    by_name = {e["name"]: e for e in entries}
    m = read_manifest(ckpt)
    assert by_name["step-100"] == {
        "name": "step-100", "path": str(ckpt), "state": "committed",
        "bytes": m.total_bytes, "tensors": 7, "created_unix": m.created_unix,
        "latest": False, "copies": ["disk"],
    }
    assert by_name[dead.name]["copies"] == []
    assert by_name["broken"]["state"].startswith("corrupt: ")
    assert by_name[dead.name]["state"].endswith(", dead)")


def test_ls_lists_run_directories_marks_latest_and_damage(
    tmp_path: Path, state: dict[str, Any], dead_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A daemon's root holds runs: ROOT/run1/step-N. ls finds them at any depth,
    marks what each run's `latest` names, and calls a checkpoint whose data file
    is shorter than its manifest says damaged (from its size: no byte is read)."""
    root = tmp_path / "root"
    with fastpersist.Checkpointer(root / "run1", daemon="") as c:
        for step in (1, 2):
            c.save(step, state).result()
    with fastpersist.Checkpointer(root / "team" / "run2", daemon="") as c:
        c.save(7, state).result()
    cut = root / "team" / "run2" / "step-00000007"
    data = cut / read_manifest(cut).files[0].name
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    lost = root / "run1" / "step-00000003"  # data files, no manifest
    shutil.copytree(root / "run1" / "step-00000002", lost)
    (lost / "manifest.json").unlink()
    dead = leftover_dir(root / "run1", "step-00000004", "tmp", dead_pid)
    (root / "run1" / "notes").mkdir()  # neither: not listed, looked into

    rc, out, _ = run(capsys, "ls", str(root))
    assert rc == 0
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(lines) == {"run1/step-00000001", "run1/step-00000002", "run1/step-00000003",
                          f"run1/{dead.name}", "team/run2/step-00000007"}
    assert lines["run1/step-00000001"].endswith("committed")
    assert lines["run1/step-00000002"].endswith("committed, latest")
    assert "damaged: data files without a manifest.json" in lines["run1/step-00000003"]
    assert (f"damaged: data file {data.name} is truncated: {data.stat().st_size} bytes"
            in lines["team/run2/step-00000007"])
    assert lines["team/run2/step-00000007"].endswith(", latest")
    assert "incomplete" in lines[f"run1/{dead.name}"]

    rc, out, _ = run(capsys, "ls", str(root), "--json")
    by_name = {e["name"]: e for e in json.loads(out)}
    assert by_name["run1/step-00000002"]["latest"] is True
    assert by_name["run1/step-00000002"]["state"] == "committed"
    assert by_name["run1/step-00000001"]["latest"] is False
    assert by_name["team/run2/step-00000007"]["state"].startswith("damaged: ")


def test_ls_does_not_follow_links(tmp_path: Path, ckpt: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "other"
    root.mkdir()
    (root / "link").symlink_to(ckpt.parent, target_is_directory=True)
    rc, out, _ = run(capsys, "ls", str(root))
    assert rc == 0 and out.startswith("no checkpoints in")


def test_ls_missing_root_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "ls", str(tmp_path / "nope"))
    assert rc == 2
    assert "does not exist" in err and "Traceback" not in err


# ---- inspect -----------------------------------------------------------------------------


def test_inspect_lists_dtypes_shapes_and_tree(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, "inspect", str(ckpt))
    assert rc == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["model.b"][1:3] == ["BF16", "[5]"]
    assert rows["model.ids"][1:4] == ["I64", "[2,", "3]"]
    assert rows["optimizer.state.0.step"][1:3] == ["F32", "[]"]
    assert "schema        1" in out
    assert "model: odict of 4 keys" in out and "epoch: 3" in out

    rc, out, _ = run(capsys, "inspect", str(ckpt), "--json")
    assert rc == 0
    info = json.loads(out)
    m = read_manifest(ckpt)
    assert info["schema_version"] == 1
    assert info["fastpersist_version"] == fastpersist.__version__
    assert info["files"][0]["name"] == DATA and info["files"][0]["size"] == m.total_bytes
    assert [(t["name"], t["dtype"], t["shape"], t["bytes"], t["offset"], t["crc32c"])
            for t in info["tensors"]] == [
        (t.name, t.dtype, list(t.shape), t.length, t.offset, f"{t.crc32c:08x}")
        for t in m.tensors]
    assert info["totals"]["tensors"] == 7
    assert info["tree"]["tensor_refs"] == 8  # the tied weight is referenced twice
    assert [k["key"] for k in info["tree"]["keys"]] == ["model", "optimizer", "epoch", "name"]


def test_inspect_names_a_distributed_checkpoints_global_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tree of a distributed checkpoint refers to its globals, not its records."""
    from hostile_support import distributed_state

    distributed_state(tmp_path / "dist")
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "dist"))
    assert rc == 0
    assert "  w: tensor w\n" in out and "  rows: tensor rows\n" in out
    assert "  w_tied: tensor w\n" in out


# ---- verify ------------------------------------------------------------------------------


def test_verify_ok(ckpt: Path, engine_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "verify", str(ckpt))
    assert rc == 0
    assert out.startswith(f"OK {ckpt}: 1 files, 7 tensors")
    rc, out, _ = run(capsys, "verify", str(ckpt), "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["problems"] == []
    assert report["bytes_checked"] == read_manifest(ckpt).tensor_bytes


def test_verify_bit_flip_names_file_and_tensor(
    ckpt: Path, engine_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    record = next(t for t in read_manifest(ckpt).tensors if t.name == "optimizer.state.1.exp_avg")
    flip_bit(ckpt / DATA, record.offset + record.length // 2, 4)
    rc, out, _ = run(capsys, "verify", str(ckpt))
    assert rc == 1
    problems = [line.strip() for line in out.splitlines()[1:]]
    assert out.startswith(f"CORRUPT {ckpt}: 1 problems")
    assert len(problems) == 1
    assert problems[0].startswith(f"{DATA}: tensor 'optimizer.state.1.exp_avg': CRC32C")

    rc, out, _ = run(capsys, "verify", str(ckpt), "--json")
    report = json.loads(out)
    assert rc == 1 and not report["ok"]
    assert "'optimizer.state.1.exp_avg'" in report["problems"][0]


def test_verify_truncated_file(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = ckpt / DATA
    os.truncate(data, data.stat().st_size - 3)
    rc, out, _ = run(capsys, "verify", str(ckpt))
    assert rc == 1
    assert f"{DATA} is truncated" in out


def test_verify_malformed_manifest_is_corruption(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (ckpt / "manifest.json").write_text("{ not json")
    rc, _, err = run(capsys, "verify", str(ckpt))
    assert rc == 1
    assert "manifest is not valid JSON" in err and "Traceback" not in err


def test_verify_missing_or_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(capsys, "verify", str(tmp_path / "nope"))
    assert (rc, out) == (2, "")
    assert err.startswith("fpctl: error: no checkpoint at") and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    rc, _, err = run(capsys, "verify", str(tmp_path / "empty"))
    assert rc == 2 and "not a committed checkpoint" in err


# ---- restore -----------------------------------------------------------------------------


def test_restore_torch_is_bit_exact(
    ckpt: Path, state: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "out.pt"
    rc, out, _ = run(capsys, "restore", str(ckpt), "--to", str(out_file))
    assert rc == 0
    assert f"-> {out_file} (torch, 7 tensors," in out
    assert not Path(str(out_file) + ".tmp").exists()
    got = torch.load(out_file, weights_only=True)
    assert list(got) == list(state)
    for key in state["model"]:
        assert same_bits(got["model"][key], state["model"][key]), key
    assert got["model"]["b"].dtype == torch.bfloat16
    assert got["model"]["tied"].data_ptr() == got["model"]["w"].data_ptr()  # still tied
    for pid in (0, 1):  # optimizer state keyed by int
        for key, t in state["optimizer"]["state"][pid].items():
            assert same_bits(got["optimizer"]["state"][pid][key], t)
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert (got["epoch"], got["name"]) == (3, "run-1")


def test_restore_safetensors_is_bit_exact(
    ckpt: Path, state: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "out.safetensors"
    rc, out, err = run(capsys, "restore", str(ckpt), "--to", str(out_file),
                       "--format", "safetensors")
    assert rc == 0, err
    assert "(safetensors, 8 tensors," in out
    got = safetensors.torch.load_file(str(out_file))
    expected = {f"model.{k}": t for k, t in state["model"].items()}
    for pid in (0, 1):
        for key, t in state["optimizer"]["state"][pid].items():
            expected[f"optimizer.state.{pid}.{key}"] = t
    assert set(got) == set(expected)
    for key, t in expected.items():
        assert same_bits(got[key], t), key
    with safetensors.safe_open(str(out_file), "pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["optimizer.param_groups"]) == state["optimizer"]["param_groups"]
    assert json.loads(metadata["epoch"]) == 3 and json.loads(metadata["name"]) == "run-1"


def test_restore_safetensors_views_and_dropped_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = torch.arange(12, dtype=torch.float32)
    st = {"base": base, "row": base.view(3, 4)[1], "col": base.view(3, 4)[:, 2],
          "dtype": torch.float16, "blob": b"\x00\x01"}
    fastpersist.save(st, tmp_path / "ck")
    rc, _, err = run(capsys, "restore", str(tmp_path / "ck"), "--to", str(tmp_path / "o.st"),
                     "--format", "safetensors")
    assert rc == 0
    got = safetensors.torch.load_file(str(tmp_path / "o.st"))
    for key in ("base", "row", "col"):
        assert torch.equal(got[key], st[key]), key
    assert "2 values have no JSON form" in err and "dtype" in err and "blob" in err


def test_restore_safetensors_reads_back_as_safetensors_own_file_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine_name: str
) -> None:
    """The engine's safetensors file holds what safetensors.save_file would: every
    dtype, 0-d and empty tensors, one larger than the engine's blocks."""
    g = torch.Generator().manual_seed(3)
    st: dict[str, Any] = {
        "big": torch.randn(5 << 20, generator=g),  # 20 MiB: several 8 MiB blocks
        "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "half": torch.randn(5, generator=g).half(),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "u8": torch.arange(11, dtype=torch.uint8),
        "i64": torch.arange(3, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "nested": {"t": torch.randn(2, 2, generator=g).t()},  # a transposed view
        "step": 12,
    }
    fastpersist.save(st, tmp_path / "ck")
    ours = tmp_path / "ours.safetensors"
    rc, _, err = run(capsys, "restore", str(tmp_path / "ck"), "--to", str(ours),
                     "--format", "safetensors")
    assert rc == 0, err
    flat = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
    flat["nested.t"] = st["nested"]["t"].contiguous()
    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(flat, str(theirs), metadata={"step": "12"})
    got, want = safetensors.torch.load_file(str(ours)), safetensors.torch.load_file(str(theirs))
    assert set(got) == set(want) == set(flat)
    for key in want:
        assert same_bits(got[key], want[key]), key
    with safetensors.safe_open(str(ours), "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "12"}
    # Data from a 4 KiB boundary (the header padded with spaces), no holes after it.
    header_len = int.from_bytes(ours.read_bytes()[:8], "little")
    assert (8 + header_len) % 4096 == 0
    assert ours.stat().st_size == 8 + header_len + sum(t.nbytes for t in flat.values())


def test_restore_onto_a_full_disk_keeps_the_old_file_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mounter = Mounter([])
    try:
        mnt = mounter.ext4(tmp_path / "mnt", tmp_path / "fs.img", 24)
        fastpersist.save({"w": torch.randn(10 << 20)}, tmp_path / "ck")  # 40 MiB
        target = mnt / "out.safetensors"
        target.write_bytes(b"the old file")
        rc, _, err = run(capsys, "restore", str(tmp_path / "ck"), "--to", str(target),
                         "--format", "safetensors", "--force")
        assert rc == 2
        assert "no space" in err.lower() and str(target) in err, err
        assert target.read_bytes() == b"the old file"
        assert sorted(p.name for p in mnt.iterdir()) == ["lost+found", "out.safetensors"]
    finally:
        mounter.unmount_all()


def test_restore_refuses_to_overwrite_without_force(
    ckpt: Path, state: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "out.pt"
    out_file.write_bytes(b"precious")
    rc, _, err = run(capsys, "restore", str(ckpt), "--to", str(out_file))
    assert rc == 2
    assert "exists; pass --force" in err and "[Errno" not in err
    assert out_file.read_bytes() == b"precious"
    rc, _, _ = run(capsys, "restore", str(ckpt), "--to", str(out_file), "--force")
    assert rc == 0
    assert same_bits(torch.load(out_file, weights_only=True)["model"]["w"], state["model"]["w"])


def test_restore_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "restore", str(tmp_path / "nope"), "--to", str(tmp_path / "o.pt"))
    assert rc == 2 and "no checkpoint at" in err
    assert not (tmp_path / "o.pt").exists() and not (tmp_path / "o.pt.tmp").exists()


# ---- gc ----------------------------------------------------------------------------------


def test_gc_removes_dead_keeps_live_and_dry_run_does_nothing(
    ckpt: Path, dead_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    root = ckpt.parent
    dead = leftover_dir(root, "step-200", "tmp", dead_pid)
    (dead / DATA).write_bytes(b"partial")
    live = leftover_dir(root, "step-300", "tmp", os.getpid())
    stale_old = leftover_dir(root, "step-100", "old", dead_pid)  # target exists: remove
    before = sorted(p.name for p in root.iterdir())

    rc, out, _ = run(capsys, "gc", str(root), "--dry-run")
    assert rc == 0
    assert sorted(p.name for p in root.iterdir()) == before
    assert f"would remove {dead.name}" in out and f"would remove {stale_old.name}" in out
    assert f"skipped {live.name}" in out

    rc, out, _ = run(capsys, "gc", str(root), "--json")
    assert rc == 0
    actions = {r["name"]: r["action"] for r in json.loads(out)}
    assert actions == {dead.name: "removed", live.name: "skipped", stale_old.name: "removed"}
    assert sorted(p.name for p in root.iterdir()) == sorted([live.name, "step-100"])
    rc, _, _ = run(capsys, "verify", str(ckpt))
    assert rc == 0


def test_gc_restores_an_old_copy_when_the_target_is_missing(
    ckpt: Path, state: dict[str, Any], dead_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # An interrupted replace: the old checkpoint was moved aside and nothing took its place.
    aside = leftover_dir(ckpt.parent, "step-100", "old", dead_pid)
    aside.rmdir()
    ckpt.rename(aside)
    rc, out, _ = run(capsys, "gc", str(ckpt.parent), "--dry-run")
    assert rc == 0 and f"would restore {ckpt} from {aside.name}" in out
    assert aside.exists() and not ckpt.exists()

    rc, out, _ = run(capsys, "gc", str(ckpt.parent))
    assert rc == 0 and f"restored {ckpt} from {aside.name}" in out
    assert not aside.exists()
    assert same_bits(fastpersist.load(ckpt)["model"]["w"], state["model"]["w"])


def test_gc_on_a_clean_root(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "gc", str(ckpt.parent))
    assert rc == 0 and out.startswith("nothing to clean")


# ---- the installed script ----------------------------------------------------------------


def test_console_script_reports_corruption(ckpt: Path) -> None:
    # One subprocess only: starting Python and importing torch dominates the suite.
    fpctl = shutil.which("fpctl", path=os.path.dirname(sys.executable)) or shutil.which("fpctl")
    assert fpctl is not None, "the fpctl console script is not installed"
    record = read_manifest(ckpt).tensors[0]
    flip_bit(ckpt / DATA, record.offset, 4)
    proc = subprocess.run([fpctl, "verify", str(ckpt)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert f"{DATA}: tensor {record.name!r}: CRC32C" in proc.stdout


def test_python_dash_m(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["fpctl", "verify", str(ckpt)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("fastpersist.cli", run_name="__main__")
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("OK ")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"fpctl {fastpersist.__version__}"
