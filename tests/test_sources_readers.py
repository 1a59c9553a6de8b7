"""Every format reader finds and reads its files through the byte-source interface.

Each checkpoint is read twice: from its local path and from ``counting://`` (the same
files behind a source with no local path, every byte through ``read_into``, counted).
Both reads must give the same checkpoint (format, tensors, globals, the whole
``inspect --json`` object but for the file paths), and the counted read must stay
metadata-only: the fixtures' tensor data is large enough (4 MiB and more) that
reading it would break the bound.
"""

from __future__ import annotations

import json
import pickle
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import (
    check_error,
    counting_url,
    fixture_path,
    run_cli,
    small_state_dict,
    write_dcp,
    write_hf_shards,
)
from helpers_deepspeed import write_zero_tag

import ckpttool
from ckpttool import sources
from ckpttool.inspection import inspect_report
from ckpttool.sources import file_view as source_file

# what a reader may fetch of one file for its metadata: a zip's head and tail and its
# pickle, a safetensors header, a legacy file's pickles (read ahead in 64 KiB) and its
# storages' 8-byte counts; tensor data never
PER_FILE_BOUND = 80 << 10
BIG = 1 << 20  # elements of the large tensor: 4 MiB of float32


def big_state_dict() -> dict:
    """small_state_dict plus a 4 MiB tensor, so that reading any data breaks the bound."""
    g = torch.Generator().manual_seed(5)
    return {**small_state_dict(), "big.weight": torch.randn(BIG // 1024, 1024, generator=g)}


def local_key(path: Path | str) -> str:
    """The local spelling of a path, as ``counting_url`` resolves it."""
    return str(Path(path).resolve())


def strip_scheme(value):
    """A report (or file list) with every ``counting://`` path back to its local path."""
    return json.loads(json.dumps(value).replace("counting://", ""))


def read_both(target, counting_source, **expect):
    """Read ``target`` (a path, a glob or a list) locally and by ``counting://``; assert
    the two agree; return (local checkpoint, counted checkpoint)."""
    targets = target if isinstance(target, list) else [target]
    local_paths = [local_key(t) if "*" not in str(t) else str(t) for t in targets]
    urls = [counting_url(t) if "*" not in str(t) else "counting://" + str(t) for t in targets]
    local = ckpttool.read(local_paths if isinstance(target, list) else local_paths[0])
    counting_source.reset()
    counted = ckpttool.read(urls if isinstance(target, list) else urls[0])
    report = inspect_report(counted)
    assert all(f.startswith("counting://") for f in counted.files), counted.files
    assert counted.format == local.format
    assert strip_scheme(counted.files) == local.files
    assert counted.world_size == local.world_size
    assert counted.globals == local.globals
    assert counted.unverified == local.unverified
    assert strip_scheme(report) == inspect_report(local)
    for key, value in expect.items():
        assert getattr(local, key) == value, (key, getattr(local, key))
    files_read = {path for path, _, _ in counting_source.reads}
    assert files_read, "nothing was read through the counting source"
    assert counting_source.bytes_read <= PER_FILE_BOUND * len(files_read), (
        counting_source.bytes_read,
        len(files_read),
    )
    return local, counted


def data_bytes(ckpt) -> int:
    return inspect_report(ckpt)["nbytes"]


# ------------------------------------------------------------------ built fixtures


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Checkpoints of every single-process format, each with 4 MiB of tensor data."""
    from safetensors.torch import save_file

    base = tmp_path_factory.mktemp("built").resolve()
    sd = big_state_dict()
    torch.save({"model": sd, "epoch": 3}, base / "zip.pt")
    torch.save({"model": sd, "epoch": 3}, base / "legacy.pt", _use_new_zipfile_serialization=False)
    save_file(sd, base / "model.safetensors", metadata={"format": "pt"})
    module = torch.nn.Sequential(torch.nn.Linear(1024, 1024))
    torch.jit.save(torch.jit.script(module), base / "scripted.pt")
    write_hf_shards(base / "hf", sd)
    write_hf_shards(base / "hf_bin", sd, shard_format="zip")
    write_dcp(base / "dcp", {"model": sd, "epoch": 3})
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    writer = dcp.FileSystemWriter(
        str(base / "dcp_st"), serialization_format=SerializationFormat.SAFETENSORS
    )
    write_dcp_with(writer, {"model": sd, "epoch": 3})
    write_zero_tag(base / "ds" / "global_step2", sd, stage=2, world=2)
    (base / "ds" / "latest").write_text("global_step2")
    return base


def write_dcp_with(writer, state) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer)


BUILT = [
    ("zip.pt", "torch-zip"),
    ("legacy.pt", "torch-legacy"),
    ("model.safetensors", "safetensors"),
    ("scripted.pt", "torchscript"),
    ("hf", "safetensors-sharded"),
    ("hf/model.safetensors.index.json", "safetensors-sharded"),
    ("hf_bin", "torch-zip"),
    ("dcp", "dcp"),
    ("dcp/__0_0.distcp", "dcp"),
    ("dcp_st", "dcp"),
    ("ds", "deepspeed"),
    ("ds/global_step2", "deepspeed"),
]


@pytest.mark.parametrize(("name", "fmt"), BUILT, ids=[n for n, _ in BUILT])
def test_counting_read_equals_local_and_reads_metadata_only(built, counting_source, name, fmt):
    local, _ = read_both(built / name, counting_source, format=fmt)
    tensor_bytes = data_bytes(local)
    assert tensor_bytes >= 4 * BIG  # (the bound proves something)
    assert counting_source.bytes_read < tensor_bytes // 8


# ------------------------------------------------------------------ committed fixtures

COMMITTED = [
    ("ddp/ep0-rank0.pt", "torch-zip"),
    ("legacy/model.pt", "torch-legacy"),
    ("torchscript/model.pt", "torchscript"),
    ("safetensors/model.safetensors", "safetensors"),
    ("safetensors_sharded", "safetensors-sharded"),
    ("safetensors_sharded/model.safetensors.index.json", "safetensors-sharded"),
    ("dcp", "dcp"),
    ("snapshots/custom_objects.pt", "torch-zip"),
    ("gpu_saved.pt", "torch-zip"),
    ("composer/ep0-ba4-rank0.pt", "per-rank"),  # one rank's file: its siblings found
    ("composer", "per-rank"),
    ("dtensor/dt-rank1.pt", "per-rank"),
    ("fsdp_uneven/model-rank0.pt", "per-rank"),
    ("deepspeed/zero1", "deepspeed"),
    ("deepspeed/zero2", "deepspeed"),
    ("deepspeed/zero3/global_step3", "deepspeed"),
    ("deepspeed/zero2/global_step3_universal", "deepspeed"),
    ("megatron/gpt", "megatron"),
    ("megatron/nemo2/model", "megatron"),
    ("accelerate/ddp/state", "safetensors"),
    ("accelerate/fsdp1/state", "dcp"),
    ("accelerate/fsdp2/state", "dcp"),
    ("lightning/ddp/last.ckpt", "torch-zip"),
    ("lightning/fsdp/last.ckpt", "dcp"),
    ("verl/ws2", "per-rank"),
    ("torch1/plain.pt", None),
    ("torch1/legacy.pt", "torch-legacy"),
    ("torch1/snapshot.pt", None),
    ("torch1/scripted.pt", "torchscript"),
    ("torch1/ep0-ba20-rank0.pt", "per-rank"),
    ("torch1/dcp", "dcp"),
    ("torch1/dcp_nested", "dcp"),
]


@pytest.mark.parametrize(("name", "fmt"), COMMITTED, ids=[n for n, _ in COMMITTED])
def test_committed_fixtures_read_the_same_by_counting_url(counting_source, name, fmt):
    path = fixture_path(name)
    if not path.exists():
        pytest.skip(f"fixture {name} not generated")
    local, _ = read_both(path, counting_source)
    if fmt is not None:
        assert local.format == fmt


def test_per_rank_glob_and_several_paths(counting_source):
    folder = fixture_path("composer").resolve()
    files = sorted(folder.glob("ep0-ba4-rank*.pt"))
    assert len(files) == 2
    by_glob, _ = read_both(str(folder / "ep0-ba4-rank*.pt"), counting_source)
    by_list, _ = read_both(files, counting_source)
    assert by_glob.format == by_list.format == "per-rank"
    assert by_glob.files == by_list.files == [str(f) for f in files]


def test_dist_run_files_by_counting_url(dist_runs, counting_source):
    """The torchrun outputs: per-rank ShardedTensor and DTensor files, DCP in both
    serializations, DCP's Hugging Face shards."""
    mesh, two = dist_runs.mesh, dist_runs.two
    for target in (
        two / "ep0-ba1-rank0.pt",
        two / "dcp",
        mesh / "model-rank0.pt",
        mesh / "dcp-safetensors",
        mesh / "hf-dist",
        mesh / "hf-dist2",
    ):
        read_both(target, counting_source)


# ------------------------------------------------------------------ refusals


def test_remote_zip_inspect_reads_no_local_header(tmp_path, counting_source):
    """A remote zip's local headers are checked when their bytes are read, not by
    inspect: 300 storages cost a handful of requests, not one each."""
    sd = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(300)}
    torch.save({"model": sd, "epoch": 3}, tmp_path / "many.pt")
    report = inspect_report(ckpttool.read(counting_url(tmp_path / "many.pt")))
    assert len(report["tensors"]) == 300
    assert counting_source.requests <= 8, counting_source.reads
    assert counting_source.bytes_read < 128 << 10
    counting_source.reset()
    loaded = ckpttool.load(counting_url(tmp_path / "many.pt"), mmap=False)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_remote_zip_disguised_local_header_is_refused_on_read(tmp_path, counting_source):
    """The deferred check is the same check: a local header naming another entry than
    the central directory is refused when the tensor is read, as it is locally."""
    torch.save({"a": torch.zeros(4), "b": torch.ones(4)}, tmp_path / "ok.pt")

    raw = bytearray((tmp_path / "ok.pt").read_bytes())
    with zipfile.ZipFile(tmp_path / "ok.pt") as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/1"))
    name_end = info.header_offset + 30 + len(info.filename)
    raw[name_end - 1 : name_end] = b"0"  # its local header now names data/0
    (tmp_path / "disguised.pt").write_bytes(bytes(raw))
    message = "its local header says 'ok/data/0'"  # (the archive keeps its first name)
    with pytest.raises(ckpttool.CkptError, match=message):
        ckpttool.load(tmp_path / "disguised.pt")
    with pytest.raises(ckpttool.CkptError, match=message):
        ckpttool.load(counting_url(tmp_path / "disguised.pt"))


def test_unregistered_scheme_is_one_line_exit_2(tmp_path):
    with pytest.raises(ckpttool.CkptError, match=r"cannot read nosuch:// paths"):
        ckpttool.read("nosuch://bucket/run/x.pt")
    proc = run_cli("inspect", "nosuch://bucket/run/x.pt", cwd=tmp_path)
    check_error(proc, 2, "nosuch://")


ESCAPES = ["../outside.safetensors", "/abs/x.safetensors", "s3://b/x.safetensors", "a\\b", ""]


@pytest.mark.parametrize("shard", ESCAPES)
@pytest.mark.parametrize("via", ["local", "counting"])
def test_index_shard_names_stay_in_the_folder(tmp_path, counting_source, shard, via):
    index = write_hf_shards(tmp_path / "hf", small_state_dict())
    data = json.loads(index.read_text())
    data["weight_map"]["fc.weight"] = shard
    index.write_text(json.dumps(data))
    target = counting_url(index) if via == "counting" else str(index)
    with pytest.raises(ckpttool.CkptError, match="leaves the folder"):
        ckpttool.read(target)


@pytest.mark.parametrize("rel", ["../__0_0.distcp", "/tmp/__0_0.distcp", "s3://b/__0_0.distcp"])
@pytest.mark.parametrize("via", ["local", "counting"])
def test_dcp_storage_paths_stay_in_the_folder(tmp_path, counting_source, rel, via):
    folder = tmp_path / "dcp"
    write_dcp(folder, {"model": small_state_dict()})
    meta_file = folder / ".metadata"
    with open(meta_file, "rb") as f:
        meta = pickle.load(f)  # our own file: plain pickle is fine here
    first = next(iter(meta.storage_data))
    meta.storage_data[first].relative_path = rel
    with open(meta_file, "wb") as f:
        pickle.dump(meta, f)
    target = counting_url(folder) if via == "counting" else str(folder)
    with pytest.raises(ckpttool.CkptError, match="leaves the folder"):
        ckpttool.read(target)
    proc = run_cli("inspect", folder, cwd=tmp_path)
    check_error(proc, 2, "leaves the folder")


@pytest.mark.parametrize("tag", ["../elsewhere", "s3://bucket/global_step2", "/abs", "a\\b"])
def test_deepspeed_latest_tag_is_not_followed_out(tmp_path, counting_source, tag):
    run = tmp_path / "run"
    write_zero_tag(run / "global_step2", small_state_dict())
    (tmp_path / "elsewhere").mkdir()
    (run / "latest").write_text(tag)
    for target in (str(run), counting_url(run)):  # the tag folder beside it is named only
        with pytest.raises(ckpttool.CkptError, match="holds a checkpoint in global_step2/"):
            ckpttool.read(target)


def test_universal_parameter_names_stay_in_zero(tmp_path):
    from ckpttool.formats.deepspeed.universal import param_file

    assert param_file("fc.weight", "fp32") == "zero/fc.weight/fp32.pt"
    for name in ("..", "a/b", "s3://x", "", "a\\b", "x\0"):
        with pytest.raises(ckpttool.CkptError, match="cannot name a folder"):
            param_file(name, "fp32")


def test_child_refuses_names_that_leave_the_folder(counting_source):
    url = "counting:///b/run"
    assert sources.child(url, "zero/w/fp32.pt") == "counting:///b/run/zero/w/fp32.pt"
    assert sources.child("/data/run", "a.pt") == "/data/run/a.pt"
    for name in ("..", "../a", "a/../../b", "/a", "s3://b/a", "a\\b", "", "a//b", "C:x", "\0"):
        with pytest.raises(ckpttool.CkptError, match="leaves the checkpoint's folder"):
            sources.child(url, name)


def test_source_file_reads_spans_the_same_both_ways(tmp_path, counting_source):
    data = bytes(range(256)) * 64
    path = tmp_path / "blob"
    path.write_bytes(data)
    for where in (str(path), counting_url(path)):
        with source_file.SourceFile(where, 100, 10000, edge=512) as f:
            assert f.read(10) == data[100:110]
            f.seek(-20, 2)
            assert f.read() == data[10080:10100]
            f.seek(3000)
            assert f.read(5000) == data[3100:8100]
            assert f.seek(0, 2) == 10000 and f.read(5) == b""
        with pytest.raises(ckpttool.CkptError, match="runs past the end"):
            source_file.SourceFile(where, 100, len(data))
        # the block cache: any read, anywhere, in any order, gives the file's bytes
        import random

        rng = random.Random(0)
        with source_file.SourceFile(where, 7, len(data) - 7, edge=0, block=64) as f:
            for _ in range(300):
                at, n = rng.randrange(len(data)), rng.choice([1, 8, 63, 64, 65, 200, 5000])
                f.seek(at)
                assert f.read(n) == data[7 + at : 7 + at + n]
            assert f.pread(len(data) - 10, 8) == data[-3:]


def test_outputs_named_after_url_inputs_are_local(tmp_path, counting_source):
    """An output is local: named after a URL input, it goes to the current folder; a
    remote input is never taken for the output's path."""
    from ckpttool.targets.local import check_output
    from ckpttool.writers.naming import default_output, output_stem

    (tmp_path / "ep3").mkdir()
    (tmp_path / "ep0-rank0.pt").write_bytes(b"x")
    folder_url = counting_url(tmp_path / "ep3") + "/"
    assert output_stem([folder_url]) == ("", "ep3")
    assert output_stem([counting_url(tmp_path / "ep0-rank0.pt")]) == ("", "ep0")
    assert default_output([folder_url], "safetensors", False) == "ep3.safetensors"
    assert default_output([folder_url], "pt", False) == "ep3.pt"
    assert default_output([folder_url], "dcp", False, folder=str(tmp_path)) == str(
        tmp_path / "ep3-dcp"
    )
    check_output(str(tmp_path / "ep3.pt"), [folder_url], force=False)
    with pytest.raises(ckpttool.CkptError, match="overwrite the input"):  # as before, locally
        check_output(str(tmp_path / "ep3" / "x.pt"), [str(tmp_path / "ep3")], force=False)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize(
    "out, shown",
    [
        # credentials and a pre-signed query never reach the message
        ("https://user:secret@host/out", "https://host/out"),
        ("gs://bucket/out", "gs://bucket/out"),
    ],
)
def test_url_outputs_are_refused_and_nothing_is_written(tmp_path, out, shown):
    """Outputs are local or s3:// (tests/test_s3_output.py): another URL -o is exit 2,
    not a local folder named ``https:`` that the message would call the host."""
    source = fixture_path("ddp/ep0-rank0.pt")
    query = "?X-Amz-Signature=abc" if "secret" in out else ""
    for command, suffix in (("convert", ".safetensors"), ("merge", ".pt")):
        args = ["--to", "safetensors"] if command == "convert" else []
        proc = run_cli(command, source, *args, "-o", out + suffix + query, cwd=tmp_path)
        line = check_error(proc, 2, f"{shown}{suffix}: cannot write the output there")
        assert "secret" not in line and "Signature" not in line
    assert list(tmp_path.iterdir()) == []


def test_file_url_output_is_a_local_path(tmp_path):
    source = fixture_path("ddp/ep0-rank0.pt")
    out = f"file://{tmp_path}/o.safetensors"
    proc = run_cli("convert", source, "--to", "safetensors", "-o", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(ckpttool.load(tmp_path / "o.safetensors")) == sorted(ckpttool.load(source))


@pytest.mark.parametrize(
    "path, want",
    [
        ("/data/run/ep3-rank0.pt", "/data/run/ep3-rank0.pt"),
        ("https://user:pw@host:8080/run/x.pt?X-Amz-Signature=abc#f", "https://host:8080/run/x.pt"),
        ("s3://bucket/run/ep3/", "s3://bucket/run/ep3/"),
        ("hf://Qwen/Qwen2-7B@main/model.safetensors", "hf://Qwen/Qwen2-7B@main/model.safetensors"),
        ("hf://gpt2@main/model.safetensors", "hf://gpt2@main/model.safetensors"),
        ("counting:///tmp/x.pt", "counting:///tmp/x.pt"),
    ],
)
def test_shown_paths_drop_url_secrets_only(path, want):
    assert sources.shown(path) == want
