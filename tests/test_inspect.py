"""``ckpttool inspect``: the --json shape of the contract, --filter, --stats, human output,
and that it reads metadata only (torch is never imported)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_cli, small_state_dict, write_dcp
from safetensors.torch import save_file

TOP_KEYS = {
    "format": str,
    "files": list,
    "world_size": (int, type(None)),
    "prefix": (str, type(None)),
    "model_key": (list, type(None)),
    "tensors": list,
    "num_tensors": int,
    "num_params": int,
    "nbytes": int,
    "values": list,
    "metadata": dict,
    "globals": list,
    "dangerous": list,
}
TENSOR_KEYS = {"key", "dtype", "shape", "device", "nbytes", "sharded", "file"}
# added by the safety work beside this file's (the contract lists it): allowed, not required
OPTIONAL_TOP_KEYS = {"unverified"}
FORMATS = {
    "torch-zip",
    "torch-legacy",
    "torchscript",
    "safetensors",
    "safetensors-sharded",
    "dcp",
    "per-rank",
}


def inspect_json(*args) -> dict:
    proc = run_cli("inspect", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    report = json.loads(proc.stdout)  # ONE JSON object, nothing else on stdout
    check_schema(report)
    return report


def check_schema(report: dict) -> None:
    assert set(TOP_KEYS) <= set(report) <= set(TOP_KEYS) | OPTIONAL_TOP_KEYS
    for key, types in TOP_KEYS.items():
        assert isinstance(report[key], types), key
    assert report["format"] in FORMATS
    assert all(isinstance(f, str) for f in report["files"])
    assert report["num_tensors"] == len(report["tensors"])
    assert report["nbytes"] == sum(t["nbytes"] for t in report["tensors"])
    for t in report["tensors"]:
        extra = {"shards"} if t["sharded"] else set()
        extra |= {"stats"} if "stats" in t else set()
        assert set(t) == TENSOR_KEYS | extra, t
        assert t["key"] and all(isinstance(k, (str, int)) for k in t["key"])
        assert isinstance(t["dtype"], str) and not t["dtype"].startswith("torch.")
        assert all(isinstance(n, int) for n in t["shape"])
        assert isinstance(t["device"], str) and isinstance(t["sharded"], bool)
        assert t["file"] is None or t["file"] in report["files"]
        assert t["nbytes"] == math.prod(t["shape"]) * _itemsize(t["dtype"])
    for v in report["values"]:
        assert set(v) == {"key", "type", "value"}
        assert isinstance(v["type"], str)
    assert report["globals"] == sorted(report["globals"])
    assert set(report["dangerous"]) <= set(report["globals"])


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """The contract's example: a torchrun-tutorial snapshot of a DDP model."""
    path = tmp_path_factory.mktemp("inspect") / "ep0-rank0.pt"
    torch.manual_seed(0)
    fc = torch.nn.Linear(20, 4)
    torch.save(
        {
            "MODEL_STATE": {"module.fc.weight": fc.weight.data, "module.fc.bias": fc.bias.data},
            "EPOCHS_RUN": 3,
        },
        path,
    )
    return path


def test_json_matches_the_contract_example(snapshot):
    report = inspect_json(snapshot)
    report.pop("unverified", None)
    assert report == {
        "format": "torch-zip",
        "files": [str(snapshot)],
        "world_size": None,
        "prefix": "module.",
        "model_key": ["MODEL_STATE"],
        "tensors": [
            {
                "key": ["MODEL_STATE", "module.fc.weight"],
                "dtype": "float32",
                "shape": [4, 20],
                "device": "cpu",
                "nbytes": 320,
                "sharded": False,
                "file": str(snapshot),
            },
            {
                "key": ["MODEL_STATE", "module.fc.bias"],
                "dtype": "float32",
                "shape": [4],
                "device": "cpu",
                "nbytes": 16,
                "sharded": False,
                "file": str(snapshot),
            },
        ],
        "num_tensors": 2,
        "num_params": 84,
        "nbytes": 336,
        "values": [{"key": ["EPOCHS_RUN"], "type": "int", "value": 3}],
        "metadata": {},
        "globals": [
            "collections.OrderedDict",
            "torch.FloatStorage",
            "torch._utils._rebuild_tensor_v2",
        ],
        "dangerous": [],
    }


def test_json_for_every_local_format(tmp_path):
    sd = small_state_dict()
    torch.save(sd, tmp_path / "a.pt", _use_new_zipfile_serialization=False)
    save_file(sd, tmp_path / "a.safetensors")
    write_dcp(tmp_path / "dcp", {"model": sd, "step": 5})
    legacy = inspect_json(tmp_path / "a.pt")
    assert legacy["format"] == "torch-legacy"
    st = inspect_json(tmp_path / "a.safetensors")
    assert st["format"] == "safetensors" and st["globals"] == [] and st["model_key"] == []
    assert sorted(t["key"][0] for t in st["tensors"]) == sorted(sd)
    dcp = inspect_json(tmp_path / "dcp")
    assert dcp["format"] == "dcp"
    assert dcp["world_size"] == 1
    assert dcp["model_key"] == ["model"]
    assert {"key": ["step"], "type": "int", "value": 5} in dcp["values"]
    weight = next(t for t in dcp["tensors"] if t["key"] == ["model", "fc.weight"])
    assert weight["shape"] == [4, 3] and weight["sharded"] is True and weight["nbytes"] == 48


@pytest.mark.slow
def test_json_for_per_rank_has_global_shapes(dist_runs):
    report = inspect_json(dist_runs.two / "ep0-ba1-rank*.pt")
    assert report["format"] == "per-rank"
    assert report["world_size"] == 2
    assert report["files"] == [str(dist_runs.two / f"ep0-ba1-rank{r}.pt") for r in (0, 1)]
    sharded = [t for t in report["tensors"] if t["sharded"]]
    assert {tuple(t["key"][-1:]) for t in sharded if t["key"][1] == "model"} == {
        ("0.weight",),
        ("0.bias",),
        ("2.weight",),
        ("2.bias",),
    }
    by_key = {tuple(t["key"]): t for t in report["tensors"]}
    assert by_key[("state", "model", "2.weight")]["shape"] == [3, 5]
    assert by_key[("state", "model", "2.weight")]["nbytes"] == 60
    assert by_key[("state", "model", "2.weight")]["shards"] == 2
    assert report["dangerous"] == []
    assert "torch.distributed._shard.sharded_tensor.api.ShardedTensor" in report["globals"]


def test_filter(snapshot):
    report = inspect_json(snapshot, "--filter", r"bias$")
    assert [t["key"] for t in report["tensors"]] == [["MODEL_STATE", "module.fc.bias"]]
    assert report["num_tensors"] == 1 and report["nbytes"] == 16
    assert report["values"] == []
    report = inspect_json(snapshot, "--filter", "EPOCHS")
    assert report["tensors"] == []
    assert report["values"] == [{"key": ["EPOCHS_RUN"], "type": "int", "value": 3}]


def test_bad_filter_is_exit_2(snapshot):
    from conftest import check_error

    check_error(run_cli("inspect", "--filter", "(", snapshot), 2, "--filter")


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "stats.pt"
    torch.save(
        {
            "known": torch.tensor([1.0, 2.0, 3.0, 4.0]),
            "bad": torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 3.0]),
            "ints": torch.tensor([1, 5, -2], dtype=torch.int32),
            "half": torch.tensor([0.5, -0.5], dtype=torch.float16),
            "empty": torch.empty(0),
            "all_nan": torch.tensor([float("nan")]),
        },
        path,
    )
    return path


def test_stats_values_are_exact(stats_file):
    import ckpttool
    from ckpttool.report import inspect_report

    report = inspect_report(ckpttool.read(stats_file), stats=True)  # what --json --stats prints
    check_schema(json.loads(json.dumps(report)))
    stats = {t["key"][0]: t["stats"] for t in report["tensors"]}
    known = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert stats["known"] == {
        "min": 1.0,
        "max": 4.0,
        "mean": 2.5,
        "std": float(known.std()),
        "nan": 0,
        "inf": 0,
    }
    assert stats["known"]["std"] == pytest.approx(math.sqrt(5 / 3), rel=1e-15)
    # NaN/Inf are counted and left out of min/max/mean/std
    assert stats["bad"] == {
        "min": 1.0,
        "max": 3.0,
        "mean": 2.0,
        "std": math.sqrt(2),
        "nan": 1,
        "inf": 2,
    }
    assert stats["ints"]["min"] == -2 and stats["ints"]["max"] == 5
    assert isinstance(stats["ints"]["min"], int)
    assert stats["ints"]["mean"] == pytest.approx(4 / 3)
    assert stats["half"] == {
        "min": -0.5,
        "max": 0.5,
        "mean": 0.0,
        "std": math.sqrt(0.5),
        "nan": 0,
        "inf": 0,
    }
    for name in ("empty", "all_nan"):
        assert stats[name]["min"] is None and stats[name]["std"] is None
    assert stats["all_nan"]["nan"] == 1


def test_human_output(snapshot):
    """Summary first (format, file, model, size, values, security), then the tables."""
    proc = run_cli("inspect", snapshot)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:6] == [
        "format: torch-zip",
        f"file: {snapshot}",
        "model: MODEL_STATE, 2 tensors, 84 parameters, wrapper prefix module.",
        "size: 336 B in 2 tensors (fp32 336 B)",
        "values: EPOCHS_RUN=3",
        "security: read without running code; 3 globals, none dangerous",
    ]
    assert lines[6:] == [
        "",
        "tensors: 2",
        "  name                          dtype  shape     size",
        "  MODEL_STATE.module.fc.weight  fp32   [4, 20]  320 B",
        "  MODEL_STATE.module.fc.bias    fp32   [4]       16 B",
        "",
        "structure:",
        "  MODEL_STATE  model state dict",
        "  EPOCHS_RUN   int",
    ]
    assert proc.stderr == ""


def test_human_output_for_safetensors_says_no_code(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    proc = run_cli("inspect", tmp_path / "w.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("format: safetensors\n")
    assert "security: safetensors, no code involved" in proc.stdout.splitlines()
    assert "device" not in proc.stdout  # a format without devices has no device column


def test_inspect_does_not_change_the_input(snapshot):
    from conftest import sha256

    before = sha256(snapshot)
    run_cli("inspect", snapshot)
    assert sha256(snapshot) == before


NO_TORCH = """
import sys
sys.argv = ["ckpttool", *sys.argv[1:]]
from ckpttool.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
assert code == 0, code
print("TORCH_IMPORTED" if "torch" in sys.modules else "TORCH_NOT_IMPORTED", file=sys.stderr)
"""


def _inspect_in_process(*args) -> tuple[str, str]:
    """Run the CLI's main in a fresh interpreter: (stdout, whether torch got imported)."""
    env = dict(os.environ, COLUMNS="250")
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "inspect", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_inspect_never_imports_torch(tmp_path, snapshot, dist_runs):
    sd = small_state_dict()
    torch.save(sd, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    save_file(sd, tmp_path / "w.safetensors")
    cases = [
        (snapshot,),
        ("--json", snapshot),
        (tmp_path / "legacy.pt",),
        (tmp_path / "w.safetensors",),
        ("--json", dist_runs.two / "dcp"),
        ("--json", dist_runs.two / "ep0-ba1-rank0.pt"),
        (dist_runs.two / "dtensor-rank0.pt",),
    ]
    for args in cases:
        assert _inspect_in_process(*args)[1] == "TORCH_NOT_IMPORTED", args


def test_stats_human_output_and_torch_import(stats_file):
    """--stats reads tensors, so it does import torch: the check above can fail."""
    out, imported = _inspect_in_process("--stats", stats_file)
    assert imported == "TORCH_IMPORTED"
    row = next(line for line in out.splitlines() if "bad" in line)
    assert "1/2" in row  # the nan/inf column
    for column in ("min", "max", "mean", "std", "nan/inf"):
        assert column in out


@pytest.mark.filterwarnings("ignore:ComplexHalf:UserWarning")
def test_stats_for_dtypes_without_min_max_kernels_and_meta_tensors(tmp_path):
    """One tensor torch has no reduction for must not fail --stats for the whole file."""
    sd = {
        "u16": torch.tensor([1, 65535], dtype=torch.uint16),
        "u32": torch.tensor([0, 2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([3, 2**64 - 1], dtype=torch.uint64),
        "meta": torch.empty(3, device="meta"),
        "c32": torch.tensor([3 + 4j]).to(torch.complex32),
    }
    torch.save(sd, tmp_path / "odd.pt")
    proc = run_cli("inspect", "--stats", "--json", tmp_path / "odd.pt")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    stats = {t["key"][0]: t["stats"] for t in json.loads(proc.stdout)["tensors"]}
    assert (stats["u16"]["min"], stats["u16"]["max"]) == (1, 65535)
    assert (stats["u32"]["min"], stats["u32"]["max"]) == (0, 2**32 - 1)
    assert (stats["u64"]["min"], stats["u64"]["max"]) == (3, 2**64 - 1)
    assert stats["meta"]["min"] is None and stats["meta"]["mean"] is None
    assert stats["c32"]["max"] == 5.0  # of the magnitudes


def test_stats_of_dtypes_torch_has_no_kernels_for(tmp_path):
    """uint64 stats near 2**63 lost small differences in float64 (mean 0.0 for
    [10, 20, 30]); fp4 and the bits dtypes have no numbers to show (--stats failed
    the whole command on fp4, and bits8 files were called corrupt)."""
    snapshot = {
        "u": torch.tensor([10, 20, 30], dtype=torch.uint64),
        "near_top": torch.tensor([2**63 + 1, 2**63 + 3], dtype=torch.uint64),
        "fp4": torch.arange(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "b8": torch.arange(4, dtype=torch.uint8).view(torch.bits8),
        "b16": torch.arange(4, dtype=torch.int16).view(torch.bits16),
    }
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(snapshot, a)
    proc = run_cli("inspect", "--stats", "--json", a)
    assert proc.returncode == 0, proc.stderr
    stats = {t["key"][0]: t["stats"] for t in json.loads(proc.stdout)["tensors"]}
    assert (stats["u"]["min"], stats["u"]["max"], stats["u"]["mean"], stats["u"]["std"]) == (
        10, 30, 20.0, 10.0,
    )  # fmt: skip
    assert stats["near_top"]["mean"] == float(2**63 + 2) and stats["near_top"]["std"] == 2**0.5
    for name in ("fp4", "b8", "b16"):
        assert stats[name]["min"] is None and stats[name]["mean"] is None
    converted = tmp_path / "c.pt"
    assert run_cli("convert", a, "--to", "pt", "-o", converted).returncode == 0
    back = torch.load(converted, weights_only=True)
    for name, tensor in snapshot.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8))
    changed = dict(snapshot, b8=torch.tensor([0, 1, 2, 9], dtype=torch.uint8).view(torch.bits8))
    torch.save(changed, b)
    proc = run_cli("diff", a, b)
    assert proc.returncode == 1 and "b8" in proc.stdout


def test_classes_and_functions_saved_by_reference_are_named(tmp_path):
    """Lightning hparams keep classes ({"activation": nn.GELU}): shown by their real
    global name, not as ckpttool's internal placeholder class."""
    import math

    path = tmp_path / "hp.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)},
                "hyper_parameters": {"activation": torch.nn.GELU, "fn": math.sqrt,
                                     "dtype": float}}, path)  # fmt: skip
    proc = run_cli("inspect", "--json", path)
    assert proc.returncode == 0, proc.stderr
    values = {v["key"][1]: (v["type"], v["value"]) for v in json.loads(proc.stdout)["values"]}
    assert values == {
        "activation": ("global", "<global torch.nn.modules.activation.GELU>"),
        "fn": ("global", "<global math.sqrt>"),
        "dtype": ("global", "<global builtins.float>"),
    }
