"""Broken inputs: exit 2, ONE stderr line, no traceback, and the input left as it was."""

from __future__ import annotations

import json
import os
import random
import shutil
import zipfile

import pytest
import torch
from helpers import FIXTURES, check_error, rewrite_zip, run_cli, sha256, write_dcp
from safetensors.torch import save_file

import ckpttool


def _torch_file(folder):
    path = folder / "good.pt"
    torch.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, path)
    return path


def empty_file(d):
    (d / "empty.pt").write_bytes(b"")
    return d / "empty.pt", "empty file"


def random_bytes(d):
    # seeded: bytes whose first opcode a pickle has (a text PERSID...) are judged as the
    # pickle torch.load would start to unpickle, and said to be a corrupt one
    data = random.Random(4096).randbytes(4096).replace(b"PK", b"pk")
    (d / "random.bin").write_bytes(data)
    return d / "random.bin", "not a checkpoint"


def truncated_zip(d):
    data = _torch_file(d).read_bytes()
    (d / "half.pt").write_bytes(data[: len(data) // 2])
    return d / "half.pt", "truncated or corrupt zip"


def truncated_legacy(d):
    path = d / "legacy.pt"
    torch.save({"w": torch.ones(100)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    path.write_bytes(data[:-50])
    return path, "truncated"


def truncated_safetensors(d):
    save_file({"w": torch.ones(10)}, d / "t.safetensors")
    data = (d / "t.safetensors").read_bytes()
    (d / "t.safetensors").write_bytes(data[:-10])
    return d / "t.safetensors", "'w'"


def absurd_safetensors_header(d):
    path = d / "absurd.safetensors"
    path.write_bytes((2**60).to_bytes(8, "little") + b'{"w": {}}' + b"\0" * 64)
    return path, str(path)


def safetensors_bad_offsets(d):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}).encode()
    path = d / "offsets.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    return path, "'w'"


def safetensors_metadata_not_an_object(d):
    header = json.dumps({"__metadata__": "x", "w": {"dtype": "F32", "shape": [1],
                         "data_offsets": [0, 4]}}).encode()  # fmt: skip
    (d / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    return d / "m.safetensors", "__metadata__ is not an object"


def json_file(d):
    (d / "config.json").write_text(json.dumps({"hidden_size": 4}))
    return d / "config.json", "not a checkpoint"


def corrupt_index(d):
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    return d / "model.safetensors.index.json", "index"


def empty_folder(d):
    (d / "empty").mkdir()
    return d / "empty", "folder holds no checkpoint"


def folder_without_metadata(d):
    folder = d / "nometa"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"\0" * 100)
    return folder, "folder holds no checkpoint"


def unrelated_folder(d):
    folder = d / "unrelated"
    folder.mkdir()
    (folder / "a.txt").write_text("hello")
    (folder / "b.csv").write_text("1,2\n")
    return folder, "folder holds no checkpoint"


def nonexistent(d):
    return d / "does-not-exist.pt", "no such file or directory"


def zip_not_torch(d):
    with zipfile.ZipFile(d / "archive.zip", "w") as z:
        z.writestr("hello.txt", "hi")
    return d / "archive.zip", "not a torch checkpoint"


def torch_export_archive(d):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x)

    program = torch.export.export(Net(), (torch.randn(1, 3),))
    torch.export.save(program, d / "net.pt2")
    return d / "net.pt2", "a torch.export archive (.pt2): an exported program, not a checkpoint"


def storage_shorter_than_pickle_says(d):
    src = _torch_file(d)
    dst = d / "short.pt"
    rewrite_zip(src, dst, lambda name, data: data[:8] if name.endswith("/data/0") else None)
    src.unlink()
    return dst, "storage 0 holds 8 bytes, expected 48"


def _patch_central_entry(d, name, offset, value):
    """A torch file whose central directory says ``value`` at ``offset`` of every entry
    (or only of the entry whose name ends with ``name``)."""
    path = _torch_file(d)
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at != -1:
        name_len = int.from_bytes(data[at + 28 : at + 30], "little")
        if data[at + 46 : at + 46 + name_len].endswith(name):
            data[at + offset : at + offset + 2] = value.to_bytes(2, "little")
        at = data.find(b"PK\x01\x02", at + 46)
    path.write_bytes(data)
    return path


def zip_version_unknown(d):
    # "version needed to extract" 9.4: zipfile raises NotImplementedError
    return _patch_central_entry(d, b"", 6, 94), "truncated or corrupt zip"


def zip_flag_bit_5(d):
    # "compressed patched data" on data.pkl: NotImplementedError when it is read
    return _patch_central_entry(d, b"data.pkl", 8, 1 << 5), "corrupt zip entry"


def zip_entry_encrypted(d):
    # flag bit 0 on data.pkl: zipfile asks for a password (RuntimeError)
    return _patch_central_entry(d, b"data.pkl", 8, 1), "corrupt zip entry"


def plain_pickle(d):
    import pickle

    (d / "plain.pkl").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    return d / "plain.pkl", "not a torch checkpoint"


def corrupt_data_pkl(d):
    src = _torch_file(d)
    dst = d / "badpkl.pt"
    rewrite_zip(src, dst, lambda name, data: data[:20] if name.endswith("/data.pkl") else None)
    src.unlink()
    return dst, "pickle"


def dcp_corrupt_metadata(d):
    folder = d / "dcp"
    write_dcp(folder, {"w": torch.ones(2)})
    (folder / ".metadata").write_bytes(b"\x80\x04garbage")
    return folder, ".metadata"


def _with_data_pkl(d, name, obj):
    """A real torch.save zip whose data.pkl is replaced by ``pickle.dumps(obj)``."""
    import pickle

    src = _torch_file(d)
    dst = d / name
    data = pickle.dumps(obj, protocol=2)
    rewrite_zip(src, dst, lambda n, old: data if n.endswith("/data.pkl") else None)
    src.unlink()
    return dst


def self_containing_dict(d):
    cyclic = {}
    cyclic["self"] = cyclic
    return _with_data_pkl(d, "cycle.pt", {"x": cyclic}), "holds itself"


def billion_laughs(d):
    """300 bytes of pickle, 2**40 paths: the same list twice, 40 levels deep."""
    x = [1.0]
    for _ in range(40):
        x = [x, x]
    return _with_data_pkl(d, "laughs.pt", {"x": x}), "shared by many paths"


def deep_nesting(d):
    x = []
    for _ in range(5000):
        x = [x]
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # pickle.dumps itself recurses
    try:
        return _with_data_pkl(d, "deep.pt", {"x": x}), "nests deeper than"
    finally:
        sys.setrecursionlimit(limit)


def dcp_deep_key_path(d):
    """DCP .metadata whose planner data nests one value 5000 dicts deep."""
    import pickle

    import torch.distributed.checkpoint as dcp

    folder = d / "dcp"
    write_dcp(folder, {"w": torch.ones(2)})
    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    meta.planner_data = {"w": tuple(["a"] * 5000)}
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return folder, "nests deeper than"


CASES = [
    empty_file,
    random_bytes,
    truncated_zip,
    truncated_legacy,
    truncated_safetensors,
    absurd_safetensors_header,
    safetensors_bad_offsets,
    safetensors_metadata_not_an_object,
    json_file,
    corrupt_index,
    empty_folder,
    folder_without_metadata,
    unrelated_folder,
    nonexistent,
    zip_not_torch,
    torch_export_archive,
    zip_version_unknown,
    zip_flag_bit_5,
    zip_entry_encrypted,
    storage_shorter_than_pickle_says,
    plain_pickle,
    corrupt_data_pkl,
    dcp_corrupt_metadata,
    self_containing_dict,
    billion_laughs,
    deep_nesting,
    dcp_deep_key_path,
]


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
def test_bad_input_is_exit_2_with_one_line(tmp_path, make):
    path, needle = make(tmp_path)
    before = sha256(path)
    line = check_error(run_cli("inspect", path, timeout=60), 2, needle)
    assert line.startswith("ckpttool: error: ")
    assert sha256(path) == before
    with pytest.raises(ckpttool.CkptError) as info:
        ckpttool.load(path)
    assert not isinstance(info.value, ckpttool.UnsafeError)
    assert "\n" not in str(info.value)
    assert sha256(path) == before


@pytest.mark.parametrize(
    "make",
    [truncated_zip, storage_shorter_than_pickle_says, truncated_safetensors, empty_folder],
    ids=lambda f: f.__name__,
)
def test_convert_and_merge_write_nothing_for_bad_input(tmp_path, make):
    path, _ = make(tmp_path)
    before = sha256(path)
    out = tmp_path / "out"
    out.mkdir()
    check_error(run_cli("convert", path, "--to", "safetensors", "-o", out / "x.safetensors"), 2)
    check_error(run_cli("merge", path, "-o", out / "x.pt"), 2)
    assert os.listdir(out) == []
    assert sha256(path) == before


def test_data_error_found_only_when_reading_bytes(tmp_path):
    """A legacy file whose last storage is cut: metadata is fine, the data is not."""
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(1000)}, path, _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:-8])
    check_error(run_cli("inspect", path), 2, "truncated")


# ------------------------------------------------------- DCP missing a .distcp


def _value_files(folder) -> set[str]:
    """The .distcp files that hold non-tensor values (they are read even by inspect)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    values = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    return {info.relative_path for index, info in meta.storage_data.items() if index.fqn in values}


@pytest.mark.slow
def test_dcp_missing_a_tensor_file(dist_runs, tmp_path):
    folder = tmp_path / "dcp"
    shutil.copytree(dist_runs.two / "dcp", folder)
    files = sorted(p.name for p in folder.glob("*.distcp"))
    tensor_only = [f for f in files if f not in _value_files(folder)]
    assert tensor_only, files
    missing = folder / tensor_only[0]
    missing.unlink()
    before = sha256(folder)

    # metadata only, yet every file .metadata names is checked to be there (issue 32)
    check_error(run_cli("inspect", "--json", folder), 2, f"{missing}: missing")

    out = tmp_path / "out.safetensors"
    check_error(run_cli("convert", folder, "--to", "safetensors", "-o", out), 2, str(missing))
    assert not out.exists()
    with pytest.raises(ckpttool.CkptError, match=tensor_only[0]):
        ckpttool.load(folder)
    assert sha256(folder) == before


@pytest.mark.parametrize("damage", ["drop", "overlap"])
def test_dcp_metadata_whose_chunks_do_not_tile_the_tensor(tmp_path, damage):
    """.metadata alone lists a tensor's chunks: one dropped (or two overlapping) would
    leave rows of the merged tensor uninitialised memory. Refused, naming the tensor."""
    import pickle

    folder = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp", folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    chunks = meta.state_dict_metadata["model.fc1.weight"].chunks
    assert [list(c.offsets) for c in chunks] == [[0, 0], [4, 0]]
    if damage == "drop":
        chunks.pop()
        needle = "'model.fc1.weight': shards cover 80 of 160 elements"
    else:
        moved = torch.Size([3, 0])
        chunks[1] = type(chunks[1])(offsets=moved, sizes=chunks[1].sizes)
        index = next(i for i in meta.storage_data
                     if i.fqn == "model.fc1.weight" and list(i.offset) == [4, 0])  # fmt: skip
        meta.storage_data[type(index)(index.fqn, moved, index.index)] = meta.storage_data.pop(index)
        needle = "'model.fc1.weight': shards overlap"
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    out = tmp_path / "out.safetensors"
    for args in (("inspect", folder), ("convert", folder, "--to", "safetensors", "-o", out)):
        check_error(run_cli(*args), 2, needle)
    assert not out.exists()


@pytest.mark.parametrize("shift", [0, 4])
def test_dcp_metadata_naming_one_span_for_many_tensors(tmp_path, shift):
    """A few bytes of .metadata per tensor could name the same stored bytes a thousand
    times: a 1 MB folder read as gigabytes of tensors. Each chunk has bytes of its own
    (a span named twice is a safetensors blob, which holds each tensor once)."""
    import pickle

    folder = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp", folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    name = "model.fc1.weight"
    for copy in range(1000):
        fqn = f"copy{copy}"
        meta.state_dict_metadata[fqn] = meta.state_dict_metadata[name]
        for index in [i for i in meta.storage_data if i.fqn == name]:
            info = meta.storage_data[index]
            moved = type(info)(info.relative_path, info.offset + shift, info.length)
            meta.storage_data[type(index)(fqn, index.offset, index.index)] = moved
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    out = tmp_path / "out.pt"
    if shift:  # refused from .metadata alone
        check_error(run_cli("inspect", folder), 2, "the stored bytes of", "overlap")
    else:  # a torch.save chunk holds one tensor: found when its bytes are read
        check_error(run_cli("merge", folder, "-o", out), 2, "other chunks name the bytes of")
    assert not out.exists()


@pytest.mark.slow
def test_dcp_missing_the_file_with_values_names_it(dist_runs, tmp_path):
    folder = tmp_path / "dcp"
    shutil.copytree(dist_runs.two / "dcp", folder)
    value_file = sorted(_value_files(folder))[0]
    (folder / value_file).unlink()
    check_error(run_cli("inspect", folder), 2, value_file)


def test_meta_tensors_are_shown_and_refused_by_name(tmp_path):
    """A tensor saved on the meta device has a shape and no data: inspect shows it;
    anything that needs its data says which tensor, not just "a tensor"."""
    path = tmp_path / "meta.pt"
    torch.save({"model": {"w": torch.ones(2), "m": torch.empty(3, device="meta")},
                "ema": {"x": torch.ones(1)}}, path)  # fmt: skip
    proc = run_cli("inspect", "--json", path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["num_tensors"] == 3
    out = tmp_path / "out.pt"
    for args in (("convert", path, "--to", "pt", "-o", out), ("merge", path, "-o", out),
                 ("convert", path, "--to", "safetensors", "--select", "all", "-o",
                  out.with_suffix(".safetensors")),
                 ("diff", path, path)):  # fmt: skip
        check_error(run_cli(*args), 2, "m' has no stored data (saved on the meta device)")
        assert not out.exists() and not out.with_suffix(".safetensors").exists()
    with pytest.raises(ckpttool.CkptError, match="tensor 'm' has no stored data"):
        ckpttool.load(path)
    assert torch.equal(ckpttool.load(path, select="ema")["x"], torch.ones(1))


def test_rezipped_with_compression_reads_as_torch_reads_it(tmp_path):
    """torch.save never compresses its zip entries, but torch.load reads a re-zipped
    (deflated) file: so does ckpttool, bitwise."""
    path = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(1000)}, path)
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    assert run_cli("inspect", deflated).returncode == 0
    assert torch.equal(ckpttool.load(deflated)["w"], torch.load(deflated)["w"])


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("legacy", [False, True])
def test_storage_types_ckpttool_cannot_read_are_named(tmp_path, legacy):
    """4-bit quantized tensors (QUInt4x2Storage, EmbeddingBag weights) are refused by
    their storage class, not called a corrupt pickle."""
    path = tmp_path / "q4.pt"
    q4 = torch.quantize_per_tensor(torch.rand(4, 4), 0.1, 0, torch.quint4x2)
    torch.save({"emb": q4}, path, _use_new_zipfile_serialization=not legacy)
    check_error(run_cli("inspect", path), 2,
                "tensors of storage type torch.QUInt4x2Storage are not supported")  # fmt: skip


def test_an_error_of_ckpttools_own_says_internal_error_not_corrupt_input():
    """A mistake of ckpttool's own code (an attribute it expected, raised in its own
    frame) is an internal error naming --debug; the same kind raised by what a damaged
    input provokes below ckpttool stays a corrupt input."""
    from ckpttool.errors import CkptError, InternalError, translate_errors
    from ckpttool.writers.plan import Piece

    class NotASparseTensor:
        pass

    @translate_errors
    def own_mistake():
        Piece(0, 0, check=NotASparseTensor()).check_invariants()  # type: ignore[arg-type]

    with pytest.raises(InternalError) as caught:
        own_mistake()
    line = caught.value.one_line()
    assert line.startswith("internal error (AttributeError: ") and "--debug" in line
    assert "corrupt" not in line

    @translate_errors
    def input_mistake():
        raise AttributeError("a value of the file lacks it")  # raised outside the package

    with pytest.raises(CkptError, match="corrupt or unsupported input") as plain:
        input_mistake()
    assert not isinstance(plain.value, InternalError)


def test_a_device_or_a_pipe_is_named_as_such(tmp_path):
    """A link to /dev/zero would read forever, a named pipe block: each is named."""
    import os

    zero = tmp_path / "zero.pt"
    zero.symlink_to("/dev/zero")
    pipe = tmp_path / "pipe.pt"
    os.mkfifo(pipe)
    assert check_error(run_cli("inspect", zero), 2) == (
        f"ckpttool: error: {zero}: a character device, not a checkpoint file"
    )
    assert check_error(run_cli("convert", pipe, "--to", "pt", "-o", tmp_path / "o.pt"), 2) == (
        f"ckpttool: error: {pipe}: a named pipe, not a checkpoint file"
    )
