"""``diff A B``: equal across formats (exit 0), every kind of difference (exit 1) with the
exact ``--json`` document, tolerances, NaNs and infinities, bad inputs (exit 2).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import FIXTURES, check_error, run_cli

from ckpttool.convert import convert
from ckpttool.diff import diff
from ckpttool.errors import CkptError, UsageError

JSON_KEYS = [
    "equal",
    "only_in_a",
    "only_in_b",
    "mismatched",
    "different",
    "compared",
    "atol",
    "rtol",
    "counts",
    "prefixes",
    "tied",
]


def report(**changes) -> dict:
    """The ``--json`` document of two equal checkpoints, with ``changes`` applied."""
    base = {
        "equal": True,
        "only_in_a": [],
        "only_in_b": [],
        "mismatched": [],
        "different": [],
        "compared": 0,
        "atol": 0.0,
        "rtol": 0.0,
    }
    out = {**base, **changes}
    out.setdefault("prefixes", {"a": None, "b": None})
    dtypes = [m for m in out["mismatched"] if m["kind"] == "dtype"]
    counts = {
        "only_in_a": len(out["only_in_a"]),
        "only_in_b": len(out["only_in_b"]),
        "dtype": sum(1 for m in dtypes if not m["within_tolerance"]),
        "shape": len(out["mismatched"]) - len(dtypes),
        "values": len(out["different"]),
        "dtype_within_tolerance": sum(1 for m in dtypes if m["within_tolerance"]),
    }
    prefixes = out.pop("prefixes")
    tied = out.pop("tied", [])
    return {**out, "counts": counts, "prefixes": prefixes, "tied": tied}


def sides(a: str | None = None, b: str | None = None) -> dict:
    """The ``prefixes`` entry: what was stripped from each side's names."""
    return {"a": a, "b": b}


def mismatch(dtype: str, *shape: int) -> dict:
    return {"dtype": dtype, "shape": list(shape)}


def dtype_mismatch(name: str, a: dict, b: dict, max_abs_diff: float, num_different: int,
                   within_tolerance: bool = False) -> dict:  # fmt: skip
    return {"name": name, "kind": "dtype", "a": a, "b": b, "max_abs_diff": max_abs_diff,
            "num_different": num_different, "within_tolerance": within_tolerance}  # fmt: skip


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(8, 4, generator=g)
    return {
        "module.emb.weight": emb,
        "module.head.weight": emb,
        "module.proj.weight": torch.randn(5, 4, generator=g).t(),
        "module.steps": torch.tensor(11),
    }


@pytest.fixture
def formats(tmp_path: Path) -> dict[str, Path]:
    """One DDP snapshot as torch.save, safetensors, HF shards and DCP."""
    pt = tmp_path / "snap.pt"
    torch.save({"MODEL_STATE": model(), "EPOCHS_RUN": 2}, pt)
    out = {"pt": pt}
    for name, to, extra in [
        ("safetensors", "safetensors", {}),
        ("shards", "safetensors", {"max_shard_size": "100"}),
        ("dcp", "dcp", {}),
    ]:
        out[name] = Path(convert([str(pt)], to, str(tmp_path / name), **extra).output)
    return out


def test_cli_equal_across_formats(formats: dict[str, Path]):
    proc = run_cli("diff", formats["pt"], formats["safetensors"], "--json")
    assert proc.returncode == 0, proc.stderr
    assert list(json.loads(proc.stdout)) == JSON_KEYS
    assert json.loads(proc.stdout) == report(compared=4, prefixes=sides("module."))
    proc = run_cli("diff", formats["dcp"], formats["shards"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "equal: 4 tensors compared (bitwise)"


@pytest.mark.parametrize(
    ("a", "b"), [("pt", "dcp"), ("pt", "shards"), ("safetensors", "dcp"), ("dcp", "pt")]
)
def test_equal_across_formats(formats: dict[str, Path], a, b):
    stripped = {"pt": "module."}  # the snapshot's DDP prefix; its conversions have none
    prefixes = sides(stripped.get(a), stripped.get(b))
    assert diff(str(formats[a]), str(formats[b])) == report(compared=4, prefixes=prefixes)


@pytest.mark.slow
def test_sharded_inputs_equal_to_full_state(fsdp2: Path):
    folder = fsdp2
    ranks = str(folder / "ep0-ba2-rank*.pt")
    assert diff(ranks, str(folder / "full.pt")) == report(compared=7)
    assert diff(str(folder / "dcp"), str(folder / "full.pt")) == report(compared=7)
    dtensors = [str(folder / "dt-rank0.pt"), str(folder / "dt-rank1.pt")]
    assert diff(dtensors, ranks) == report(compared=7)


def test_differences_found_in_every_block_and_shard(tmp_path: Path, monkeypatch):
    """Stored bytes are compared block by block: differences on both sides of a block
    boundary, in a short last block, and in shards of different ranks are all counted."""
    from safetensors.torch import save_file

    import ckpttool
    import ckpttool.diff

    monkeypatch.setattr(ckpttool.diff, "BLOCK_BYTES", 64)  # 16 float32 elements
    a = torch.arange(1000, dtype=torch.float32)
    b = a.clone()
    b[[0, 15, 16, 999]] += torch.tensor([1.0, 2.0, 3.0, 0.5])
    torch.save({"x": a, "same": a[:20].clone()}, tmp_path / "a.pt")
    save_file({"x": b, "same": a[:20].clone()}, tmp_path / "b.safetensors")
    got = diff(str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors"))
    assert got["different"] == [{"name": "x", "max_abs_diff": 3.0, "num_different": 4}]
    got = diff(str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors"), atol=1.5)
    assert got["different"] == [{"name": "x", "max_abs_diff": 3.0, "num_different": 2}]

    monkeypatch.setattr(ckpttool.diff, "BLOCK_BYTES", 8)  # 2 float32 elements
    ranks = [str(p) for p in sorted((FIXTURES / "fsdp_uneven").glob("model-rank*.pt"))]
    full = ckpttool.load(ranks, select="all")
    assert diff(ranks, _saved(tmp_path / "full.pt", full), select="all") == report(compared=4)
    full["model"]["0.weight"][1, 3] = 100.0  # the last element, in the last rank's block
    full["model"]["2.bias"][0] = -5.0
    got = diff(ranks, _saved(tmp_path / "changed.pt", full), select="all")
    assert [d["name"] for d in got["different"]] == ["model.0.weight", "model.2.bias"]
    assert [d["num_different"] for d in got["different"]] == [1, 1]


def test_equal_checkpoints_are_compared_without_torch(tmp_path: Path):
    """Identical stored bytes need no torch; only differing blocks are loaded with it."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    tensors = {"w": torch.randn(300, 7), "ids": torch.arange(9)}
    torch.save({"module." + k: v for k, v in tensors.items()}, tmp_path / "a.pt")
    save_file(tensors, tmp_path / "b.safetensors")
    code = (
        "import sys\nfrom ckpttool.diff import diff\n"
        "assert diff(sys.argv[1], sys.argv[2])['equal']\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def _saved(path: Path, obj) -> str:
    torch.save(obj, path)
    return str(path)


def test_differences_exit_1_with_exact_json(tmp_path: Path):
    a = {
        "same": torch.arange(4.0),
        "gone": torch.ones(2),
        "dt": torch.zeros(3),
        "shape": torch.zeros(2, 3),
        "values": torch.tensor([1.0, 2.0, 3.0, 4.0]),
    }
    b = {
        "values": torch.tensor([1.0, 2.5, 3.0, 3.75]),
        "shape": torch.zeros(3, 2),
        "dt": torch.zeros(3, dtype=torch.float64),
        "same": torch.arange(4.0),
        "new": torch.ones(1),
    }
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    proc = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--json")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ""
    want = report(
        equal=False,
        only_in_a=["gone"],
        only_in_b=["new"],
        mismatched=[
            dtype_mismatch("dt", mismatch("float32", 3), mismatch("float64", 3), 0.0, 0),
            {
                "name": "shape",
                "kind": "shape",
                "a": mismatch("float32", 2, 3),
                "b": mismatch("float32", 3, 2),
            },
        ],
        different=[{"name": "values", "max_abs_diff": 0.5, "num_different": 2}],
        compared=4,
    )
    assert json.loads(proc.stdout) == want

    proc = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines == [
        "- only in A: gone",
        "+ only in B: new",
        "! shape: float32[2, 3] vs float32[3, 2]",
        "! dt: float32[3] vs float64[3], max |a-b| 0",
        "different values (largest first):",
        "  name    max |a-b|  elements",
        "  values        0.5         2",
        "different: 1 only in A, 1 only in B, 1 shape, 1 dtype, 1 values; "
        "4 tensors compared (bitwise)",
    ]


@pytest.mark.parametrize(
    ("atol", "rtol", "equal", "num_different"),
    [
        (0.0, 0.0, False, 2),
        (1e-4, 0.0, False, 1),  # covers 3.0 vs 3.00005 only
        (1e-3, 0.0, True, 0),
        (0.0, 1e-3, True, 0),  # |a - b| <= rtol * |b|
        (0.0, 1e-5, False, 2),
    ],
)
def test_tolerances(tmp_path: Path, atol, rtol, equal, num_different):
    torch.save({"x": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}, tmp_path / "a.pt")
    b = torch.tensor([1.0, 2.0005, 3.00005], dtype=torch.float64)
    torch.save({"x": b}, tmp_path / "b.pt")
    result = diff(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), atol=atol, rtol=rtol)
    assert result["equal"] is equal
    assert (result["atol"], result["rtol"]) == (atol, rtol)
    if equal:
        assert result["different"] == []
    else:
        [entry] = result["different"]
        assert entry["num_different"] == num_different
        assert entry["max_abs_diff"] == pytest.approx(0.0005, rel=1e-9)


def test_cli_atol_makes_small_difference_pass(tmp_path: Path):
    torch.save({"x": torch.tensor([1.0, 2.0])}, tmp_path / "a.pt")
    torch.save({"x": torch.tensor([1.0, 2.0001])}, tmp_path / "b.pt")
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    proc = run_cli("diff", a, b, "--atol", "1e-3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == report(compared=1, atol=0.001)


def test_nans_in_the_same_places_are_equal(tmp_path: Path):
    nan = float("nan")
    x = torch.tensor([[1.0, nan], [nan, 4.0]])
    torch.save({"x": x}, tmp_path / "a.pt")
    torch.save({"x": x.clone()}, tmp_path / "b.pt")
    torch.save({"x": torch.tensor([[1.0, nan], [3.0, nan]])}, tmp_path / "c.pt")
    a, b, c = (str(tmp_path / n) for n in ("a.pt", "b.pt", "c.pt"))
    assert diff(a, b) == report(compared=1)
    assert diff(a, b, atol=0.1) == report(compared=1, atol=0.1)
    # NaN against a number is an infinite difference, whatever the tolerance
    for atol, rtol in [(0.0, 0.0), (1e9, 0.5)]:
        result = diff(a, c, atol=atol, rtol=rtol)
        assert result["different"] == [{"name": "x", "max_abs_diff": math.inf, "num_different": 2}]


def test_infinities(tmp_path: Path):
    inf = float("inf")
    torch.save({"x": torch.tensor([inf, -inf, 5.0])}, tmp_path / "a.pt")
    torch.save({"x": torch.tensor([inf, -inf, 5.0])}, tmp_path / "b.pt")
    torch.save({"x": torch.tensor([inf, -inf, inf])}, tmp_path / "c.pt")
    a, b, c = (str(tmp_path / n) for n in ("a.pt", "b.pt", "c.pt"))
    assert diff(a, b, rtol=0.1) == report(compared=1, rtol=0.1)
    for rtol in (0.0, 0.1):  # 5 against inf: no relative tolerance covers it
        result = diff(a, c, rtol=rtol)
        assert result["different"] == [{"name": "x", "max_abs_diff": math.inf, "num_different": 1}]


def test_signed_zero_differs_bitwise_only(tmp_path: Path):
    torch.save({"x": torch.tensor([-0.0, 1.0])}, tmp_path / "a.pt")
    torch.save({"x": torch.tensor([0.0, 1.0])}, tmp_path / "b.pt")
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    assert diff(a, b)["different"] == [{"name": "x", "max_abs_diff": 0.0, "num_different": 1}]
    assert diff(a, b, atol=1e-12)["equal"] is True


def test_select_and_prefix_apply_to_both(formats: dict[str, Path], tmp_path: Path):
    """DDP keys against stripped keys are equal; a --dtype conversion is a dtype mismatch."""
    cast = convert([str(formats["pt"])], "safetensors", str(tmp_path / "h.st"), dtype="float16")
    result = diff(str(formats["pt"]), cast.output)
    assert result["equal"] is False
    assert [m["name"] for m in result["mismatched"]] == ["emb.weight", "head.weight", "proj.weight"]
    assert result["compared"] == 4 and result["different"] == []
    unstripped = diff(str(formats["pt"]), str(formats["pt"]), strip_prefix="none")
    assert unstripped == report(compared=4)


def test_bad_inputs_exit_2(formats: dict[str, Path], tmp_path: Path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    check_error(run_cli("diff", formats["pt"], tmp_path / "nope.pt"), 2, "nope.pt")
    check_error(run_cli("diff", garbage, formats["pt"]), 2, "garbage.pt")
    check_error(run_cli("diff", formats["pt"], formats["pt"], "--atol", "-1"), 2, "--atol")
    with pytest.raises(UsageError):
        diff(str(formats["pt"]), str(formats["pt"]), rtol=-0.1)
    with pytest.raises(CkptError, match="no such file"):
        diff(str(formats["pt"]), str(tmp_path / "missing"))


# -------------------------------------- issue 21: "is my bf16 export right?", counts, limit


@pytest.fixture
def fp32_and_bf16(tmp_path: Path) -> tuple[Path, Path, dict]:
    g = torch.Generator().manual_seed(1)
    sd = {f"layers.{i}.w": torch.randn(64, 32, generator=g) for i in range(3)}
    sd["ids"] = torch.arange(10)
    torch.save(sd, tmp_path / "model.pt")
    out = convert([str(tmp_path / "model.pt")], "safetensors", str(tmp_path / "bf16.st"),
                  dtype="bfloat16").output  # fmt: skip
    return tmp_path / "model.pt", Path(out), sd


def test_bf16_export_within_tolerance_is_equal(fp32_and_bf16):
    a, b, sd = fp32_and_bf16
    worst = max(float((t - t.to(torch.bfloat16).float()).abs().max())
                for k, t in sd.items() if k != "ids")  # fmt: skip
    bitwise = diff(str(a), str(b))
    assert bitwise["equal"] is False
    assert [m["name"] for m in bitwise["mismatched"]] == ["layers.0.w", "layers.1.w", "layers.2.w"]
    for m in bitwise["mismatched"]:
        assert m["kind"] == "dtype" and m["within_tolerance"] is False
        assert m["a"]["dtype"] == "float32" and m["b"]["dtype"] == "bfloat16"
        assert 0 < m["max_abs_diff"] <= worst and m["num_different"] > 0
    assert max(m["max_abs_diff"] for m in bitwise["mismatched"]) == worst
    assert bitwise["counts"] == {"only_in_a": 0, "only_in_b": 0, "dtype": 3, "shape": 0,
                                 "values": 0, "dtype_within_tolerance": 0}  # fmt: skip
    within = diff(str(a), str(b), atol=worst)
    assert within["equal"] is True
    assert all(m["within_tolerance"] and m["num_different"] == 0 for m in within["mismatched"])
    assert within["counts"]["dtype_within_tolerance"] == 3 and within["counts"]["dtype"] == 0
    tight = diff(str(a), str(b), atol=worst / 4)
    assert tight["equal"] is False and tight["counts"]["dtype"] >= 1

    proc = run_cli("diff", a, b, "--atol", "0.05")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith(
        "equal: 4 tensors compared (atol=0.05, rtol=0); 3 tensors within tolerance across "
        "dtypes (fp32 vs bf16), max |a-b| "
    )
    proc = run_cli("diff", a, b)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == "different: 3 dtype; 4 tensors compared (bitwise)"


def test_largest_differences_first_with_limit(tmp_path: Path):
    a = {f"t{i:02d}": torch.zeros(4) for i in range(30)}
    b = {name: t + (i + 1) * 0.5 for i, (name, t) in enumerate(a.items())}
    a["gone"] = torch.ones(1)
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    proc = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--limit", "3")
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "- only in A: gone",
        "different values (largest first):",
        "  name  max |a-b|  elements",
        "  t29          15         4",
        "  t28        14.5         4",
        "  t27          14         4",
        "  … 27 more different tensors (--limit 0 shows all)",
        "different: 1 only in A, 30 values; 30 tensors compared (bitwise)",
    ]
    full = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--limit", "0").stdout
    assert len(full.splitlines()) == 1 + 3 + 30
    proc = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--json", "--limit", "3")
    assert len(json.loads(proc.stdout)["different"]) == 30  # --json keeps every detail


def test_progress_is_told_every_compared_byte(formats: dict[str, Path]):
    import contextlib

    calls, done = [], []

    @contextlib.contextmanager
    def progress(total: int, description: str):
        calls.append((total, description))
        yield done.append

    assert diff(str(formats["pt"]), str(formats["dcp"]), progress=progress)["equal"]
    total = sum(t.numel() * t.element_size() for t in model().values())
    assert calls == [(total, "comparing")] and sum(done) == total
