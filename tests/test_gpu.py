"""Device mapping on a real GPU: load onto cuda:0, remap cuda -> cpu. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import ckpttool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def gpu_saved(tmp_path):
    """A state dict saved from cuda:0 tensors, as a GPU training run writes it."""
    sd = {
        "module.w": torch.randn(4, 3, device="cuda:0"),
        "module.b": torch.arange(3.0, device="cuda:0"),
    }
    path = tmp_path / "gpu.pt"
    torch.save(sd, path)
    return path, {k.removeprefix("module."): v.cpu() for k, v in sd.items()}


def test_inspect_reports_the_saved_device(gpu_saved):
    path, _ = gpu_saved
    ckpt = ckpttool.read(path)
    assert {ref.device for ref in ckpttool.flatten_tensors(ckpt.root).values()} == {"cuda:0"}


def test_load_defaults_to_cpu_and_remaps(gpu_saved):
    path, expected = gpu_saved
    on_cpu = ckpttool.load(path)
    assert all(t.device.type == "cpu" for t in on_cpu.values())
    remapped = ckpttool.load(path, map_location={"cuda:0": "cpu"})
    for name, tensor in expected.items():
        assert torch.equal(on_cpu[name], tensor)
        assert torch.equal(remapped[name], tensor)


def test_load_onto_cuda(gpu_saved):
    path, expected = gpu_saved
    on_gpu = ckpttool.load(path, map_location="cuda:0")
    for name, tensor in expected.items():
        assert on_gpu[name].device == torch.device("cuda:0")
        assert torch.equal(on_gpu[name].cpu(), tensor)
    kept = ckpttool.load(path, map_location=None)  # torch.load semantics: stay where saved
    assert all(t.device == torch.device("cuda:0") for t in kept.values())


def test_convert_pt_with_map_location_loads_on_gpu(gpu_saved, tmp_path):
    from ckpttool.convert import convert

    path, expected = gpu_saved
    out = tmp_path / "out.pt"
    convert([str(path)], "pt", str(out), map_location="cuda:0")
    loaded = torch.load(out, weights_only=True)
    for name, tensor in expected.items():
        assert loaded[name].device == torch.device("cuda:0")
        assert torch.equal(loaded[name].cpu(), tensor)
