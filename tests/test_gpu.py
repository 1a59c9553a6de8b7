"""Device mapping on a real GPU: load onto cuda:0, remap cuda -> cpu. Skipped without CUDA."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import assert_identical
from safetensors.torch import load_file, save_file
from test_properties import DTYPES as PROPERTY_DTYPES
from test_properties import random_bits

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
    from ckpttool.convert import convert  # --to pt output

    path, expected = gpu_saved
    out = tmp_path / "out.pt"
    convert([str(path)], "pt", str(out), map_location="cuda:0")
    loaded = torch.load(out, weights_only=True)
    for name, tensor in expected.items():
        assert loaded[name].device == torch.device("cuda:0")
        assert torch.equal(loaded[name].cpu(), tensor)


# ------------------------------------------ every dtype, bitwise, against torch's own loaders

# every dtype the property tests draw from, and a complex one (torch-zip and safetensors)
DTYPES = [*PROPERTY_DTYPES, torch.complex64]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator):
    """Random bits of ``dtype`` (NaNs and infinities included; bool only 0 and 1)."""
    return random_bits(dtype, math.prod(shape), g).reshape(shape)


def on_gpu(tensors: dict) -> dict:
    return {k: v.to("cuda:0") for k, v in tensors.items()}


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    """One tensor of each dtype, plus views, a tied pair, a scalar and an empty tensor,
    saved with torch.save (views kept) and with safetensors (contiguous copies)."""
    g = torch.Generator().manual_seed(0)
    sd = {str(d).removeprefix("torch."): random_tensor(d, (37, 11), g) for d in DTYPES}
    base = random_tensor(torch.float32, (64, 48), g)
    sd |= {
        "base": base,
        "tied": base,
        "transposed": base.t(),
        "rows": base[5:9],
        "columns": base[:, 3:7],
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
    }
    folder = tmp_path_factory.mktemp("every_dtype")
    torch.save(sd, folder / "sd.pt")
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, folder / "sd.safetensors")
    return folder


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors"])
def test_load_onto_cuda_equals_the_baseline_loader_bitwise(every_dtype, fmt, mmap):
    if fmt == "torch-zip":
        path = every_dtype / "sd.pt"
        want = torch.load(path, map_location="cuda:0", weights_only=True)
    else:
        path = every_dtype / "sd.safetensors"
        want = load_file(path, device="cuda:0")
    got = ckpttool.load(path, map_location="cuda:0", mmap=mmap)
    assert list(got) == list(want)
    assert_identical(got, want, exact_types=False)
    assert {t.device for t in got.values()} == {torch.device("cuda:0")}
    if fmt == "torch-zip":  # views and ties as torch.load makes them: one storage, same strides
        assert all(got[k].stride() == want[k].stride() for k in want)
        assert all(got[k].storage_offset() == want[k].storage_offset() for k in want)
        shared = {got[k].untyped_storage().data_ptr() for k in ("base", "tied", "rows")}
        assert shared == {got["columns"].untyped_storage().data_ptr()}


@pytest.mark.parametrize(
    "map_location",
    ["cuda", torch.device("cuda:0"), {"cpu": "cuda:0"}, lambda storage, loc: storage.cuda(0)],
    ids=["cuda", "torch.device", "dict", "callable"],
)
def test_every_spelling_of_a_cuda_target(every_dtype, map_location):
    path = every_dtype / "sd.pt"
    want = torch.load(path, map_location=map_location, weights_only=True)
    got = ckpttool.load(path, map_location=map_location)
    assert_identical(got, want, exact_types=False)
    assert {t.device for t in got.values()} == {torch.device("cuda:0")}


@pytest.mark.parametrize("threads", [4, 1], ids=["reader-threads", "caller-reads"])
def test_tensors_larger_than_all_staging_buffers_together(tmp_path, monkeypatch, threads):
    """Real buffer sizes: tensors of 1.5 buffers each, more of them than buffers, with small
    ones between, so that every buffer is reused while copies out of it may be in flight."""
    import ckpttool.tensors.direct as fastload
    from ckpttool.tensors.direct import STAGING_BUFFERS, STAGING_BYTES

    monkeypatch.setattr(fastload, "READ_THREADS", threads)
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i in range(STAGING_BUFFERS + 1):
        sd[f"big{i}"] = random_tensor(torch.int32, (STAGING_BYTES * 3 // 8 + 7 * i,), g)
        sd[f"small{i}"] = random_tensor(torch.bfloat16, (3, 5 + i), g)
    torch.save(sd, tmp_path / "big.pt")
    save_file(sd, tmp_path / "big.safetensors")
    for path in (tmp_path / "big.pt", tmp_path / "big.safetensors"):
        got = ckpttool.load(path, map_location="cuda:0")
        assert_identical(got, on_gpu(sd), ordered=False, exact_types=False)
        target = {k: torch.full_like(v, 1, device="cuda:0") for k, v in sd.items()}
        assert ckpttool.load_into(target, path) == ([], [])  # type: ignore[comparison-overlap]
        assert_identical(target, on_gpu(sd), exact_types=False)


def test_load_on_a_side_stream_is_ready_on_that_stream(every_dtype):
    """Tensors handed out are whole for work queued on the caller's current stream."""
    path = every_dtype / "sd.safetensors"
    want = load_file(path, device="cuda:0")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = ckpttool.load(path, map_location="cuda:0")
        copies = {k: v.clone() for k, v in got.items()}  # queued on `side`, no sync
    side.synchronize()
    assert_identical(copies, want, exact_types=False)


class Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(48, 64)
        self.b = torch.nn.Linear(64, 48, bias=False)
        self.b.weight = torch.nn.Parameter(torch.empty(48, 64).t().contiguous().t())
        self.register_buffer("count", torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors"])
def test_load_into_a_cuda_model_casts_and_fills_strided_parameters(tmp_path, fmt):
    """As load_state_dict: fp32 weights into a bf16 model, a transposed parameter kept
    transposed, an int64 buffer; the result equals load_state_dict's bitwise."""
    torch.manual_seed(0)
    source = Mixed()
    source.count += 7
    sd = {k: v.contiguous() for k, v in source.state_dict().items()}
    path = tmp_path / ("m.safetensors" if fmt == "safetensors" else "m.pt")
    save_file(sd, path) if fmt == "safetensors" else torch.save(sd, path)
    want = Mixed().to("cuda:0", torch.bfloat16)
    want.load_state_dict(torch.load(path, weights_only=True) if fmt == "torch-zip" else sd)
    got = Mixed().to("cuda:0", torch.bfloat16)
    stride = got.b.weight.stride()
    assert ckpttool.load_into(got, path) == ([], [])  # type: ignore[comparison-overlap]
    assert got.b.weight.stride() == stride and got.a.weight.dtype == torch.bfloat16
    assert_identical(got.state_dict(), want.state_dict(), exact_types=False)


@pytest.mark.slow
def test_sharded_checkpoints_onto_cuda(dist_runs, dist_reference):
    """DCP chunks and ShardedTensor rank files merged straight on the GPU; get_slice across
    a shard boundary reads onto the GPU too."""
    full = dist_reference["two"]["model"]
    for source in (dist_runs.two / "dcp", str(dist_runs.two / "ep0-ba1-rank*.pt")):
        got = ckpttool.load(source, map_location="cuda:0")
        assert_identical(got, on_gpu(full), ordered=False, exact_types=False)
        target = {k: torch.zeros_like(v, device="cuda:0") for k, v in full.items()}
        assert ckpttool.load_into(target, source) == ([], [])  # type: ignore[comparison-overlap]
        assert_identical(target, on_gpu(full), ordered=False, exact_types=False)
    name = max(full, key=lambda k: full[k].shape[0] if full[k].dim() else 0)
    rows = full[name].shape[0]
    with ckpttool.open(dist_runs.two / "dcp", map_location="cuda:0") as f:
        part = f.get_slice(name)[rows // 2 - 1 : rows // 2 + 1]
    assert part.device == torch.device("cuda:0")
    assert torch.equal(part.cpu(), full[name][rows // 2 - 1 : rows // 2 + 1])


def test_a_file_cut_short_while_staged_is_a_clear_error(tmp_path):
    """A read that fails in a reader thread surfaces as the call's CkptError."""
    from ckpttool.tensors.direct import STAGING_BYTES

    sd = {"a": torch.randn(STAGING_BYTES // 2), "b": torch.randn(3 * STAGING_BYTES // 4)}
    path = tmp_path / "m.safetensors"
    save_file(sd, path)
    with ckpttool.open(path, map_location="cuda:0") as f:
        os.truncate(path, os.path.getsize(path) - 1000)
        with pytest.raises(ckpttool.CkptError, match="truncated"):
            f.get_tensor("b")  # the last in the file (safetensors sorts by name)
        assert torch.equal(f.get_tensor("a").cpu(), sd["a"])  # the session goes on
