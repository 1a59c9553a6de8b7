"""``convert``: selection, prefixes, casts, devices, HF shards, every output read back by its
own consumer (safetensors, torch.load, torch.distributed.checkpoint) bitwise, and the
contract's refusals (exit 2, one stderr line, nothing written).
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_identical,
    check_error,
    run_cli,
    safetensors_header,
    sha256,
    shard_source,
    tree_files,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckpttool
from ckpttool.convert import convert, parse_size
from ckpttool.errors import OutputExistsError, UsageError
from ckpttool.writers.naming import default_output

MODEL_KEYS = ["emb.weight", "head.weight", "proj.weight", "norm.bias", "bn.num_batches_tracked"]
WRITTEN_KEYS = [k for k in MODEL_KEYS if k != "head.weight"]  # the tie is written once


def load_tied(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors and the tied names its metadata records, as
    safetensors' ``load_model`` gives them back (``load_file`` gives the stored ones)."""
    loaded = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
    for alias, kept in metadata.items():
        if alias not in loaded and kept in loaded:
            loaded[alias] = loaded[kept]
    return loaded


def snapshot_model() -> dict[str, torch.Tensor]:
    """A DDP model state dict: tied weights, a transposed view, a strided slice, an int."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 4, generator=g)
    return {
        "module.emb.weight": emb,
        "module.head.weight": emb,  # tied: the same tensor under two names
        "module.proj.weight": torch.randn(6, 4, generator=g).t(),  # non-contiguous view
        "module.norm.bias": torch.randn(20, generator=g)[3:15:3],  # strided slice
        "module.bn.num_batches_tracked": torch.tensor(7),
    }


@pytest.fixture
def snap(tmp_path: Path) -> Path:
    """A Composer-style training snapshot around a DDP model state dict."""
    model = snapshot_model()
    momentum = torch.full((4, 6), 0.5)
    snapshot = {
        "state": {
            "model": model,
            "optimizers": {"SGD": {"state": {0: {"momentum_buffer": momentum}}}},
            "timestamp": {"epoch": 3},
        },
        "rng": [{"torch": torch.ByteTensor([1, 2, 3])}],
    }
    path = tmp_path / "snap.pt"
    torch.save(snapshot, path)
    return path


def expected_model(prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k.removeprefix("module."): v for k, v in snapshot_model().items()}


# ------------------------------------------------------------------ --to safetensors


def test_cli_safetensors_default_name_header_and_bytes(snap: Path):
    proc = run_cli("convert", snap, "--to", "safetensors")
    assert proc.returncode == 0, proc.stderr
    out = snap.parent / "snap.safetensors"
    assert tree_files(snap.parent) == ["snap.pt", "snap.safetensors"]
    assert proc.stderr.splitlines() == [f"wrote {out} (5 tensors, 280 B)"]

    header = safetensors_header(out)
    metadata = {"format": "pt", "source": "snap.pt", "head.weight": "emb.weight"}
    assert header.pop("__metadata__") == metadata  # the tie, as save_model records it
    assert list(header) == WRITTEN_KEYS
    offsets = [header[k]["data_offsets"] for k in WRITTEN_KEYS]
    assert offsets == [[0, 160], [160, 256], [256, 272], [272, 280]]
    assert header["proj.weight"] == {"dtype": "F32", "shape": [4, 6], "data_offsets": [160, 256]}
    assert header["bn.num_batches_tracked"]["dtype"] == "I64"

    assert sorted(load_file(out)) == sorted(WRITTEN_KEYS)
    loaded = load_tied(out)
    assert_identical({k: loaded[k] for k in MODEL_KEYS}, expected_model())
    with safe_open(out, "pt") as f:
        assert f.metadata() == metadata
        assert list(f.keys()) == sorted(WRITTEN_KEYS)
        assert torch.equal(f.get_tensor("proj.weight"), snapshot_model()["module.proj.weight"])


def all_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of the snapshot, named as ``--select all`` names them."""
    model = {"state.model." + k: v for k, v in snapshot_model().items()}
    return {
        **model,
        "state.optimizers.SGD.state.0.momentum_buffer": torch.full((4, 6), 0.5),
        "rng.0.torch": torch.ByteTensor([1, 2, 3]),
    }


M = "state.model.module."
OPT = "state.optimizers.SGD.state.0.momentum_buffer"


@pytest.mark.parametrize(
    ("select", "strip", "want"),
    [
        ("auto", "auto", {k: M + k for k in MODEL_KEYS}),
        ("auto", "none", {"module." + k: M + k for k in MODEL_KEYS}),
        ("state.model", "auto", {k: M + k for k in MODEL_KEYS}),
        ("state.model", "none", {"module." + k: M + k for k in MODEL_KEYS}),
        ("state.model", "module.", {k: M + k for k in MODEL_KEYS}),
        # a prefix only some keys have: those lose it, the others keep their names
        (
            "state.model",
            "module.emb.",
            {"weight": M + "emb.weight", **{"module." + k: M + k for k in MODEL_KEYS[1:]}},
        ),
        ("all", "auto", {k: k for k in all_tensors()}),
        ("state.optimizers", "auto", {"SGD.state.0.momentum_buffer": OPT}),
    ],
)
def test_select_and_strip_prefix(snap: Path, tmp_path: Path, select, strip, want):
    """``want`` maps each output name to its source, named as ``--select all`` names it."""
    out = tmp_path / "out.safetensors"
    result = convert([str(snap)], "safetensors", str(out), select=select, strip_prefix=strip)
    assert (result.output, result.files, result.num_tensors) == (str(out), [out.name], len(want))
    header = safetensors_header(out)
    del header["__metadata__"]
    tied = [k for k, v in want.items() if v.endswith("head.weight")]  # written once
    assert list(header) == [k for k in want if k not in tied]
    loaded = load_tied(out)
    source = all_tensors()
    assert_identical({k: loaded[k] for k in want}, {k: source[v] for k, v in want.items()})


def test_select_unknown_key_is_exit_2(snap: Path, tmp_path: Path):
    proc = run_cli("convert", snap, "--to", "safetensors", "--select", "state.nope")
    check_error(proc, 2, "'nope'")
    assert tree_files(snap.parent) == ["snap.pt"]


def test_select_one_tensor_keeps_its_name(tmp_path: Path):
    """--select model.0.weight: the tensor is written under its key, not under ''."""
    path = tmp_path / "m.pt"
    torch.save({"model": {"0.weight": torch.ones(2), "b": torch.zeros(1)}}, path)
    out = tmp_path / "one.safetensors"
    convert([str(path)], "safetensors", str(out), select="model.0.weight")
    assert list(load_file(out)) == ["0.weight"]


def test_tied_weights_written_once_and_read_back_tied(snap: Path, tmp_path: Path):
    """A weight saved under two names (an embedding tied to its head) is written once, as
    save_pretrained writes it, the other name mapped to it in the metadata; ckpttool and
    load_model give both names back, one tensor."""
    import ckpttool

    out = tmp_path / "t.safetensors"
    convert([str(snap)], "safetensors", str(out))
    assert "head.weight" not in load_file(out)
    loaded = load_tied(out)
    assert torch.equal(loaded["emb.weight"], loaded["head.weight"])
    back = ckpttool.load(out)
    assert list(back) == [*WRITTEN_KEYS, "head.weight"]
    assert back["head.weight"].data_ptr() == back["emb.weight"].data_ptr()
    again = tmp_path / "again.safetensors"  # and a conversion of the output is the same bytes
    convert([str(out)], "safetensors", str(again))
    assert safetensors_header(again)["__metadata__"]["head.weight"] == "emb.weight"
    assert load_file(again).keys() == load_file(out).keys()

    convert([str(snap)], "pt", str(tmp_path / "t.pt"))
    pt = torch.load(tmp_path / "t.pt", weights_only=True)
    assert torch.equal(pt["emb.weight"], pt["head.weight"])
    # --to pt keeps the sharing, as torch.save wrote it: one storage, one weight
    assert pt["emb.weight"].untyped_storage().data_ptr() == (
        pt["head.weight"].untyped_storage().data_ptr()
    )
    stored = [n for n in zipfile.ZipFile(tmp_path / "t.pt").namelist() if "/data/" in n]
    assert len(stored) == len(WRITTEN_KEYS)  # the tied weight's bytes once
    # views come back contiguous and own exactly their elements
    assert pt["proj.weight"].is_contiguous() and pt["norm.bias"].is_contiguous()
    assert pt["norm.bias"].untyped_storage().nbytes() == 4 * 4


@pytest.mark.parametrize("to", ["safetensors", "pt", "dcp"])
@pytest.mark.parametrize("cast", ["float16", "bfloat16"])
def test_dtype_casts_floating_tensors_only(snap: Path, tmp_path: Path, to, cast):
    out = tmp_path / f"cast-{to}"
    result = convert([str(snap)], to, str(out), dtype=cast)
    want = {
        k: v.to(getattr(torch, cast)) if v.is_floating_point() else v
        for k, v in expected_model().items()
    }
    tied = 40 * 2 if to in ("safetensors", "pt") else 0  # the tied head written once there
    assert result.nbytes == 2 * (40 * 2) + 24 * 2 + 4 * 2 + 8 - tied  # ints keep 8 bytes
    got = read_back(out, to, want)
    assert got["bn.num_batches_tracked"].dtype == torch.int64
    assert_identical(got, want)


def read_back(out: Path, to: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The output read by its own consumer: safetensors, torch.load, or DCP load."""
    if to == "safetensors":
        loaded = load_tied(out)
        return {k: loaded[k] for k in like}
    if to == "pt":
        return torch.load(out, weights_only=True)
    import torch.distributed.checkpoint as dcp

    state = {k: torch.full_like(v.contiguous(), 1) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in one process"
        dcp.load(state, checkpoint_id=str(out))
    return state


def test_pt_output_loads_weights_only_and_mmap(snap: Path, tmp_path: Path):
    result = convert([str(snap)], "pt")
    assert result.output == str(snap.parent / "snap-converted.pt")  # snap.pt is the input
    assert result.files == ["snap-converted.pt"]
    for mmap in (False, True):
        loaded = torch.load(result.output, weights_only=True, mmap=mmap)
        assert type(loaded) is dict
        assert_identical(loaded, expected_model())


def test_map_location_cuda1_recorded_in_pt_output(snap: Path, tmp_path: Path):
    out = tmp_path / "gpu.pt"
    convert([str(snap)], "pt", str(out), map_location="cuda:1")
    info = json.loads(run_cli("inspect", out, "--json").stdout)
    assert [t["key"] for t in info["tensors"]] == [[k] for k in MODEL_KEYS]
    assert {t["device"] for t in info["tensors"]} == {"cuda:1"}
    loaded = torch.load(out, map_location="cpu", weights_only=True)
    assert_identical(loaded, expected_model())
    assert {str(v.device) for v in loaded.values()} == {"cpu"}


def test_dcp_output_loads_without_process_group_and_inspects(snap: Path, tmp_path: Path):
    result = convert([str(snap)], "dcp")
    out = Path(result.output)
    assert out == snap.parent / "snap-dcp"
    assert tree_files(out) == [".metadata", "__0_0.distcp"]
    assert_identical(read_back(out, "dcp", expected_model()), expected_model())
    ckpt = ckpttool.read(str(out))
    assert ckpt.format == "dcp"
    info = json.loads(run_cli("inspect", out, "--json").stdout)
    assert info["format"] == "dcp"
    assert [t["key"] for t in info["tensors"]] == [[k] for k in MODEL_KEYS]
    assert [t["shape"] for t in info["tensors"]] == [[10, 4], [10, 4], [4, 6], [4], []]


# ------------------------------------------------------------------ HF shards


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_many_input_files_keep_few_descriptors_open(tmp_path: Path, monkeypatch):
    """Inputs stay open while copying, but only the last few: thousands of rank or shard
    files must not reach the per-process descriptor limit, nor leak one."""
    import contextlib
    import os

    import ckpttool.sources

    source = shard_source()
    torch.save(source, tmp_path / "w.pt")
    shards = tmp_path / "shards"
    convert([str(tmp_path / "w.pt")], "safetensors", str(shards), max_shard_size="100")
    monkeypatch.setattr(ckpttool.sources.source, "MAX_OPEN_FILES", 2)

    def open_inputs() -> int:
        fds = [os.path.join("/proc/self/fd", n) for n in os.listdir("/proc/self/fd")]
        return sum(os.readlink(fd).startswith(str(shards)) for fd in fds if os.path.islink(fd))

    seen = []

    @contextlib.contextmanager
    def progress(total, description):
        yield lambda n: seen.append(open_inputs())

    before = os.listdir("/proc/self/fd")
    out = tmp_path / "one.safetensors"
    convert([str(shards)], "safetensors", str(out), progress=progress)
    assert sorted(os.listdir("/proc/self/fd")) == sorted(before)
    assert len(seen) == len(source) and max(seen) == 2  # 6 shard files, 2 open at most
    assert_identical(load_file(out), source)


def test_max_shard_size_default_folder(snap: Path):
    result = convert([str(snap)], "safetensors", max_shard_size="100")
    out = snap.parent / "snap-safetensors"
    assert result.output == str(out)
    assert tree_files(out) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 280}  # the tied head written once
    assert index["weight_map"] == {
        "emb.weight": "model-00001-of-00003.safetensors",
        "proj.weight": "model-00002-of-00003.safetensors",
        "norm.bias": "model-00003-of-00003.safetensors",
        "bn.num_batches_tracked": "model-00003-of-00003.safetensors",
    }
    first = safetensors_header(out / "model-00001-of-00003.safetensors")["__metadata__"]
    assert first["head.weight"] == "emb.weight"  # beside the weight it names


@pytest.mark.parametrize(
    ("text", "size"),
    [("100", 100), ("1KB", 1000), ("1KiB", 1024), ("2GB", 2 * 10**9), ("1.5GiB", 3 << 29)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["abc", "", "0", "-5", "10XB", "1.5.5MB"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_default_output_names():
    assert default_output(["/d/ep0-ba2-rank0.pt"], "safetensors", False) == "/d/ep0-ba2.safetensors"
    assert default_output(["/d/ep0-ba2-rank*.pt"], "pt", False) == "/d/ep0-ba2.pt"
    assert default_output(["/d/ckpt"], "safetensors", True) == "/d/ckpt-safetensors"
    assert default_output(["/d/ckpt/"], "dcp", False) == "/d/ckpt-dcp"


@pytest.mark.parametrize(
    ("fixture", "given"),
    [
        ("safetensors_sharded", "model.safetensors.index.json"),
        ("dcp", "__0_0.distcp"),
        ("megatron/gpt", "metadata.json"),
    ],
)
def test_a_file_standing_for_its_folder_names_the_output_beside_the_folder(
    tmp_path: Path, fixture, given
):
    """The checkpoint is the folder: its output goes beside it, named after it, and the
    folder gains no file (a model.safetensors written into a Hugging Face folder would
    be what from_pretrained loads next)."""
    import shutil

    from helpers import FIXTURES

    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / fixture, folder)
    before = tree_files(folder)
    result = convert([str(folder / given)], "safetensors")
    assert result.output == str(tmp_path / "ckpt.safetensors")
    assert tree_files(folder) == before
    direct = convert([str(folder)], "safetensors", str(tmp_path / "direct.safetensors"))
    got, want = load_file(result.output), load_file(direct.output)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------ sharded inputs


def full_model(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "full.pt", weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "inputs"),
    [
        ("fsdp2", lambda d: [str(d / "ep0-ba2-rank0.pt"), str(d / "ep0-ba2-rank1.pt")]),
        ("fsdp2", lambda d: str(d / "ep0-ba2-rank*.pt")),  # a quoted glob
        ("fsdp2", lambda d: str(d / "ep0-ba2-rank1.pt")),  # one rank: siblings found
        ("fsdp3", lambda d: str(d / "ep0-ba2-rank2.pt")),  # rank 2 holds no rows of 3.*
        ("fsdp2", lambda d: [str(d / "dt-rank0.pt"), str(d / "dt-rank1.pt")]),  # DTensor
        ("fsdp2", lambda d: str(d / "dcp")),
    ],
    ids=["per-rank-paths", "per-rank-glob", "one-rank-file", "3-ranks-empty", "dtensor", "dcp"],
)
def test_sharded_inputs_convert_to_full_tensors(request, tmp_path: Path, run, inputs):
    folder = request.getfixturevalue(run)
    want = full_model(folder)
    out = tmp_path / "full.safetensors"
    convert(inputs(folder), "safetensors", str(out))
    header = safetensors_header(out)
    del header["__metadata__"]
    assert list(header) == list(want)
    loaded = load_file(out)
    assert_identical({k: loaded[k] for k in want}, want, exact_types=False)


@pytest.mark.slow
def test_sharded_cli_to_pt(fsdp3: Path, tmp_path: Path):
    out = tmp_path / "m.pt"
    proc = run_cli("convert", fsdp3 / "ep0-ba2-rank*.pt", "--to", "pt", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert_identical(torch.load(out, weights_only=True), full_model(fsdp3), exact_types=False)


# ------------------------------------------------------------------ refusals


def test_existing_output_refused_without_force(snap: Path):
    out = snap.parent / "snap.safetensors"
    out.write_bytes(b"precious")
    proc = run_cli("convert", snap, "--to", "safetensors")
    check_error(proc, 2, "--force", str(out))
    assert out.read_bytes() == b"precious"
    assert tree_files(snap.parent) == ["snap.pt", "snap.safetensors"]
    with pytest.raises(OutputExistsError):
        convert([str(snap)], "safetensors", str(out))


def test_force_replaces_file_and_folder(snap: Path, tmp_path: Path):
    out = tmp_path / "o.safetensors"
    save_file({"old": torch.zeros(1)}, out)  # an earlier output (--force replaces no other file)
    convert([str(snap)], "safetensors", str(out), force=True)
    assert_identical({k: load_tied(out)[k] for k in MODEL_KEYS}, expected_model())

    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "model-00001-of-00003.safetensors").write_text("an earlier run's shard")
    (folder / "other.txt").write_text("not ours: --force never touches it")
    convert([str(snap)], "safetensors", str(folder), max_shard_size="1GB", force=True)
    assert tree_files(tmp_path) == [
        "o.safetensors",
        "shards",
        "shards/model-00001-of-00001.safetensors",
        "shards/model.safetensors.index.json",
        "shards/other.txt",
        "snap.pt",
    ]


@pytest.mark.parametrize("force", [False, True])
def test_output_equal_to_input_refused(snap: Path, force):
    before = sha256(snap)
    args = ["convert", snap, "--to", "pt", "-o", snap, *(["--force"] if force else [])]
    check_error(run_cli(*args), 2, "overwrite the input")
    assert sha256(snap) == before
    assert tree_files(snap.parent) == ["snap.pt"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--to", "onnx"], "--to 'onnx'"),
        (["--to", "safetensors", "--dtype", "int8"], "--dtype 'int8'"),
        (["--to", "pt", "--dtype", "float64"], "--dtype 'float64'"),
        (["--to", "safetensors", "--max-shard-size", "abc"], "'abc'"),
        (["--to", "pt", "--max-shard-size", "1GB"], "--max-shard-size"),
        (["--to", "safetensors", "--map-location", "cuda:1"], "--map-location"),
        (["--to", "pt", "--map-location", "gpu0"], "--map-location 'gpu0'"),
    ],
)
def test_bad_options_exit_2_before_reading(snap: Path, args, needle):
    proc = run_cli("convert", snap, *args)
    check_error(proc, 2, needle)
    assert tree_files(snap.parent) == ["snap.pt"]


def test_missing_input_exit_2(tmp_path: Path):
    check_error(run_cli("convert", tmp_path / "nope.pt", "--to", "pt"), 2, "nope.pt")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("to", ["pt", "dcp"])
def test_quantized_tensors_keep_their_quantizer(tmp_path: Path, to):
    """Quantized tensors (torchvision's published int8 weights are) read and write with their
    scheme: per tensor (scale, zero point) and per channel (scales, zero points, axis)."""
    torch.manual_seed(0)
    sd = {
        "w": torch.randn(2),
        "pt": torch.quantize_per_tensor(torch.randn(4, 3), 0.1, 3, torch.quint8).t(),
        "pc": torch.quantize_per_channel(
            torch.randn(3, 2),
            torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64),
            torch.tensor([0, 1, -1]),
            0,
            torch.qint8,
        ),
        "i32": torch.quantize_per_tensor(torch.randn(5), 0.5, 0, torch.qint32),
    }
    torch.save(sd, tmp_path / "q.pt")
    report = json.loads(run_cli("inspect", tmp_path / "q.pt", "--json").stdout)
    assert [(t["key"], t["dtype"]) for t in report["tensors"]] == [
        (["w"], "float32"),
        (["pt"], "quint8"),
        (["pc"], "qint8"),
        (["i32"], "qint32"),
    ]
    out = tmp_path / f"o.{to}"
    proc = run_cli("convert", tmp_path / "q.pt", "--to", to, "-o", out)
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
    for got in (ckpttool.load(tmp_path / "q.pt"), ckpttool.load(out)):
        for key, want in sd.items():
            assert got[key].dtype == want.dtype, key
            if want.is_quantized:
                assert got[key].qscheme() == want.qscheme(), key
                assert torch.equal(got[key].int_repr(), want.int_repr()), key
                assert torch.equal(got[key].dequantize(), want.dequantize()), key
            else:
                assert torch.equal(got[key], want), key
    if to == "pt":  # torch reads it as it reads its own
        again = torch.load(out, weights_only=True)
        assert torch.equal(again["pc"].q_per_channel_scales(), sd["pc"].q_per_channel_scales())
        assert again["pt"].q_scale() == 0.1 and again["pt"].q_zero_point() == 3
    assert run_cli("diff", tmp_path / "q.pt", out).returncode == 0


@pytest.mark.parametrize("to", ["safetensors", "pt"])
def test_empty_views_past_their_storage_end_convert(tmp_path: Path, to):
    """torch lets an empty view sit past its storage's end (a strided slice of a 1x1
    tensor); it has no bytes to copy, so it is no truncated input."""
    base = torch.arange(1.0).reshape(1, 1)
    past_end = base[1:1:2, 1:1:2]
    assert past_end.storage_offset() > base.numel()
    torch.save({"empty": past_end, "w": torch.ones(2)}, tmp_path / "in.pt")
    out = tmp_path / f"out.{'pt' if to == 'pt' else 'safetensors'}"
    convert([str(tmp_path / "in.pt")], to=to, out=str(out))
    got = load_file(out) if to == "safetensors" else torch.load(out, weights_only=True)
    assert sorted(got) == ["empty", "w"]
    assert got["empty"].shape == (0, 0) and torch.equal(got["w"], torch.ones(2))
    assert ckpttool.load(tmp_path / "in.pt")["empty"].shape == (0, 0)


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("fp16", "float16"),
        ("half", "float16"),
        ("torch.float16", "float16"),
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("fp32", "float32"),
        ("float", "float32"),
    ],
)
def test_dtype_takes_the_names_inspect_prints_and_torchs_aliases(snap, tmp_path, alias, name):
    by_alias, by_name = tmp_path / "a.safetensors", tmp_path / "n.safetensors"
    proc = run_cli("convert", snap, "--to", "safetensors", "--dtype", alias, "-o", by_alias)
    assert proc.returncode == 0, proc.stderr
    convert([str(snap)], "safetensors", str(by_name), dtype=name)
    assert by_alias.read_bytes() == by_name.read_bytes()


def test_an_unknown_dtype_names_the_choices(snap, tmp_path):
    proc = run_cli("convert", snap, "--to", "safetensors", "--dtype", "fp8", "-o", tmp_path / "x")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "ckpttool: error: unknown --dtype 'fp8' (choose one of float32, float16, bfloat16 "
        "(or fp32, fp16, half, bf16))"
    ]


def test_convert_of_a_dcp_folder_with_a_short_data_file_says_what_it_lost(tmp_path):
    """A truncated ``__1_0.distcp``: the model tensors (in it, whole) are converted and the
    line names the unselected tensor whose bytes are gone; selecting that tensor, or
    merging everything, is refused before anything is written."""
    import shutil

    from helpers import FIXTURES, run_many

    folder = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp", folder)
    data = folder / "__1_0.distcp"
    os.truncate(data, data.stat().st_size - 200)
    short = f"{data.stat().st_size:,}"
    runs = run_many(
        [
            ["convert", folder, "--to", "safetensors", "-o", tmp_path / "model.safetensors"],
            ["convert", folder, "--select", "all", "--to", "pt", "-o", tmp_path / "all.pt"],
            ["merge", folder, "-o", tmp_path / "merged.pt"],
        ]
    )
    assert runs[0]["code"] == 0
    assert runs[0]["stderr"].splitlines() == [
        f"warning: {data} is short ({short} bytes): 'rng.0.torch' cannot be read (not "
        "selected; not written)",
        f"wrote {tmp_path / 'model.safetensors'} (4 tensors, 852 B)",
    ]
    assert runs[1]["code"] == 2 and runs[1]["stderr"] == (
        f"ckpttool: error: {data}: file too short: {short} bytes, but the checkpoint places "
        "the bytes of 'rng.0.torch' up to byte 74,623 (truncated?)\n"
    )
    assert runs[2]["code"] == 2 and "file too short" in runs[2]["stderr"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "model.safetensors"]


def test_no_source_metadata_gives_the_same_bytes_whatever_the_input_is_called(tmp_path):
    torch.save({"w": torch.arange(6.0)}, tmp_path / "a.pt")
    (tmp_path / "b.pt").write_bytes((tmp_path / "a.pt").read_bytes())
    outs = {n: tmp_path / f"{n}.safetensors" for n in ("a", "b", "a-bare", "b-bare")}
    from helpers import run_many

    runs = run_many(
        [
            ["convert", tmp_path / "a.pt", "--to", "safetensors", "-o", outs["a"]],
            ["convert", tmp_path / "b.pt", "--to", "safetensors", "-o", outs["b"]],
            ["convert", tmp_path / "a.pt", "--to", "safetensors", "-o", outs["a-bare"]]
            + ["--no-source-metadata"],
            ["convert", tmp_path / "b.pt", "--to", "safetensors", "-o", outs["b-bare"]]
            + ["--no-source-metadata"],
        ]
    )
    assert [r["code"] for r in runs] == [0, 0, 0, 0]
    assert safetensors_header(outs["a"])["__metadata__"] == {"format": "pt", "source": "a.pt"}
    assert safetensors_header(outs["a-bare"])["__metadata__"] == {"format": "pt"}
    assert sha256(outs["a"]) != sha256(outs["b"])
    assert sha256(outs["a-bare"]) == sha256(outs["b-bare"])
    assert load_file(outs["a-bare"])["w"].equal(torch.arange(6.0))


def test_lightning_model_prefix_is_stripped_by_auto_only_in_a_lightning_checkpoint(tmp_path):
    """Lightning's ``state_dict`` of a module holding its network as ``self.model``: every
    key starts ``model.``; auto strips it there (inspect names it), and nowhere else (an
    HF state dict whose head is tied and left out has every key under ``model.`` too)."""
    import ckpttool as api

    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    inner = net.state_dict()
    lightning = {
        "epoch": 1,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"model._orig_mod.{k}": v for k, v in inner.items()},
    }
    torch.save(lightning, tmp_path / "last.ckpt")
    plain = {"state_dict": {f"model.{k}": v for k, v in inner.items()}}
    torch.save(plain, tmp_path / "plain.pt")
    from helpers import run_many

    runs = run_many(
        [
            ["inspect", tmp_path / "last.ckpt", "--json"],
            ["convert", tmp_path / "last.ckpt", "--to", "safetensors", "-o", tmp_path / "l.st"],
            ["convert", tmp_path / "plain.pt", "--to", "safetensors", "-o", tmp_path / "p.st"],
        ]
    )
    assert [r["code"] for r in runs] == [0, 0, 0], runs
    assert json.loads(runs[0]["stdout"])["prefix"] == "model._orig_mod."
    assert sorted(load_file(tmp_path / "l.st")) == sorted(inner)
    assert sorted(load_file(tmp_path / "p.st")) == sorted(f"model.{k}" for k in inner)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    api.load_into(fresh, tmp_path / "last.ckpt")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in inner.items())
