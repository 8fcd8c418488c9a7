"""The DCP adapter and every save at their edges (issue 33, items 6-11):

6  dcp.load runs no code from checkpoint bytes unless allow_pickle=True;
7  a staged tensor that DCP stores as torch.save bytes (in a tuple) carries
   only its own bytes, never the staging buffer's (another checkpoint's);
8  dcp.async_save takes dict subclasses (defaultdict, OrderedDict, others);
9  a checkpoint name of 255 bytes saves (the staging name is shortened);
10 a path that is a symbolic link to a directory is saved through;
11 FileSystemWriter's and FileSystemReader's arguments are accepted.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fastpersist
from fastpersist import PickleNotAllowedError
from fastpersist.integrations.dcp import FastPersistReader, FastPersistStager, FastPersistWriter
from fastpersist.saving.staging import StagingPool
from fastpersist.storage.commit import find_leftovers
from fastpersist.storage.leftovers import leftover_name, parse_leftover, shortened

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def save(sd: dict[str, Any], path: Path, **kw: Any) -> None:
    dcp.save(sd, storage_writer=FastPersistWriter(path, **kw))


def load(sd: dict[str, Any], path: Path, **kw: Any) -> dict[str, Any]:
    dcp.load(sd, storage_reader=FastPersistReader(path, **kw))
    return sd


def cause(exc: BaseException) -> str:
    """DCP wraps a rank's error in CheckpointException; its text names ours."""
    return str(exc)


# -- 6: no code from the checkpoint ------------------------------------------------------------


class Boom:
    """Unpickling it would run os.system: what a malicious checkpoint ships."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/fastpersist-dcp-pwned",))


def test_load_refuses_pickled_code_naming_the_item(tmp_path: Path) -> None:
    marker = Path("/tmp/fastpersist-dcp-pwned")
    marker.unlink(missing_ok=True)
    path = tmp_path / "ckpt"
    save({"w": torch.ones(4), "evil": Boom()}, path)  # saving only pickles; nothing runs
    assert not marker.exists()
    with pytest.raises(CheckpointException) as info:
        load({"w": torch.zeros(4), "evil": None}, path)
    assert "PickleNotAllowedError" in cause(info.value) and "'evil'" in cause(info.value)
    assert "allow_pickle=True" in cause(info.value)
    assert not marker.exists(), "loading ran code from the checkpoint"
    # Opting in runs it, as FileSystemReader always does.
    load({"w": torch.zeros(4), "evil": None}, path, allow_pickle=True)
    assert marker.exists()
    marker.unlink()


def test_weights_only_safe_bytes_load_by_default(tmp_path: Path) -> None:
    """Values DCP stores as bytes that torch's restricted unpickler takes
    (numbers, strings, tuples of tensors) load without opting in."""
    path = tmp_path / "ckpt"
    saved = {"step": 7, "name": "run", "pair": (torch.arange(3), 2.5), "lst": [1, "a"]}
    save(saved, path)
    got = load({"step": 0, "name": "", "pair": None, "lst": None}, path)
    assert got["step"] == 7 and got["name"] == "run" and got["lst"] == [1, "a"]
    assert torch.equal(got["pair"][0], torch.arange(3)) and got["pair"][1] == 2.5


def test_the_check_refuses_directly(tmp_path: Path) -> None:
    from fastpersist.integrations.dcp.reader import _check_weights_only

    raw = io.BytesIO()
    torch.save(Boom(), raw)
    with pytest.raises(PickleNotAllowedError, match="'x'"):
        _check_weights_only(bytearray(raw.getvalue()), "x", str(tmp_path))


# -- 7: no bytes of another checkpoint ----------------------------------------------------------


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def _file_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.iterdir()) if p.is_file())


def test_tensors_in_tuples_carry_only_their_own_bytes(tmp_path: Path) -> None:
    """The first save fills a staging buffer with a distinctive pattern; the
    second, of a small tuple and namedtuple, reuses that buffer. None of the
    pattern may appear in the second checkpoint, and its bytes items must be
    about the size of their tensors, not of the buffer."""
    # A pool of its own: the process's shared pool would keep this test's 16 MiB
    # buffer for the next test, whose accounting of reuse it would upset.
    stager = FastPersistStager(pool=StagingPool())
    pattern = torch.full((4 << 20,), 0x5A5A5A5A, dtype=torch.int32)  # 16 MiB of 0x5A
    first = {"big": pattern, "t": (torch.full((4,), 0x5A5A5A5A, dtype=torch.int32),)}
    dcp.async_save(first, storage_writer=FastPersistWriter(tmp_path / "one", stager=stager)
                   ).result()
    second = {"tup": (torch.arange(4, dtype=torch.int32), 3),
              "nt": Pair(torch.ones(2), torch.zeros(2)),
              "big": torch.zeros(4 << 20, dtype=torch.int32)}
    dcp.async_save(second, storage_writer=FastPersistWriter(tmp_path / "two", stager=stager)
                   ).result()
    data = _file_bytes(tmp_path / "two")
    runs = re.findall(rb"(?:\x5a){4096}", data)
    assert not runs, f"checkpoint two holds {len(runs)} 4-KiB runs of checkpoint one's data"
    from fastpersist.tensors.committed import read_manifest

    byte_items = [t for t in read_manifest(tmp_path / "two").tensors
                  if t.length < (1 << 20) and t.dtype == "U8"]
    assert byte_items, "no bytes item found"
    assert max(t.length for t in byte_items) < 64 << 10, [t.length for t in byte_items]
    got = load({"tup": None, "nt": None, "big": torch.empty(4 << 20, dtype=torch.int32)},
               tmp_path / "two", allow_pickle=True)
    assert torch.equal(got["tup"][0], torch.arange(4, dtype=torch.int32))
    assert torch.equal(got["nt"][0], torch.ones(2))


# -- 8: dict subclasses -------------------------------------------------------------------------


class MyDict(dict):  # type: ignore[type-arg]
    def __init__(self, tag: str) -> None:  # not a dict's signature
        super().__init__()
        self.tag = tag


@pytest.mark.parametrize("kind", ["defaultdict", "OrderedDict", "subclass"])
def test_async_save_of_dict_subclasses(tmp_path: Path, kind: str) -> None:
    inner: dict[str, Any]
    if kind == "defaultdict":
        inner = collections.defaultdict(list)
    elif kind == "OrderedDict":
        inner = collections.OrderedDict()
    else:
        inner = MyDict("x")
    inner["w"] = torch.arange(6.0)
    stager = FastPersistStager()
    staged = stager.stage({"opt": inner})
    assert type(staged["opt"]) is type(inner)
    if kind == "defaultdict":
        assert staged["opt"].default_factory is list  # type: ignore[attr-defined]
    if kind == "subclass":
        assert staged["opt"].tag == "x"
    dcp.async_save({"opt": inner}, storage_writer=FastPersistWriter(tmp_path / kind)).result()
    got = load({"opt": {"w": torch.zeros(6)}}, tmp_path / kind)
    assert torch.equal(got["opt"]["w"], torch.arange(6.0))


# -- 9: long names ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["save", "async_save", "dcp"])
def test_a_255_byte_name_saves(tmp_path: Path, how: str) -> None:
    name = "c" * 250 + "-é"  # 253 bytes in UTF-8
    name = name + "x" * (255 - len(name.encode()))
    assert len(name.encode()) == 255
    target = tmp_path / name
    state = {"w": torch.arange(10.0)}
    if how == "save":
        fastpersist.save(state, target)
    elif how == "async_save":
        fastpersist.async_save(state, target).result()
    else:
        save(state, target)
    if how == "dcp":
        assert torch.equal(load({"w": torch.zeros(10)}, target)["w"], state["w"])
    else:
        assert torch.equal(fastpersist.load(target)["w"], state["w"])
    assert not find_leftovers(target.parent)


def test_a_shortened_leftover_is_still_recognised(tmp_path: Path) -> None:
    name = "n" * 255
    tmp = leftover_name(name, "tmp")
    assert len(tmp.encode()) <= 255
    (tmp_path / tmp).mkdir()
    lo = parse_leftover(tmp_path / tmp)
    assert lo is not None and lo.kind == "tmp" and lo.pid == os.getpid()
    assert lo.is_for(name) and not lo.is_for("n" * 254)
    assert lo.target_name == shortened(name)
    short = leftover_name("step-1", "tmp")  # short names are carried whole, as before
    assert short.startswith(".step-1.fp-tmp-")


def test_a_long_name_is_refused_where_it_must_be_carried_whole(tmp_path: Path) -> None:
    """gc puts an "old" copy back under its name: that name is never shortened."""
    assert leftover_name("o" * 255, "old").startswith("." + "o" * 255)


# -- 10: through a link -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["save", "dcp"])
def test_a_link_to_a_checkpoint_is_saved_through(tmp_path: Path, how: str) -> None:
    real = tmp_path / "step-1"
    link = tmp_path / "latest"
    first, second = {"w": torch.zeros(3)}, {"w": torch.arange(3.0)}
    if how == "save":
        fastpersist.save(first, real)
    else:
        save(first, real)
    link.symlink_to(real.name, target_is_directory=True)
    if how == "save":
        fastpersist.save(second, link)
        assert torch.equal(fastpersist.load(real)["w"], second["w"])
    else:
        save(second, link)
        assert torch.equal(load({"w": torch.zeros(3)}, real)["w"], second["w"])
    assert link.is_symlink() and os.readlink(link) == real.name
    assert not find_leftovers(tmp_path)


def test_a_link_to_an_empty_directory_elsewhere_is_saved_through(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    real = tmp_path / "disk" / "ckpt"
    real.mkdir()
    link = tmp_path / "ckpt"
    link.symlink_to(real, target_is_directory=True)
    save({"w": torch.arange(5.0)}, link)
    assert (real / "manifest.json").is_file() and link.is_symlink()
    assert torch.equal(load({"w": torch.zeros(5)}, link)["w"], torch.arange(5.0))


def test_a_link_to_a_file_or_nowhere_is_still_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "to-file").symlink_to("file")
    (tmp_path / "dangling").symlink_to("nowhere")
    for name in ("to-file", "dangling"):
        with pytest.raises(fastpersist.CheckpointExistsError):
            fastpersist.save({"w": torch.ones(1)}, tmp_path / name)
    assert (tmp_path / "file").read_text() == "x"


# -- 11: FileSystemWriter's and FileSystemReader's arguments ---------------------------------


def test_filesystem_writer_arguments_are_accepted(tmp_path: Path) -> None:
    sd = {"w": torch.arange(8.0)}
    for cls_args in ((), (False, False, 4, 1 << 20, True, True)):
        path = tmp_path / f"a{len(cls_args)}"
        dcp.save(sd, storage_writer=FastPersistWriter(path, *cls_args))
        assert torch.equal(load({"w": torch.zeros(8)}, path)["w"], sd["w"])
    path = tmp_path / "kw"
    writer = FastPersistWriter(path, single_file_per_rank=False, sync_files=False,
                               thread_count=8, per_thread_copy_ahead=0,
                               cache_staged_state_dict=True, overwrite=False,
                               serialization_format=None)
    dcp.save(sd, storage_writer=writer)
    reader = FastPersistReader(path, _extension_registry=None)
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], sd["w"])
    with pytest.raises(ValueError, match="_extensions"):
        FastPersistWriter(tmp_path / "x", _extensions=[object()])
    pickle.loads(pickle.dumps(writer))  # still picklable (the process executor)


def test_switching_the_class_name_is_the_only_change(tmp_path: Path) -> None:
    """The same call with FileSystemWriter's keywords, spelled as torch's tests spell them."""
    sd = {"w": torch.arange(8.0)}
    kwargs = {"single_file_per_rank": True, "sync_files": True, "thread_count": 2,
              "per_thread_copy_ahead": 10_000_000, "overwrite": True}
    for cls in (dcp.FileSystemWriter, FastPersistWriter):
        path = tmp_path / cls.__name__
        dcp.save(sd, storage_writer=cls(path, **kwargs))  # type: ignore[arg-type]
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "FastPersistWriter"))
    assert torch.equal(out["w"], sd["w"])
