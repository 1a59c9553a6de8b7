"""``torch-zip`` (formats/torch_zip.py): torch.save files read as torch.load reads them,
bitwise, keeping shared storages and views."""

from __future__ import annotations

import pickletools

import pytest
import torch
from helpers import (
    assert_identical,
    check_error,
    fixture_path,
    rewrite_zip,
    run_cli,
    run_many,
    tricky_tensors,
)

import ckpttool
from ckpttool.inspection import inspect_report


@pytest.mark.parametrize(
    "fmt,kwargs",
    [("torch-zip", {}), ("torch-legacy", {"_use_new_zipfile_serialization": False})],
)
def test_torch_save_formats_bitwise(tmp_path, fmt, kwargs):
    original = tricky_tensors()
    path = tmp_path / "tricky.pt"
    torch.save(original, path, **kwargs)
    ckpt = ckpttool.read(path)
    assert ckpt.format == fmt
    assert ckpt.files == [str(path)]
    assert ckpt.world_size is None
    assert ckpt.dangerous == []
    # the tree keeps sharing: tied weights and views point at one storage
    assert ckpt.root["embed.weight"].storage is ckpt.root["lm_head.weight"].storage
    assert ckpt.root["cols"].storage is ckpt.root["embed.weight"].storage
    assert (ckpt.root["cols"].offset, ckpt.root["cols"].stride) == (1, (4, 1))
    loaded = ckpttool.load(path)
    assert_identical(loaded, original)
    # tied weights and views share one storage, with their saved strides (as torch.load)
    shared = loaded["embed.weight"].untyped_storage().data_ptr()
    for name in ("lm_head.weight", "cols", "transposed", "every_other_row"):
        assert loaded[name].untyped_storage().data_ptr() == shared, name
        assert loaded[name].stride() == original[name].stride(), name


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_conjugate_and_negative_views_read_as_torch_load_gives_them(tmp_path, zip_format):
    """torch.save keeps a lazy conj / neg view as the original bytes plus a bit; the bit
    must be applied when reading and writing (not the raw bytes copied)."""
    sd = {
        "c": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "n": torch.tensor([1.0, -2.0])._neg_view(),
        "cn": torch.tensor([[1 + 1j, 2 - 2j]]).conj().t(),
    }
    path = tmp_path / "views.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=zip_format)
    want = torch.load(path, weights_only=True)
    assert want["c"].is_conj() and want["n"].is_neg()  # the bits really are in the file
    assert_identical(
        ckpttool.load(path), {k: v.resolve_conj().resolve_neg() for k, v in want.items()}
    )
    outputs = (("safetensors", "o.safetensors"), ("pt", "o.pt"))
    argvs = [["convert", path, "--to", to, "-o", tmp_path / name] for to, name in outputs]
    argvs += [["diff", path, tmp_path / name] for _, name in outputs]
    for run in run_many(argvs):  # (one interpreter for the four commands)
        assert run["code"] == 0, run["stderr"]
    for _, name in outputs:
        assert_identical(ckpttool.load(tmp_path / name), ckpttool.load(path))


def test_committed_ddp_fixture():
    path = fixture_path("ddp/ep0-rank0.pt")
    report = inspect_report(ckpttool.read(path))
    assert report["format"] == "torch-zip"
    assert report["prefix"] == "module."
    assert report["dangerous"] == []


def test_numpy_arrays_of_strings_or_objects_are_placeholders_not_tensors(tmp_path):
    import numpy as np

    sd = {"w": torch.ones(2), "f": np.arange(3.0)}
    torch.save(
        {"model": sd, "names": np.array(["a", "b"]), "objs": np.array([{"x": 1}])},
        tmp_path / "np.pt",
    )
    ckpt = ckpttool.read(tmp_path / "np.pt")
    report = inspect_report(ckpt)
    assert [t["key"] for t in report["tensors"]] == [["model", "w"], ["model", "f"]]
    assert {v["key"][0]: v["value"] for v in report["values"]} == {
        "names": "<opaque numpy.ndarray>",
        "objs": "<opaque numpy.ndarray>",
    }
    everything = ckpttool.load(tmp_path / "np.pt", select="all")
    assert everything["names"]["__class__"] == "numpy.ndarray"
    assert torch.equal(everything["model"]["f"], torch.arange(3.0, dtype=torch.float64))
    out = tmp_path / "all.safetensors"
    proc = run_cli(
        "convert", tmp_path / "np.pt", "--to", "safetensors", "--select", "all", "-o", out
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(ckpttool.load(out)) == ["model.f", "model.w"]


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_arrays_read_as_tensors_with_any_pickle_protocol(tmp_path, protocol, legacy):
    """numpy pickles a contiguous array with protocol 5 as ``_frombuffer(bytes, dtype,
    shape, order)``, not ``_reconstruct``: it was kept as an opaque object."""
    import numpy as np

    arrays = {
        "c": np.arange(6, dtype=np.float32).reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 2)),
        "big_endian": np.arange(3, dtype=">f4"),
        "bool": np.array([True, False]),
    }
    path = tmp_path / "np.pt"
    torch.save({"extra_state": arrays}, path, pickle_protocol=protocol,
               _use_new_zipfile_serialization=not legacy)  # fmt: skip
    got = ckpttool.load(path, select="all")["extra_state"]
    for name, array in arrays.items():
        want = torch.from_numpy(array.astype(array.dtype.newbyteorder("=")))
        assert torch.is_tensor(got[name]), name
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    report = inspect_report(ckpttool.read(path))
    assert len(report["tensors"]) == len(arrays)


def _size_past_int64(name: str, data: bytes) -> bytes | None:
    """data.pkl with the first int of its first torch.Size made 2**64."""
    if not name.endswith("/data.pkl"):
        return None
    ops = list(pickletools.genops(data))
    at = next(i for i, (op, arg, _) in enumerate(ops) if "GLOBAL" in op.name and "Size" in arg)
    op, _, pos = next(o for o in ops[at:] if o[0].name in ("BININT1", "BININT2", "BININT"))
    width = {"BININT1": 1, "BININT2": 2, "BININT": 4}[op.name]
    long1 = b"\x8a\x09" + (2**64).to_bytes(9, "little", signed=True)
    return data[:pos] + long1 + data[pos + 1 + width :]


def test_torch_size_value_past_int64_is_corrupt(tmp_path):
    # DeepSpeed's param_shapes are torch.Size values, not tensor shapes: merged as they
    # are, one past int64 gave an output torch.load could not read
    path = tmp_path / "mp_rank_00_model_states.pt"
    source = fixture_path("deepspeed/zero1/global_step3/mp_rank_00_model_states.pt")
    rewrite_zip(source, path, _size_past_int64)
    out = tmp_path / "out"
    out.mkdir()
    check_error(run_cli("merge", path, "-o", out / "m.pt"), 2, "corrupt torch.Size")
    assert list(out.iterdir()) == []
    with pytest.raises(ckpttool.CkptError, match="corrupt torch.Size"):
        ckpttool.load(path, select="all")


@pytest.mark.parametrize(("names", "code"), [(16, 0), (20_000, 2)])
def test_one_storage_named_as_thousands_of_tensors_is_refused(tmp_path, names, code):
    # each name of a tied tensor is written in full: 20,000 memo references (a few bytes
    # each) to one 5 KB storage made a 300 KB file a 100 MB output
    from payloads import lazy_tensor, torch_pickle_bytes

    tensor = lazy_tensor("16", (1264,), 1264)  # archive/data/16 of the fixture
    data = torch_pickle_bytes({f"w{i}": tensor for i in range(names)})
    path = tmp_path / "tied.pt"
    source = fixture_path("ddp/ep0-rank0.pt")
    rewrite_zip(source, path, lambda name, old: data if name.endswith("/data.pkl") else None)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli("convert", path, "--to", "safetensors", "-o", out / "x.safetensors")
    if code:
        check_error(proc, 2, "name the same stored bytes over and over")
        assert list(out.iterdir()) == []
    else:
        assert proc.returncode == 0, proc.stderr
        assert len(ckpttool.load(out / "x.safetensors")) == names
