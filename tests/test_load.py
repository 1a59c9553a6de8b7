"""``ckpttool.load``: devices, map_location, selection, and that it never changes its input."""

from __future__ import annotations

import pytest
import torch
from helpers import autograd_view, parameter_snapshot, rewrite_zip, sha256, small_state_dict

import ckpttool


def _cuda_bytes(data: bytes) -> bytes:
    """Rewrite the pickled storage location 'cpu' (BINUNICODE) to 'cuda:0'."""
    old = b"X\x03\x00\x00\x00cpu"
    assert old in data
    return data.replace(old, b"X\x06\x00\x00\x00cuda:0")


@pytest.fixture
def gpu_saved(tmp_path):
    """A torch.save file whose storages say they were saved on cuda:0 (crafted, no GPU)."""
    sd = small_state_dict()
    cpu = tmp_path / "cpu.pt"
    torch.save({"model": sd, "epoch": 1}, cpu)
    gpu = tmp_path / "gpu.pt"
    rewrite_zip(cpu, gpu, lambda n, d: _cuda_bytes(d) if n.endswith("/data.pkl") else None)
    # the crafted file is a valid torch checkpoint: torch itself reads it back to the CPU
    reference = torch.load(gpu, map_location="cpu", weights_only=True)
    for k, v in sd.items():
        assert torch.equal(reference["model"][k], v)
    return gpu, sd


def test_gpu_saved_tensors_report_their_device(gpu_saved):
    from ckpttool.inspection import inspect_report

    path, sd = gpu_saved
    report = inspect_report(ckpttool.read(path))
    assert [t["device"] for t in report["tensors"]] == ["cuda:0"] * len(sd)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_gpu_saved_tensors_load_on_cpu(gpu_saved):
    path, sd = gpu_saved
    for kwargs in ({}, {"map_location": "cpu"}, {"map_location": {"cuda:0": "cpu"}}):
        loaded = ckpttool.load(path, **kwargs)
        assert list(loaded) == list(sd)
        for k, v in sd.items():
            assert loaded[k].device.type == "cpu", kwargs
            assert torch.equal(loaded[k], v), kwargs
    loaded = ckpttool.load(path, map_location=torch.device("cpu"))
    assert all(t.device.type == "cpu" for t in loaded.values())
    # keeping the saved device needs a GPU: a clear error, not a crash
    with pytest.raises(ckpttool.CkptError, match="cuda:0") as info:
        ckpttool.load(path, map_location=None)
    assert "map_location='cpu'" in str(info.value)
    with pytest.raises(ckpttool.CkptError, match="cuda:0"):
        ckpttool.load(path, map_location={"cuda:0": "cuda:0"})


def test_gpu_saved_map_location_callable(gpu_saved):
    path, sd = gpu_saved
    seen = []

    def to_cpu(storage, location):
        seen.append(location)
        return storage

    loaded = ckpttool.load(path, map_location=to_cpu)
    assert set(seen) == {"cuda:0"}
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_gpu_saved_file_inspects_in_the_cli(gpu_saved, cli):
    import json

    path, _ = gpu_saved
    proc = cli("inspect", "--json", path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {t["device"] for t in report["tensors"]} == {"cuda:0"}
    assert {"key": ["epoch"], "type": "int", "value": 1} in report["values"]


def test_loaded_tensors_are_writable_and_detached_from_the_file(tmp_path):
    w = torch.arange(6.0)
    path = tmp_path / "tied.pt"
    torch.save({"a": w, "b": w}, path)
    before = sha256(path)
    sd = ckpttool.load(path)
    sd["a"].add_(1)  # a writable tensor, not a view of a read-only buffer
    assert torch.equal(sd["a"], torch.arange(6.0) + 1)
    assert sha256(path) == before
    assert torch.equal(ckpttool.load(path)["a"], torch.arange(6.0))


def test_load_preserves_dtypes(tmp_path):
    sd = {
        "p": torch.nn.Parameter(torch.ones(2)),
        "h": torch.ones(2, dtype=torch.float16),
        "i": torch.ones(2, dtype=torch.int8),
        "c": torch.ones(2, dtype=torch.complex64),
    }
    path = tmp_path / "dtypes.pt"
    torch.save(sd, path)
    loaded = ckpttool.load(path)
    assert {k: v.dtype for k, v in loaded.items()} == {k: v.dtype for k, v in sd.items()}
    assert all(torch.equal(loaded[k], v.detach()) for k, v in sd.items())


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_parameters_and_requires_grad_come_back_as_torch_load_gives_them(tmp_path, legacy):
    path = tmp_path / "params.pt"
    torch.save(parameter_snapshot(), path, _use_new_zipfile_serialization=not legacy)
    expected_flags, expected = autograd_view(torch.load(path, weights_only=True))
    assert expected_flags["params.weight"][:2] == ("Parameter", True)  # what torch gives
    assert expected_flags["grad"][:2] == ("Tensor", True)
    got_flags, got = autograd_view(ckpttool.load(path, select="all"))
    assert got_flags == expected_flags
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    assert ckpttool.load(path, select="params")["weight"].requires_grad


def test_a_pickled_module_gives_its_state_dict_detached(tmp_path):
    """``torch.save(model)``: what ``model.state_dict()`` gives, plain tensors, with tied
    weights one tensor; the whole structure (select all) keeps its Parameters."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied
    path = tmp_path / "model.pt"
    torch.save(model, path)
    sd = ckpttool.load(path)
    expected = model.state_dict()
    assert list(sd) == list(expected)
    assert {k: (type(v).__name__, v.requires_grad) for k, v in sd.items()} == {
        k: ("Tensor", False) for k in expected
    }
    assert all(torch.equal(sd[k], v) for k, v in expected.items())
    assert sd["0.weight"] is sd["1.weight"]
    whole = ckpttool.load(path, select="all")
    param = whole["state"]["_modules"]["0"]["state"]["_parameters"]["weight"]
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad


def test_select_key_path_with_dotted_keys(tmp_path):
    path = tmp_path / "snap.pt"
    torch.save({"state": {"model": {"0.weight": torch.ones(1)}, "step": 3}}, path)
    assert list(ckpttool.load(path, select="state.model")) == ["0.weight"]
    assert torch.equal(ckpttool.load(path, select="state.model.0.weight"), torch.ones(1))
    with pytest.raises(ckpttool.CkptError, match="no key 'nothing'"):
        ckpttool.load(path, select="state.nothing")


def test_load_never_changes_the_input(tmp_path):
    path = tmp_path / "snap.pt"
    torch.save({"MODEL_STATE": {"module.w": torch.ones(3)}, "EPOCHS_RUN": 1}, path)
    before = sha256(path)
    ckpttool.load(path)
    ckpttool.load(path, select="all")
    assert sha256(path) == before


def test_read_reads_no_tensor_bytes(tmp_path):
    """read() is metadata only: it works even when the storage bytes are garbage."""
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(4)}, path)
    broken = tmp_path / "broken.pt"
    rewrite_zip(path, broken, lambda n, d: b"\xff" * len(d) if n.endswith("/data/0") else None)
    ckpt = ckpttool.read(broken)
    assert ckpt.root["w"].shape == (4,)
    assert not torch.equal(ckpttool.load(broken)["w"], torch.ones(4))  # bytes read only now


def test_pathlike_and_string_inputs(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2)}, path)
    assert list(ckpttool.load(path)) == list(ckpttool.load(str(path))) == ["w"]


def test_select_all_turns_objects_into_plain_stand_ins_with_real_tensors(tmp_path):
    """load(select="all") never hands back lazy references: tensors inside objects are read,
    objects become the same plain-data stand-ins as merge writes, torch names torch objects."""
    import argparse

    import torch.nn as nn

    model = nn.Sequential(nn.Linear(2, 3))
    torch.save(
        {
            "module": model,
            "hparams": argparse.Namespace(scale=torch.ones(2), lr=0.1),
            "device": torch.device("cuda", 1),
            "dtype": torch.bfloat16,
        },
        tmp_path / "objects.pt",
    )
    out = ckpttool.load(tmp_path / "objects.pt", select="all")
    assert out["hparams"] == {
        "__class__": "argparse.Namespace",
        "state": {"scale": out["hparams"]["state"]["scale"], "lr": 0.1},
    }
    assert torch.equal(out["hparams"]["state"]["scale"], torch.ones(2))
    assert out["module"]["__class__"] == "torch.nn.modules.container.Sequential"
    linear = out["module"]["state"]["_modules"]["0"]["state"]["_parameters"]
    assert torch.equal(linear["weight"], model[0].weight.detach())
    assert out["device"] == torch.device("cuda", 1)
    assert out["dtype"] is torch.bfloat16


def test_public_names_stay_what_they_are_after_use(tmp_path):
    """ckpttool.materialize is a function: a submodule of the same name, imported when
    the first tensor was read, replaced it in the package (TypeError on the next call)."""
    path = tmp_path / "sd.pt"
    sd = small_state_dict()
    torch.save(sd, path)
    ckpttool.load(path)
    for name in ckpttool.__all__:
        value = getattr(ckpttool, name)
        assert not isinstance(value, type(ckpttool)), name
    node = ckpttool.select_node(ckpttool.read(path))[1]
    loaded = ckpttool.materialize(node)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)


# ------------------------------------------------- zero-copy mapping (mmap=True)


def mapped_from(tensor: torch.Tensor, path) -> bool:
    """Whether the tensor's memory lies in a mapping of ``path`` (per /proc/self/maps)."""
    import os

    address, real = tensor.untyped_storage().data_ptr(), os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return len(fields) > 5 and fields[5] == real
    return False


def _write(kind: str, folder, sd: dict):
    """``sd`` saved as ``kind``; returns (path, the file whose bytes tensors map)."""
    from safetensors.torch import save_file

    if kind == "torch-zip":
        path = folder / "sd.pt"
        torch.save(sd, path)
        return path, path
    if kind == "safetensors":
        path = folder / "sd.safetensors"
        save_file(sd, path)
        return path, path
    if kind == "dcp":
        from helpers import write_dcp

        write_dcp(folder / "dcp", sd)
        return folder / "dcp", folder / "dcp" / "__0_0.distcp"
    from ckpttool.convert import convert  # --to pt output

    torch.save(sd, folder / "in.pt", _use_new_zipfile_serialization=False)
    convert([str(folder / "in.pt")], "pt", str(folder / "out.pt"))
    return folder / "out.pt", folder / "out.pt"


MAPPED_KINDS = ["torch-zip", "safetensors", "dcp", "to-pt"]


def _aligned(path, name: str) -> bool:
    """Whether a tensor's bytes lie in its file at a multiple of its element size (DCP
    puts each chunk's zip at any offset: a misaligned chunk is read, not mapped)."""
    import os

    leaf = ckpttool.flatten_tensors(ckpttool.select_node(ckpttool.read(path))[1])[name]
    ref = leaf.shards[0].tensor.tensor_ref() if leaf.sharded else leaf
    fd = os.open(ref.storage.source.path, os.O_RDONLY)
    try:
        ref.storage.source.resolve(fd)
    finally:
        os.close(fd)
    return (ref.storage.source.offset + ref.offset * ref.dtype.itemsize) % ref.dtype.itemsize == 0


@pytest.mark.parametrize("kind", MAPPED_KINDS)
def test_load_maps_tensor_bytes_copy_on_write(tmp_path, kind):
    """Tensors are views of the file (nothing read until used); writing to one copies the
    page: the file and a second load keep the saved values."""
    sd = {"w": torch.randn(64, 16), "b": torch.arange(16, dtype=torch.int64)}
    path, data_file = _write(kind, tmp_path, sd)
    before = sha256(data_file)
    loaded = ckpttool.load(path)
    assert sorted(loaded) == sorted(sd)
    assert all(mapped_from(loaded[k], data_file) for k in sd if _aligned(path, k))
    assert mapped_from(loaded["w"], data_file) or kind == "dcp"
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    loaded["w"].mul_(-1)
    loaded["b"][0] = 99
    assert torch.equal(loaded["w"], -sd["w"]) and loaded["b"][0] == 99
    assert sha256(data_file) == before
    again = ckpttool.load(path)
    assert all(torch.equal(again[k], v) for k, v in sd.items())


@pytest.mark.parametrize("kind", MAPPED_KINDS)
def test_a_mapped_tensor_holds_its_own_storage_not_the_file(tmp_path, kind):
    """Each tensor's storage is the bytes saved for it, as ``torch.load(mmap=True)`` gives:
    saving one loaded tensor writes that tensor, not the whole mapped file."""
    sd = {"big": torch.randn(256, 256), "small": torch.arange(4, dtype=torch.int64)}
    path, data_file = _write(kind, tmp_path, sd)
    loaded = ckpttool.load(path)
    assert mapped_from(loaded["big"], data_file) or kind == "dcp"
    assert loaded["small"].untyped_storage().nbytes() == 4 * 8
    assert loaded["big"].untyped_storage().nbytes() == 256 * 256 * 4
    torch.save(loaded["small"], tmp_path / "one.pt")
    assert (tmp_path / "one.pt").stat().st_size < 4096
    assert torch.equal(torch.load(tmp_path / "one.pt", weights_only=True), sd["small"])


def test_mapped_tensors_hold_no_file_descriptors(tmp_path):
    """A thousand live loads must not use up the process's descriptors."""
    import os

    path, _ = _write("safetensors", tmp_path, {"w": torch.ones(4), "b": torch.zeros(2)})
    before = sorted(os.listdir("/proc/self/fd"))
    kept = [ckpttool.load(path) for _ in range(20)]
    with ckpttool.open(path) as f:
        kept.append({"w": f.get_tensor("w")})
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert all(torch.equal(sd["w"], torch.ones(4)) for sd in kept)


@pytest.mark.parametrize("kind", MAPPED_KINDS)
def test_mmap_false_reads_into_memory_of_its_own(tmp_path, kind):
    sd = {"w": torch.randn(8, 4)}
    path, data_file = _write(kind, tmp_path, sd)
    loaded = ckpttool.load(path, mmap=False)
    assert not mapped_from(loaded["w"], data_file)
    assert torch.equal(loaded["w"], sd["w"])


def test_legacy_files_are_read_not_mapped(tmp_path):
    path = tmp_path / "legacy.pt"
    sd = {"w": torch.randn(8, 4), "h": torch.randn(3).half()}
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    loaded = ckpttool.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    loaded["h"].add_(1)  # misaligned in the file: a buffer of its own, writable
    assert torch.equal(ckpttool.load(path)["h"], sd["h"])


@pytest.mark.parametrize("kind", MAPPED_KINDS)
def test_mapped_tensors_stay_valid_after_the_file_is_gone(tmp_path, kind):
    import shutil

    sd = {"w": torch.randn(32, 8)}
    path, _ = _write(kind, tmp_path, sd)
    loaded = ckpttool.load(path)
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert torch.equal(loaded["w"], sd["w"])
    assert loaded["w"].sum() == sd["w"].sum()


# ------------------------------------- bitwise equality with torch.load / load_file

from helpers import same_bits  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_properties import DTYPES, LAYOUTS, make_tensor  # noqa: E402


@st.composite
def saved_dicts(draw) -> dict:
    """Tensors of every dtype and layout the property tests cover, some sharing a storage."""
    out = {}
    for i in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        layout = draw(st.sampled_from(LAYOUTS))
        out[f"t{i}"] = make_tensor(dtype, shape, layout, draw(st.integers(0, 2**31)))
    if draw(st.booleans()):
        base = out["t0"]
        out["tied"] = base
        if base.dim() >= 1 and base.shape[0] > 1:
            out["view"] = base[1:]
    return out


@settings(max_examples=25, deadline=None)
@given(sd=saved_dicts(), legacy=st.booleans(), mmap=st.booleans())
def test_load_is_bitwise_torch_load(sd, legacy, mmap):
    import tempfile

    from hypothesis import assume

    # torch.load cannot read the legacy format's untyped storages (float8) back itself
    fp8 = any(t.dtype.itemsize == 1 and t.is_floating_point() for t in sd.values())
    assume(not (legacy and fp8))
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/sd.pt"
        torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
        expected = torch.load(path, weights_only=True)
        got = ckpttool.load(path, mmap=mmap)
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert same_bits(got[name], tensor), name
        assert got[name].stride() == tensor.stride() or tensor.numel() <= 1, name

    # what shares a storage in torch.load's result shares one in ours
    def sharing(d):
        ptr = {k: t.untyped_storage().data_ptr() for k, t in d.items() if t.numel()}
        return {(a, b) for a in ptr for b in ptr if a < b and ptr[a] == ptr[b]}

    assert sharing(got) == sharing(expected)


SAFETENSORS_DTYPES = [d for d in DTYPES]


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=5),
    dtypes=st.lists(st.sampled_from(SAFETENSORS_DTYPES), min_size=5, max_size=5),
    mmap=st.booleans(),
)
def test_load_is_bitwise_safetensors_load_file(shapes, dtypes, mmap):
    import tempfile

    from safetensors.torch import load_file, save_file

    sd = {
        f"t{i}": make_tensor(dtypes[i], tuple(shape), "contiguous", i)
        for i, shape in enumerate(shapes)
    }
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/sd.safetensors"
        save_file(sd, path)
        expected = load_file(path)
        got = ckpttool.load(path, mmap=mmap)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert same_bits(got[name], tensor), name


def test_dcp_load_is_bitwise_the_saved_state(tmp_path):
    from helpers import write_dcp

    sd = {f"t{i}": make_tensor(dt, (3, 5), "contiguous", i) for i, dt in enumerate(DTYPES)}
    write_dcp(tmp_path / "dcp", {"model": sd})
    for mmap in (True, False):
        got = ckpttool.load(tmp_path / "dcp", mmap=mmap)
        assert list(got) == list(sd)
        assert all(same_bits(got[k], v) for k, v in sd.items())


# ------------------------------------------------ inputs: file objects, missing files


@pytest.mark.parametrize("how", ["bytesio", "open file", "at an offset"])
def test_load_read_and_open_take_binary_file_objects(tmp_path, how):
    import io

    sd = small_state_dict()
    path = tmp_path / "sd.pt"
    torch.save({"model": sd, "epoch": 2}, path)
    raw = path.read_bytes()

    def source():
        if how == "bytesio":
            return io.BytesIO(raw)
        if how == "at an offset":
            f = io.BytesIO(b"junk" + raw)
            f.seek(4)  # read from the current position, as torch.load does
            return f
        return open(path, "rb")  # noqa: SIM115 - closed below

    f = source()
    loaded = ckpttool.load(f)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], v) for k, v in sd.items())
    ckpt = ckpttool.read(source())
    assert ckpt.format == "torch-zip" and list(ckpt) == ["model", "epoch"]
    assert torch.equal(ckpttool.materialize(ckpt["model"]["fc.weight"]), sd["fc.weight"])
    with ckpttool.open(source()) as lazy:
        assert list(lazy) == list(sd)
        assert torch.equal(lazy.get_tensor("fc.weight"), sd["fc.weight"])
    f.close()
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())  # the file object is closed


def test_a_file_object_in_text_mode_is_refused(tmp_path):
    path = tmp_path / "sd.pt"
    torch.save({"w": torch.ones(1)}, path)
    with open(path, encoding="latin-1") as f, pytest.raises(ckpttool.CkptError, match="binary"):
        f.read(1)  # not at the start: its path is not used, its (text) content is
        ckpttool.load(f)


def test_a_read_from_a_bytesio_keeps_its_bytes_while_tensors_need_them(tmp_path):
    import gc
    import io

    path = tmp_path / "sd.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    ckpt = ckpttool.read(io.BytesIO(path.read_bytes()))
    ref = ckpt["w"]
    del ckpt
    gc.collect()
    assert torch.equal(ckpttool.materialize(ref), torch.arange(4.0))


@pytest.mark.parametrize("what", ["file", "glob", "folder"])
def test_a_missing_input_is_a_ckpterror_and_a_filenotfounderror(tmp_path, what):
    import errno

    missing = {"file": tmp_path / "nope.pt", "glob": tmp_path / "nope-*.pt",
               "folder": tmp_path / "nope" / "ckpt"}[what]  # fmt: skip
    for call in (ckpttool.load, ckpttool.read, ckpttool.open):
        with pytest.raises(FileNotFoundError) as info:
            call(missing)
        assert isinstance(info.value, ckpttool.CkptError)
        assert info.value.errno == errno.ENOENT
        assert str(info.value).startswith(str(missing))


def test_a_missing_input_still_exits_2_with_one_line(tmp_path, cli):
    from helpers import check_error

    check_error(cli("inspect", tmp_path / "nope.pt"), 2, "no such file or directory")


# ---------------------------------------------------- Checkpoint as a mapping


def test_checkpoint_is_a_read_only_mapping_over_its_root(tmp_path):
    from collections.abc import Mapping

    path = tmp_path / "snap.pt"
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 3}, path)
    ckpt = ckpttool.read(path)
    assert isinstance(ckpt, Mapping)
    assert list(ckpt.keys()) == ["model", "epoch"] and len(ckpt) == 2
    assert ckpt["epoch"] == 3 and "model" in ckpt and "nothing" not in ckpt
    assert isinstance(ckpt["model"]["w"], ckpttool.TensorRef)
    with pytest.raises(KeyError):
        ckpt["nothing"]
    with pytest.raises(TypeError):
        ckpt["epoch"] = 4  # type: ignore[index]
    lists = tmp_path / "list.pt"
    torch.save([torch.ones(1), 5], lists)
    assert list(ckpttool.read(lists).items())[1] == (1, 5)


def test_checkpoint_repr_is_short_at_any_size(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "many.safetensors"
    save_file({f"model.layers.{i}.mlp.gate_proj.weight": torch.zeros(1) for i in range(3000)},
              path)  # fmt: skip
    text = repr(ckpttool.read(path))
    assert len(text) < 400, text
    assert text.startswith("Checkpoint(format='safetensors', files=['many.safetensors']")
    assert "tensors=3000" in text and "+2994" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
@pytest.mark.parametrize("call", ["load", "open"])
def test_a_cuda_target_without_a_gpu_is_a_clear_error(tmp_path, call):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(3)}, path)
    with pytest.raises(ckpttool.CkptError, match="cannot place tensors on cuda:0") as info:
        if call == "load":
            ckpttool.load(path, map_location="cuda:0")
        else:
            with ckpttool.open(path, map_location="cuda:0") as f:
                f.get_tensor("w")
    assert "map_location='cpu'" in str(info.value)


def test_a_safetensors_bytesio(tmp_path):
    import io

    from safetensors.torch import save

    sd = {"a": torch.randn(3, 2), "b": torch.arange(4)}
    loaded = ckpttool.load(io.BytesIO(save(sd)))
    assert sorted(loaded) == ["a", "b"] and all(torch.equal(loaded[k], v) for k, v in sd.items())
