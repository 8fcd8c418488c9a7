"""load(path, into=state): the checkpoint's tensors land in the caller's tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_same_state, flip_bit

import fastpersist
from fastpersist.tensors import checkpoint, read_into, source


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.LayerNorm(300),
                               torch.nn.Linear(300, 5))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The record indices each load read straight into the caller's tensors."""
    calls: list[list[int]] = []
    real = read_into.read_into

    def spy(path: Path, manifest: Any, engine: Any, dests: Any, **kw: Any) -> None:
        calls.append(sorted(dests))
        real(path, manifest, engine, dests, **kw)

    monkeypatch.setattr(read_into, "read_into", spy)
    return calls


def test_a_model_and_optimizer_resume_in_their_own_memory(
        tmp_path: Path, direct_reads: list[list[int]]) -> None:
    model, opt = _trained(0)
    fastpersist.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 12},
                     tmp_path / "ckpt")
    new_model, new_opt = _trained(1)  # other values, the same shapes, optimizer state made
    into = {"model": new_model.state_dict(), "optim": new_opt.state_dict()}
    addresses = {k: v.data_ptr() for k, v in new_model.state_dict().items()}
    seen: list[int] = []

    loaded = fastpersist.load(tmp_path / "ckpt", into=into, progress=seen.append)

    assert loaded["step"] == 12
    for k, v in loaded["model"].items():
        assert v is into["model"][k]  # the caller's tensor objects, in place
        assert v.data_ptr() == addresses[k]
    assert_same_state(model.state_dict(), new_model.state_dict())
    new_opt.load_state_dict(loaded["optim"])
    assert_same_state(opt.state_dict(), new_opt.state_dict())
    manifest = checkpoint.read_manifest(tmp_path / "ckpt")
    assert sum(seen) == manifest.tensor_bytes
    # Every tensor was read straight into its place: none loaded anew and copied.
    assert direct_reads == [list(range(len(manifest.tensors)))]


def test_into_reads_and_returns_only_the_part_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """into={"model": ...} of a model-and-optimizer checkpoint: the engine
    reads no byte of the optimizer's records, and the loaded object is the
    checkpoint's tree without them (plain values, read with the manifest,
    stay)."""
    model, opt = _trained(0)
    fastpersist.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3},
                     tmp_path / "c")
    manifest = checkpoint.read_manifest(tmp_path / "c")
    reads: list[tuple[str, int, int]] = []
    real = source.get_engine

    class Counting:
        def __init__(self) -> None:
            self.engine = real()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.engine, name)

        def read_file(self, path: str, segments: Any, **kwargs: Any) -> Any:
            reads.extend((Path(path).name, seg[1], memoryview(seg[0]).nbytes if seg[0] is not None
                          else seg[2]) for seg in segments)
            return self.engine.read_file(path, segments, **kwargs)

    monkeypatch.setattr(source, "get_engine", Counting)
    fresh = _model(1)
    seen: list[int] = []
    loaded = fastpersist.load(tmp_path / "c", into={"model": fresh.state_dict()},
                              progress=seen.append)
    assert_same_state(model.state_dict(), fresh.state_dict())
    model_records = [r for r in manifest.tensors if r.name.startswith("model.")]
    assert sum(seen) == sum(r.length for r in model_records) > 0
    read_records = {r.name for r in manifest.tensors for name, off, n in reads
                    if name == r.file and off < r.offset + r.length and r.offset < off + n}
    assert read_records == {r.name for r in model_records}
    assert set(loaded) == {"model", "step"} and loaded["step"] == 3
    # A fresh optimizer has no state to name: its part of the checkpoint is loaded whole.
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    loaded = fastpersist.load(tmp_path / "c", into={"model": fresh.state_dict(),
                                                    "optim": fresh_opt.state_dict()})
    assert_same_state(opt.state_dict(), loaded["optim"])


def test_several_files_and_a_torn_read_order(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(64 << 10))
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(40)}
    fastpersist.save(state, tmp_path / "c")
    assert len(checkpoint.read_manifest(tmp_path / "c").files) > 4
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    loaded = fastpersist.load(tmp_path / "c", into=into)
    assert_same_state(state, into)
    assert all(loaded[k] is into[k] for k in state)


def test_a_partial_into_reads_only_its_tensors_in_place(tmp_path: Path,
                                                        direct_reads: list[list[int]]) -> None:
    """Every other tensor in `into` (too sparse for one region): the rest are
    neither read nor returned."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(5000, generator=g) for i in range(10)}
    fastpersist.save(state, tmp_path / "c")
    into = {k: torch.zeros(5000) for k in list(state)[::2]}
    loaded = fastpersist.load(tmp_path / "c", into=into)
    assert_same_state({k: state[k] for k in into}, loaded)
    assert all(loaded[k] is into[k] for k in into)
    assert len(direct_reads[0]) == 5


def test_conversions_views_ties_and_parameters(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 16, generator=g)
    saved = {
        "fp32": torch.randn(10, 3, generator=g),  # into bfloat16: converted
        "transposed": torch.randn(6, 4, generator=g),  # into a non-contiguous tensor
        "base": base, "view": base[2:5],  # views of one storage: copied into place
        "tied_a": base, "tied_b": base,
        "param": torch.nn.Parameter(torch.randn(5, generator=g)),
        "zero_d": torch.tensor(3.5), "empty": torch.zeros(0, 4),
        "small_int": torch.arange(7, dtype=torch.int16),
        "compressed_later": torch.randn(4, generator=g),
    }
    fastpersist.save(saved, tmp_path / "c")
    shared = torch.zeros(8, 16)
    into = {
        "fp32": torch.zeros(10, 3, dtype=torch.bfloat16),
        "transposed": torch.zeros(4, 6).t(),
        "base": torch.zeros(8, 16), "view": torch.zeros(3, 16),
        "tied_a": shared, "tied_b": shared,
        "param": torch.nn.Parameter(torch.zeros(5)),
        "zero_d": torch.tensor(0.0), "empty": torch.zeros(0, 4),
        "small_int": torch.zeros(7, dtype=torch.int16),
    }
    before = {k: id(v) for k, v in into.items()}
    loaded = fastpersist.load(tmp_path / "c", into=into)
    assert {k: id(loaded[k]) for k in into} == before
    assert into["fp32"].dtype == torch.bfloat16
    assert torch.equal(into["fp32"], saved["fp32"].bfloat16())
    for k in ("transposed", "base", "view", "tied_a", "param", "zero_d", "small_int"):
        assert torch.equal(into[k], saved[k].detach()), k
    assert into["param"].requires_grad and isinstance(loaded["param"], torch.nn.Parameter)
    assert "compressed_later" not in loaded  # into= names it not: neither read nor returned


def test_a_compressed_checkpoint_is_copied_into_place(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 200, generator=g).bfloat16(), "b": torch.zeros(200)}
    fastpersist.save(state, tmp_path / "c", compression="zstd")
    into = {"w": torch.zeros(300, 200, dtype=torch.bfloat16), "b": torch.ones(200)}
    loaded = fastpersist.load(tmp_path / "c", into=into)
    assert_same_state(state, into)
    assert loaded["w"] is into["w"]


def test_a_shape_mismatch_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    fastpersist.save({"a": torch.ones(4, 8), "b": torch.ones(3)}, tmp_path / "c")
    into = {"a": torch.zeros(8, 4), "b": torch.zeros(3)}
    with pytest.raises(fastpersist.StateMismatchError, match=r"a is \[4, 8\] in the checkpoint, "
                       r"\[8, 4\] in `into`"):
        fastpersist.load(tmp_path / "c", into=into)
    assert not into["a"].any() and not into["b"].any()


def test_a_meta_or_sparse_destination_is_refused(tmp_path: Path) -> None:
    """A model built on the meta device has no memory: nothing would land."""
    fastpersist.save({"a": torch.ones(2, 3), "b": torch.ones(3)}, tmp_path / "c")
    with pytest.raises(fastpersist.StateMismatchError, match=r"a in `into` is a torch\.strided "
                       r"tensor on meta, which has no memory"):
        fastpersist.load(tmp_path / "c", into={"a": torch.empty(2, 3, device="meta")})
    with pytest.raises(fastpersist.StateMismatchError, match=r"b in `into` is a torch\.sparse_coo"):
        fastpersist.load(tmp_path / "c", into={"b": torch.zeros(3).to_sparse()})


def test_a_tensor_the_checkpoint_lacks_is_refused(tmp_path: Path) -> None:
    fastpersist.save({"model": {"w": torch.ones(3)}, "step": 1}, tmp_path / "c")
    into: dict[str, Any] = {"model": {"w": torch.zeros(3), "extra": torch.zeros(2)},
                            "step": torch.zeros(1), "lr": 0.1}
    with pytest.raises(fastpersist.StateMismatchError) as info:
        fastpersist.load(tmp_path / "c", into=into)
    assert "model.extra" in str(info.value) and "step" in str(info.value)
    assert not into["model"]["w"].any()
    # A list where the checkpoint has a dict: nothing of it pairs.
    with pytest.raises(fastpersist.StateMismatchError, match="checkpoint does not: 0;"):
        fastpersist.load(tmp_path / "c", into=[torch.zeros(3)])


def test_int_keys_lists_and_nested_containers(tmp_path: Path) -> None:
    state = {"state": {0: {"exp_avg": torch.ones(3)}, 1: {"exp_avg": torch.full((2,), 2.0)}},
             "layers": [torch.ones(2), (torch.full((1,), 5.0), "x")]}
    fastpersist.save(state, tmp_path / "c")
    into = {"state": {0: {"exp_avg": torch.zeros(3)}, 1: {"exp_avg": torch.zeros(2)}},
            "layers": [torch.zeros(2), (torch.zeros(1),)]}
    fastpersist.load(tmp_path / "c", into=into)
    assert_same_state(state["state"], into["state"])
    assert into["layers"][1][0].item() == 5.0 and into["layers"][0].sum() == 2


def test_a_corrupt_tensor_is_named_and_raises(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(100_000, generator=g), "b": torch.randn(50, generator=g)}
    fastpersist.save(state, tmp_path / "c")
    manifest = checkpoint.read_manifest(tmp_path / "c")
    rec = next(t for t in manifest.tensors if t.name == "a")
    flip_bit(tmp_path / "c" / rec.file, rec.offset + 4000)
    into = {"a": torch.zeros(100_000), "b": torch.zeros(50)}
    with pytest.raises(fastpersist.ChecksumMismatchError, match="tensor 'a'"):
        fastpersist.load(tmp_path / "c", into=into)
    # Unverified, the damaged bytes load (as without into).
    fastpersist.load(tmp_path / "c", into=into, verify=False)
    assert torch.equal(into["b"], state["b"]) and not torch.equal(into["a"], state["a"])


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    fastpersist.save({"a": torch.randn(100_000)}, tmp_path / "c")
    f = next((tmp_path / "c").glob("data-*"))
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 4096)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="truncated"):
        fastpersist.load(tmp_path / "c", into={"a": torch.zeros(100_000)})


def test_overlapping_destinations_are_not_read_in_place(tmp_path: Path,
                                                        direct_reads: list[list[int]]) -> None:
    fastpersist.save({"a": torch.ones(8), "b": torch.full((4,), 2.0), "c": torch.ones(3)},
                     tmp_path / "c")
    mem = torch.zeros(10)
    into = {"a": mem[:8], "b": mem[6:], "c": torch.zeros(3)}  # a and b share two elements
    fastpersist.load(tmp_path / "c", into=into)
    assert direct_reads == [[checkpoint.read_manifest(tmp_path / "c").tensors.index(
        next(t for t in checkpoint.read_manifest(tmp_path / "c").tensors if t.name == "c"))]]
    assert torch.equal(into["c"], torch.ones(3))
    assert torch.equal(mem[6:], torch.full((4,), 2.0)) or torch.equal(mem[:8], torch.ones(8))


def test_into_and_like_together_are_refused(tmp_path: Path) -> None:
    fastpersist.save({"a": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(TypeError, match="not both"):
        fastpersist.load(tmp_path / "c", into={"a": torch.zeros(2)}, like={"a": torch.zeros(2)})


def test_checkpointer_load_latest_into(tmp_path: Path) -> None:
    model, _ = _trained(0)
    ckpt = fastpersist.Checkpointer(tmp_path / "run")
    ckpt.save(3, {"model": model.state_dict()})
    ckpt.close()
    fresh = _model(5)
    fastpersist.Checkpointer(tmp_path / "run").load_latest(into={"model": fresh.state_dict()})
    assert_same_state(model.state_dict(), fresh.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_destinations_get_the_values(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1000, 10, generator=g), "b": torch.randn(10, generator=g)}
    fastpersist.save(state, tmp_path / "c")
    into = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
    loaded = fastpersist.load(tmp_path / "c", into=into)
    assert loaded["w"] is into["w"] and loaded["w"].is_cuda
    assert_same_state(state, {k: v.cpu() for k, v in into.items()})
