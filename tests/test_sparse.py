"""Sparse tensors (COO, CSR, CSC, BSR, BSC): read as torch.load gives them, inspected
without densifying, written to torch files as sparse, refused where a format has none."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import check_error, run_cli, run_many, sha256

import ckpttool
from ckpttool.diff import diff
from ckpttool.errors import CkptError

pytestmark = pytest.mark.filterwarnings("ignore:.*[Ss]parse")  # torch's beta/invariant notes


def dense_source(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(6, 4, generator=g)
    d[d.abs() < 0.8] = 0
    return d


def sparse_tensors() -> dict[str, torch.Tensor]:
    d = dense_source()
    hybrid = torch.sparse_coo_tensor(  # one sparse dim, one dense dim
        torch.tensor([[0, 2]]), torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), (4, 3)
    )
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 1], [1, 1, 0]]), torch.tensor([1.0, 2.0, 3.0]), (2, 2)
    )
    return {
        "coo": d.to_sparse(),
        "csr": d.to_sparse_csr(),
        "csc": d.to_sparse_csc(),
        "bsr": d.to_sparse_bsr((2, 2)),
        "bsc": d.to_sparse_bsc((2, 2)),
        "hybrid": hybrid,
        "uncoalesced": uncoalesced,
        "ints": torch.tensor([[0, 3], [-2, 0]], dtype=torch.int32).to_sparse(),
        "empty": torch.zeros(3, 5).to_sparse(),
    }


def assert_same_sparse(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.layout == want.layout
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.layout == torch.sparse_coo:
        assert got.is_coalesced() == want.is_coalesced()
        assert torch.equal(got._indices(), want._indices())
        assert torch.equal(got._values(), want._values())
    else:
        rows = (torch.sparse_csr, torch.sparse_bsr)
        compressed = got.crow_indices if want.layout in rows else got.ccol_indices
        plain = got.col_indices if want.layout in rows else got.row_indices
        want_compressed = want.crow_indices if want.layout in rows else want.ccol_indices
        want_plain = want.col_indices if want.layout in rows else want.row_indices
        assert torch.equal(compressed(), want_compressed())
        assert torch.equal(plain(), want_plain())
        assert torch.equal(got.values(), want.values())


@pytest.fixture
def sparse_file(tmp_path: Path) -> Path:
    path = tmp_path / "sparse.pt"
    torch.save({"model": {"dense": torch.ones(2), **sparse_tensors()}, "step": 3}, path)
    return path


def test_load_gives_what_torch_load_gives(sparse_file: Path):
    want = torch.load(sparse_file, weights_only=True)["model"]
    got = ckpttool.load(sparse_file)
    assert list(got) == list(want)
    for name, tensor in want.items():
        if tensor.layout == torch.strided:
            assert torch.equal(got[name], tensor)
        else:
            assert_same_sparse(got[name], tensor)


def test_sparse_parameter_and_legacy_format(tmp_path: Path):
    param = torch.nn.Parameter(dense_source().to_sparse())
    path = tmp_path / "legacy.pt"
    torch.save({"p": param, "csr": dense_source(1).to_sparse_csr()}, path,
               _use_new_zipfile_serialization=False)  # fmt: skip
    got = ckpttool.load(path)
    assert_same_sparse(got["p"], param.detach())
    assert_same_sparse(got["csr"], dense_source(1).to_sparse_csr())
    report = json.loads(run_cli("inspect", path, "--json").stdout)
    assert report["format"] == "torch-legacy"
    assert [t["layout"] for t in report["tensors"]] == ["sparse_coo", "sparse_csr"]


class OldSparse:
    """Pickles a COO tensor as torch < 2.1 did: (indices, values, size), no is_coalesced."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __reduce_ex__(self, protocol):
        data = (self.t._indices(), self.t._values(), self.t.size())
        return (torch._utils._rebuild_sparse_tensor, (self.t.layout, data))


def test_coo_without_is_coalesced_reads(tmp_path: Path):
    t = dense_source().to_sparse()
    torch.save({"w": OldSparse(t)}, tmp_path / "old.pt")
    got = ckpttool.load(tmp_path / "old.pt")["w"]
    assert torch.equal(got.to_dense(), t.to_dense())
    assert got.layout == torch.sparse_coo


def test_inspect_json_reports_dense_shape_and_stored_bytes(sparse_file: Path):
    proc = run_cli("inspect", sparse_file, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = {t["key"][-1]: t for t in report["tensors"]}
    src = sparse_tensors()
    coo = src["coo"]
    assert rows["coo"] == {
        "key": ["model", "coo"],
        "dtype": "float32",
        "shape": [6, 4],
        "device": "cpu",
        "nbytes": coo._indices().nbytes + coo._values().nbytes,
        "sharded": False,
        "layout": "sparse_coo",
        "file": str(sparse_file),
    }
    csr = src["csr"]
    parts = (csr.crow_indices(), csr.col_indices(), csr.values())
    assert rows["csr"]["nbytes"] == sum(p.nbytes for p in parts)
    assert rows["bsc"]["layout"] == "sparse_bsc"
    assert rows["ints"]["dtype"] == "int32"
    assert "layout" not in rows["dense"]
    assert report["num_params"] == sum(t.numel() for t in src.values()) + 2


def test_inspect_stats_are_those_of_the_dense_tensor(tmp_path: Path):
    d = dense_source()
    d[0, 0], d[1, 1] = float("nan"), float("inf")
    torch.save({"w": d.to_sparse(), "c": d.to_sparse_csr()}, tmp_path / "s.pt")
    proc = run_cli("inspect", tmp_path / "s.pt", "--json", "--stats")
    assert proc.returncode == 0, proc.stderr
    finite = d[torch.isfinite(d)].to(torch.float64)
    for entry in json.loads(proc.stdout)["tensors"]:
        stats = entry["stats"]
        assert (stats["nan"], stats["inf"]) == (1, 1)
        assert stats["min"] == finite.min().item() and stats["max"] == finite.max().item()
        assert math.isclose(stats["mean"], finite.mean().item(), rel_tol=1e-12)
        assert math.isclose(stats["std"], finite.std().item(), rel_tol=1e-12)


def test_inspect_table_names_the_layout(sparse_file: Path):
    proc = run_cli("inspect", sparse_file, columns=200)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if "model.csc" in line)
    assert "fp32 sparse_csc" in row and "[6, 4]" in row


def test_corrupt_sparse_indices_are_refused_when_read(tmp_path: Path):
    # an index past the shape: torch.load refuses it, and so must we (read out of bounds)
    bad = torch.sparse_coo_tensor(
        torch.tensor([[0, 9], [0, 0]]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    )
    path = tmp_path / "bad.pt"
    torch.save({"w": bad}, path)
    with pytest.raises(CkptError, match="corrupt sparse tensor"):
        ckpttool.load(path)
    assert run_cli("inspect", path, "--json").returncode == 0  # metadata alone is fine
    check_error(run_cli("convert", path, "--to", "pt"), 2, "corrupt sparse tensor (sparse_coo)")
    assert not (tmp_path / "bad-converted.pt").exists()


@pytest.mark.parametrize("cast", [None, "float16"])
def test_convert_to_pt_keeps_sparse_tensors(sparse_file: Path, tmp_path: Path, cast):
    out = tmp_path / "out.pt"
    args = ["--dtype", cast] if cast else []
    proc = run_cli("convert", sparse_file, "--to", "pt", "-o", out, *args)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(out, weights_only=True)
    want = torch.load(sparse_file, weights_only=True)["model"]
    assert list(got) == list(want)
    for name, tensor in want.items():
        if cast and tensor.is_floating_point():
            tensor = tensor.to(torch.float16)  # values cast, indices kept
        if tensor.layout == torch.strided:
            assert torch.equal(got[name], tensor)
        else:
            assert_same_sparse(got[name], tensor)


@pytest.mark.parametrize("to, name", [("safetensors", "safetensors"), ("dcp", "DCP")])
def test_convert_to_dense_only_formats_is_refused(sparse_file: Path, tmp_path: Path, to, name):
    before = sha256(sparse_file)
    out = tmp_path / "out"
    proc = run_cli("convert", sparse_file, "--to", to, "-o", out)
    check_error(proc, 2, "tensor 'coo' is sparse (sparse_coo)", f"{name} stores dense", "--to pt")
    assert not out.exists() and sha256(sparse_file) == before
    assert [p.name for p in tmp_path.iterdir()] == ["sparse.pt"]  # no temporary left


def test_merge_keeps_sparse_tensors_in_the_nested_structure(sparse_file: Path, tmp_path: Path):
    out = tmp_path / "merged.pt"
    proc = run_cli("merge", sparse_file, "-o", out)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(out, weights_only=True)
    want = torch.load(sparse_file, weights_only=True)
    assert got["step"] == 3
    for name, tensor in want["model"].items():
        if tensor.layout != torch.strided:
            assert_same_sparse(got["model"][name], tensor)


def test_diff_compares_the_values_sparse_tensors_stand_for(tmp_path: Path):
    d = dense_source()
    changed = d.clone()
    row, col = (d == 0).nonzero()[0]
    changed[row, col] = 7.0  # a position the original does not store
    files = {
        "a": {"w": d.to_sparse()},
        "csr": {"w": d.to_sparse_csr()},
        "dense": {"w": d},
        "changed": {"w": changed.to_sparse()},
    }
    for name, sd in files.items():
        torch.save(sd, tmp_path / f"{name}.pt")

    pairs = [("a", "a"), ("a", "csr"), ("a", "dense"), ("a", "changed"), ("changed", "dense"),
             ("a", "changed", "--atol", "7")]  # fmt: skip
    argvs = [["diff", tmp_path / f"{x}.pt", tmp_path / f"{y}.pt", "--json", *extra]
             for x, y, *extra in pairs]  # fmt: skip
    runs = [(r["code"], json.loads(r["stdout"])) for r in run_many(argvs)]
    assert runs[0][0] == 0
    assert runs[1][0] == 0  # same values, other layout
    assert runs[2][0] == 0
    code, result = runs[3]
    assert code == 1
    assert result["different"] == [{"name": "w", "max_abs_diff": 7.0, "num_different": 1}]
    code, result = runs[4]
    assert code == 1 and result["different"][0]["num_different"] == 1
    assert runs[5][0] == 0


def test_unknown_layout_stays_inert(tmp_path: Path):
    class Odd:
        def __reduce_ex__(self, protocol):
            return (torch._utils._rebuild_sparse_tensor, (torch.strided, (torch.ones(1),)))

    torch.save({"w": torch.ones(2), "odd": Odd()}, tmp_path / "odd.pt")
    report = json.loads(run_cli("inspect", tmp_path / "odd.pt", "--json").stdout)
    assert report["values"][0]["value"] == "<opaque torch._utils._rebuild_sparse_tensor>"


def test_huge_sparse_tensors_are_inspected_and_compared_without_densifying(tmp_path: Path):
    side = 10**9  # dense: 4 * 10**18 bytes
    indices = torch.tensor([[0, side - 1, 5], [3, side - 1, 7]])
    a = torch.sparse_coo_tensor(indices, torch.tensor([1.0, -2.0, 3.0]), (side, side))
    moved = indices.clone()
    moved[0, 2] = 6
    b = torch.sparse_coo_tensor(moved, torch.tensor([1.0, -2.0, 3.0]), (side, side))
    torch.save({"w": a}, tmp_path / "a.pt")
    torch.save({"w": b}, tmp_path / "b.pt")
    result = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    # (5, 7) holds 3 in a and nothing in b; (6, 7) the other way round
    assert result["different"] == [{"name": "w", "max_abs_diff": 3.0, "num_different": 2}]
    assert diff(tmp_path / "a.pt", tmp_path / "a.pt")["equal"]
    proc = run_cli("inspect", tmp_path / "a.pt", "--json", "--stats")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["tensors"][0]["stats"]
    assert (stats["min"], stats["max"]) == (-2.0, 3.0)
    assert math.isclose(stats["mean"], 2.0 / side**2)


@pytest.mark.parametrize("dtype", [torch.uint32, torch.float8_e5m2])
def test_value_types_without_sparse_kernels_get_stats_and_diff(tmp_path: Path, dtype):
    # uncoalesced: torch has no coalesce kernel for these types
    indices = torch.tensor([[0, 0, 1], [1, 1, 0]])
    t = torch.sparse_coo_tensor(indices, torch.tensor([1, 2, 3]).to(dtype), (2, 2))
    torch.save({"w": t}, tmp_path / "a.pt")
    proc = run_cli("inspect", tmp_path / "a.pt", "--json", "--stats")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["tensors"][0]["stats"]
    assert (stats["min"], stats["max"], stats["mean"]) == (0, 3, 1.5)  # [[0, 1+2], [3, 0]]
    assert diff(tmp_path / "a.pt", tmp_path / "a.pt")["equal"]


def test_diff_of_zero_dim_sparse_tensors(tmp_path: Path):
    torch.save({"w": torch.tensor(3.0).to_sparse()}, tmp_path / "a.pt")
    torch.save({"w": torch.tensor(4.0).to_sparse()}, tmp_path / "b.pt")
    assert diff(tmp_path / "a.pt", tmp_path / "a.pt")["equal"]
    assert diff(tmp_path / "a.pt", tmp_path / "b.pt")["different"][0]["max_abs_diff"] == 1.0


def test_hybrid_and_fully_sparse_compare_without_densifying(tmp_path: Path):
    side = 10**9
    hybrid = torch.sparse_coo_tensor(  # two sparse dims, one dense dim of 2
        torch.tensor([[1], [2]]), torch.tensor([[5.0, 6.0]]), (side, side, 2)
    )
    full = torch.sparse_coo_tensor(
        torch.tensor([[1, 1], [2, 2], [0, 1]]), torch.tensor([5.0, 6.0]), (side, side, 2)
    )
    torch.save({"w": hybrid}, tmp_path / "hybrid.pt")
    torch.save({"w": full}, tmp_path / "full.pt")
    assert diff(tmp_path / "hybrid.pt", tmp_path / "full.pt")["equal"]


@pytest.mark.parametrize(
    "data, needle",
    [
        ((torch.tensor([[0]]), torch.tensor([1.0]), (10**12, 10**12)), "impossible shape"),
        ((torch.tensor([[0.0]]), torch.tensor([1.0]), (2,)), "indices are not integers"),
    ],
)
def test_impossible_sparse_metadata_is_refused_by_inspect(tmp_path: Path, data, needle):
    class Raw:
        def __reduce_ex__(self, protocol):
            return (torch._utils._rebuild_sparse_tensor, (torch.sparse_coo, (*data, False)))

    torch.save({"w": Raw()}, tmp_path / "bad.pt")
    check_error(run_cli("inspect", tmp_path / "bad.pt"), 2, "corrupt sparse tensor", needle)
