"""Every format read from its copy on a loopback HTTP server and on moto's S3 server equals
the local read bitwise: ``inspect --json``, ``load(select="all")`` and ``convert --to
safetensors`` (output bytes). Plus the CLI on remote inputs: the transfer it reports,
and one line, exit 2, for each way a server can go wrong."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import ROOT, assert_identical, check_error, run_cli, safetensors_header
from servers import RangeServer, S3Server

import ckpttool
from ckpttool import sources
from ckpttool.convert import convert
from ckpttool.inspection import inspect_report
from ckpttool.sources.remote import base

pytest.importorskip("s3fs")
pytest.importorskip("moto")

BUCKET = "ckpt"

# (fixture, format): files over both HTTP and S3
FILES = [
    ("ddp/ep0-rank0.pt", "torch-zip"),
    ("legacy/model.pt", "torch-legacy"),
    ("torchscript/model.pt", "torchscript"),
    ("safetensors/model.safetensors", "safetensors"),
    ("safetensors_sharded/model.safetensors.index.json", "safetensors-sharded"),
    ("snapshots/custom_objects.pt", "torch-zip"),
    ("gpu_saved.pt", "torch-zip"),
    ("dcp/__0_0.distcp", "dcp"),  # one .distcp: its folder's .metadata names the rest
    ("dcp/.metadata", "dcp"),
    ("megatron/gpt/metadata.json", "megatron"),
    ("boundary.safetensors", "safetensors"),  # a header of exactly 100,000 bytes
]
# folders, and a rank's file whose siblings are found by listing: S3 only (HTTP has
# no listing)
FOLDERS = [
    ("safetensors_sharded", "safetensors-sharded"),
    ("dcp", "dcp"),
    ("composer/ep0-ba4-rank0.pt", "per-rank"),
    ("composer/ep0-ba4-rank*.pt", "per-rank"),
    ("dtensor/dt-rank1.pt", "per-rank"),
    ("deepspeed/zero2", "deepspeed"),
    ("deepspeed/zero3/global_step3", "deepspeed"),
    ("megatron/gpt", "megatron"),
]
# several files given explicitly: per-rank over HTTP too
RANK_LISTS = [
    (["composer/ep0-ba4-rank0.pt", "composer/ep0-ba4-rank1.pt"], "per-rank"),
    (["dtensor/dt-rank0.pt", "dtensor/dt-rank1.pt"], "per-rank"),
]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The committed fixtures copied into a folder, served over HTTP and uploaded to S3;
    yields (local folder, HTTP URL prefix, S3 URL prefix)."""
    local = tmp_path_factory.mktemp("remote-fixtures").resolve() / "fx"
    shutil.copytree(ROOT / "fixtures", local, ignore=shutil.ignore_patterns("*.py", "*.md"))
    import torch

    # larger than the first read window (two ranged GETs) and than what a server
    # without Range support may send whole
    torch.save({"w": torch.arange(400_000, dtype=torch.float32)}, local / "big.pt")
    write_boundary_safetensors(local / "boundary.safetensors")
    http = RangeServer(local)
    s3 = S3Server()
    undo = s3.configure()
    sources.forget("s3")
    s3.upload(local, BUCKET, "fx")
    yield local, http.url(""), f"s3://{BUCKET}/fx/"
    sources.forget("s3")
    undo()
    s3.close()
    http.close()


def write_boundary_safetensors(path: Path) -> None:
    """A safetensors file whose JSON header is exactly 100,000 bytes, the size
    huggingface_hub's remote header read got wrong (hf_hub#4602)."""
    import struct

    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [4, 5], "data_offsets": [0, 80]},
        "b": {"dtype": "I64", "shape": [3], "data_offsets": [80, 104]},
    }
    text = json.dumps(header).encode()
    text += b" " * (100_000 - len(text))
    data = bytes(range(104))
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def targets(names, prefix: str) -> list[str] | str:
    return [prefix + n for n in names] if isinstance(names, list) else prefix + names


def as_local(value, prefix: str, local: Path):
    return json.loads(json.dumps(value).replace(prefix, str(local) + "/"))


def check_same(copies, names, fmt, which: str, tmp_path: Path) -> None:
    local, http_prefix, s3_prefix = copies
    prefix = http_prefix if which == "http" else s3_prefix
    here, there = targets(names, str(local) + "/"), targets(names, prefix)
    want, got = ckpttool.read(here), ckpttool.read(there)
    if fmt is not None:
        assert want.format == fmt
    report = inspect_report(got)
    expected = inspect_report(want)
    del report["transfer"], expected["transfer"]
    assert as_local(report, prefix, local) == expected
    assert_identical(ckpttool.load(there, select="all"), ckpttool.load(here, select="all"))
    outputs = []
    for name, source in (("local", here), ("remote", there)):
        out = tmp_path / f"{name}.safetensors"
        convert(source if isinstance(source, list) else [source], "safetensors", str(out))
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(("name", "fmt"), FILES, ids=[n for n, _ in FILES])
@pytest.mark.parametrize("which", ["http", "s3"])
def test_files_equal_their_local_read(copies, tmp_path, name, fmt, which):
    check_same(copies, name, fmt, which, tmp_path)


@pytest.mark.parametrize(("name", "fmt"), FOLDERS, ids=[n for n, _ in FOLDERS])
def test_folders_and_globs_on_s3_equal_their_local_read(copies, tmp_path, name, fmt):
    check_same(copies, name, fmt, "s3", tmp_path)


@pytest.mark.parametrize(("names", "fmt"), RANK_LISTS, ids=["composer", "dtensor"])
@pytest.mark.parametrize("which", ["http", "s3"])
def test_listed_rank_files_equal_their_local_read(copies, tmp_path, names, fmt, which):
    check_same(copies, names, fmt, which, tmp_path)


def test_http_folder_says_how_to_read_it(copies):
    _, http_prefix, _ = copies
    with pytest.raises(ckpttool.CkptError, match="HTTP cannot list a folder"):
        ckpttool.read(http_prefix + "dcp/")


# ---------------------------------------------------------------------------- the CLI


def test_inspect_reports_its_transfer(copies):
    local, http_prefix, _ = copies
    proc = run_cli("inspect", "--json", http_prefix + "ddp/ep0-rank0.pt")
    assert proc.returncode == 0, proc.stderr
    transfer = json.loads(proc.stdout)["transfer"]
    size = (local / "ddp" / "ep0-rank0.pt").stat().st_size
    assert 0 < transfer["bytes"] <= max(size, 2 * base.FIRST_WINDOW)
    assert 1 <= transfer["requests"] <= 5
    text = run_cli("inspect", http_prefix + "ddp/ep0-rank0.pt")
    assert text.returncode == 0, text.stderr
    assert "transfer:" in text.stdout and " requests" in text.stdout
    local_text = run_cli("inspect", local / "ddp" / "ep0-rank0.pt")
    assert "transfer:" not in local_text.stdout


def test_merge_and_diff_cli_on_s3(copies, tmp_path):
    local, _, s3_prefix = copies
    outputs = []
    for name, source in (("remote", s3_prefix), ("local", str(local) + "/")):
        out = tmp_path / f"{name}.pt"
        proc = run_cli("merge", source + "composer/ep0-ba4-rank*.pt", "-o", out)
        assert proc.returncode == 0, proc.stderr
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    proc = run_cli("diff", s3_prefix + "dcp", local / "dcp")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("diff", s3_prefix + "ddp/ep0-rank0.pt", local / "ddp" / "ep0-rank1.pt")
    assert proc.returncode in (0, 1), proc.stderr


def test_load_into_from_s3(copies):
    import torch

    local, _, s3_prefix = copies
    want = ckpttool.load(str(local / "dcp"))
    model = {k: torch.zeros_like(v) for k, v in want.items()}
    result = ckpttool.load_into(model, s3_prefix + "dcp")
    assert not result.missing_keys and not result.unexpected_keys
    assert_identical(model, want, ordered=False)


def test_convert_from_s3_glob_cli(copies, tmp_path):
    local, _, s3_prefix = copies
    out_remote, out_local = tmp_path / "r.safetensors", tmp_path / "l.safetensors"
    proc = run_cli(
        "convert", s3_prefix + "composer/ep0-ba4-rank*.pt", "--to", "safetensors", "-o", out_remote
    )
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(
        "convert", str(local / "composer/ep0-ba4-rank*.pt"), "--to", "safetensors", "-o", out_local
    )
    assert proc.returncode == 0, proc.stderr
    assert out_remote.read_bytes() == out_local.read_bytes()


@pytest.mark.parametrize(
    ("mode", "name", "needles"),
    [
        ("short", "big.pt", ["cannot read after 2 attempts: the server sent"]),
        ("badrange", "big.pt", ["the server sent Content-Range"]),
        ("etag", "big.pt", ["changed while being read"]),
        ("gone", "big.pt", ["no such file"]),
        ("denied", "big.pt", ["access denied (HTTP 403)"]),
        ("norange", "big.pt", ["ignores Range requests"]),
        ("norange", "ddp/ep0-rank0.pt", []),  # a small file: read whole, once: works
        ("flaky", "ddp/ep0-rank0.pt", []),  # 503, 503, then it works
    ],
)
def test_bad_servers_cli(copies, monkeypatch, mode, name, needles):
    local, http_prefix, _ = copies
    monkeypatch.setenv("CKPTTOOL_REMOTE_RETRIES", "3" if mode == "flaky" else "2")
    monkeypatch.setenv("CKPTTOOL_REMOTE_BACKOFF", "0")
    url = http_prefix.replace("/ok/", f"/{mode}/") + name
    proc = run_cli("inspect", url)
    if not needles:
        assert proc.returncode == 0, proc.stderr
        return
    line = check_error(proc, 2, *needles)
    assert line.startswith(f"ckpttool: error: {url}: ")


def test_missing_extra_cli(copies, tmp_path):
    sitecustomize = tmp_path / "sitecustomize.py"
    sitecustomize.write_text("import sys\nsys.modules['s3fs'] = None\n")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}"
    try:
        proc = run_cli("inspect", "s3://bucket/x.pt")
    finally:
        os.environ["PYTHONPATH"] = env_path
    check_error(proc, 2, "needs the package s3fs", "pip install 'ckpttool[s3]'")


def test_secrets_in_urls_are_never_shown(copies):
    _, http_prefix, _ = copies
    url = http_prefix.replace("http://", "http://user:s3cret@").replace("/ok/", "/gone/")
    proc = run_cli("inspect", url + "ddp/ep0-rank0.pt?X-Amz-Signature=deadbeef")
    line = check_error(proc, 2)
    assert "s3cret" not in line and "deadbeef" not in line
    assert http_prefix.replace("/ok/", "/gone/") + "ddp/ep0-rank0.pt: " in line


def test_a_url_with_a_query_is_no_pattern(copies):
    """A pre-signed URL (its signature in the query) is read as it is."""
    local, http_prefix, _ = copies
    got = ckpttool.read(http_prefix + "ddp/ep0-rank0.pt?X-Amz-Signature=deadbeef")
    assert got.format == "torch-zip"
    with pytest.raises(ckpttool.CkptError, match="HTTP cannot expand a pattern"):
        ckpttool.read(http_prefix + "composer/ep0-ba4-rank*.pt")


def test_outputs_named_after_a_presigned_url_carry_no_signature(copies, tmp_path):
    """An output named after a URL input takes the last part of its path: a pre-signed
    URL's signature goes neither into the file name nor into the safetensors metadata."""
    _, http_prefix, _ = copies
    url = http_prefix + "safetensors/model.safetensors?X-Amz-Signature=deadbeef"
    proc = run_cli("convert", url, "--to", "safetensors", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert safetensors_header(tmp_path / "model.safetensors")["__metadata__"] == {
        "format": "pt",
        "source": "model.safetensors",
    }
    assert "deadbeef" not in proc.stdout + proc.stderr


def test_secrets_in_urls_are_not_in_reports(copies):
    """inspect's own output (--json files and tensor files, the text view) shows a URL
    without its user, password and query, as error messages do."""
    _, http_prefix, _ = copies
    url = http_prefix.replace("http://", "http://user:s3cret@") + "ddp/ep0-rank0.pt"
    signed = url + "?X-Amz-Signature=deadbeef"
    as_json = run_cli("inspect", "--json", signed)
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["files"] == [http_prefix + "ddp/ep0-rank0.pt"]
    assert {t["file"] for t in report["tensors"]} == {http_prefix + "ddp/ep0-rank0.pt"}
    as_text = run_cli("inspect", "--full", signed, columns=200)
    assert as_text.returncode == 0, as_text.stderr
    for out in (as_json.stdout, as_text.stdout):
        assert "s3cret" not in out and "deadbeef" not in out and "user:" not in out
