"""CUDA tensors through the single-file formats and the partial readers (issue 36):
save from the GPU to .safetensors / .pt / a file object, load back to the GPU
with a device string, a dict and a callable map_location, and open()'s
get_tensor/get_slice onto the GPU. Skipped entirely without a GPU.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import safetensors.torch
import torch

import fastpersist

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

DEV = torch.device("cuda", 0)


def gpu_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(7)
    return {
        "w": torch.randn(257, 33, device=DEV, generator=g),
        "b": torch.randn(33, device=DEV, generator=g).to(torch.bfloat16),
        "i": torch.arange(1000, device=DEV, dtype=torch.int64),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                device: torch.device) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].device == device, k
        assert got[k].dtype == v.dtype and torch.equal(got[k].cpu(), v.cpu()), k


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_gpu_state_saved_to_a_single_file_loads_back_to_the_gpu(tmp_path: Path,
                                                                   suffix: str) -> None:
    state = gpu_state()
    path = tmp_path / f"model{suffix}"
    fastpersist.save(state, path)
    assert path.is_file()
    assert_same(fastpersist.load(path, map_location="cuda:0"), state, DEV)
    assert_same(fastpersist.load(path, map_location="cpu"), state, torch.device("cpu"))


def test_a_safetensors_file_saved_from_the_gpu_is_standard(tmp_path: Path) -> None:
    state = gpu_state()
    fastpersist.save(state, tmp_path / "m.safetensors")
    theirs = safetensors.torch.load_file(str(tmp_path / "m.safetensors"), device="cuda:0")
    assert_same(theirs, state, DEV)


def test_a_pt_file_saved_from_the_gpu_keeps_torch_load_semantics(tmp_path: Path) -> None:
    """torch.load of a .pt written from CUDA tensors puts them back on CUDA, as
    torch.save's own file would."""
    state = gpu_state()
    fastpersist.save(state, tmp_path / "m.pt")
    assert_same(torch.load(tmp_path / "m.pt", weights_only=True), state, DEV)


def test_a_callable_map_location_places_on_the_gpu(tmp_path: Path) -> None:
    state = {k: v.cpu() for k, v in gpu_state().items()}
    fastpersist.save(state, tmp_path / "ckpt")
    seen: list[str] = []

    def to_gpu(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage.cuda(0)

    assert_same(fastpersist.load(tmp_path / "ckpt", map_location=to_gpu), state, DEV)
    assert seen and set(seen) == {"cpu"}


def test_file_objects_round_trip_a_gpu_state() -> None:
    state = gpu_state()
    buf = io.BytesIO()
    fastpersist.save(state, buf)
    buf.seek(0)
    assert_same(fastpersist.load(buf, map_location="cuda:0"), state, DEV)


def test_open_reads_a_slice_onto_the_gpu(tmp_path: Path) -> None:
    state = gpu_state()
    fastpersist.save(state, tmp_path / "ckpt")
    with fastpersist.open(tmp_path / "ckpt", map_location="cuda:0") as f:
        rows = f.get_slice("w")[10:20]
        whole = f.get_tensor("i")
    assert rows.device == DEV and torch.equal(rows, state["w"][10:20])
    assert whole.device == DEV and torch.equal(whole, state["i"])

