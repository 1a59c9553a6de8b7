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
from helpers import ROOT, run_cli, small_state_dict, write_dcp
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
    "unverified": list,
    "allowed": list,  # globals read only because --allow trusted them
    "transfer": dict,
}
TENSOR_KEYS = {"key", "dtype", "shape", "device", "nbytes", "sharded", "file"}
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
    assert set(report) == set(TOP_KEYS)
    for key, types in TOP_KEYS.items():
        assert isinstance(report[key], types), key
    assert report["format"] in FORMATS
    assert all(isinstance(f, str) for f in report["files"])
    assert report["num_tensors"] == len(report["tensors"])
    assert set(report["transfer"]) == {"bytes", "requests"}
    assert all(isinstance(n, int) and n >= 0 for n in report["transfer"].values())
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
    del report["transfer"]  # how many bytes a local read counts is the readers' business
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
        "unverified": [],
        "allowed": [],
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
    from helpers import check_error

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
    from ckpttool.inspection import inspect_report

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
    from helpers import sha256

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


# ------------------------------------------------------- issue 21: readable at 70B


def llama_like(layers: int = 32, hidden: int = 8) -> dict[str, torch.Tensor]:
    """A Llama-named state dict with tiny shapes: the names are what the layout is about."""
    sd = {"model.embed_tokens.weight": torch.zeros(16, hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = torch.zeros(hidden, hidden, dtype=torch.bfloat16)
        sd[p + "mlp.gate_proj.weight"] = torch.zeros(3 * hidden, hidden, dtype=torch.bfloat16)
        sd[p + "input_layernorm.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    sd["model.norm.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    sd["lm_head.weight"] = torch.zeros(16, hidden, dtype=torch.bfloat16)
    return sd


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "llama.safetensors"
    save_file(llama_like(), path, metadata={"format": "pt", "ss_network_dim": "128"})
    return path


def test_summary_first_then_collapsed_layers(llama_file):
    proc = run_cli("inspect", llama_file)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:6] == [
        "format: safetensors",
        f"file: {llama_file}",
        "model: (root), 227 tensors, 15.1K parameters (15,112), no wrapper prefix",
        "size: 29.5 KiB in 227 tensors (bf16 29.5 KiB)",
        "metadata: format='pt', ss_network_dim='128'",
        "security: safetensors, no code involved",
    ]
    rows = sorted(line.split() for line in lines[9:])  # safetensors stores names sorted
    assert rows == sorted([
        ["model.embed_tokens.weight", "bf16", "[16,", "8]", "256", "B"],
        *[
            [f"model.layers.{{0..31}}.self_attn.{n}.weight", "bf16", "[8,", "8]", "128", "B",
             "×32"]
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        ],
        ["model.layers.{0..31}.mlp.gate_proj.weight", "bf16", "[24,", "8]", "384", "B", "×32"],
        ["model.layers.{0..31}.input_layernorm.weight", "bf16", "[8]", "16", "B", "×32"],
        ["model.layers.{0..31}.post_attention_layernorm.weight", "bf16", "[8]", "16", "B",
         "×32"],
        ["model.norm.weight", "bf16", "[8]", "16", "B"],
        ["lm_head.weight", "bf16", "[16,", "8]", "256", "B"],
    ])  # fmt: skip
    assert lines[7] == "tensors: 227 in 10 rows, repeated layers collapsed (--full lists each)"
    assert "device" not in proc.stdout  # safetensors has no devices: no device column


def test_piped_output_keeps_names_whole_for_grep(tmp_path, llama_file):
    """Through a real pipe, at 80 columns: every name on one line, never wrapped."""
    long = {f"model.layers.{i}.post_attention_layernorm.weight" + ".x" * 40: torch.ones(1)
            for i in range(3)}  # fmt: skip
    wide = tmp_path / "wide.pt"
    torch.save(long, wide)
    env = dict(os.environ, COLUMNS="80", PYTHONPATH=str(ROOT))
    cli = f"{sys.executable} -m ckpttool"

    def count(args: str) -> int:
        proc = subprocess.run(f"{cli} {args} | grep -c post_attention_layernorm", shell=True,
                              capture_output=True, text=True, env=env)  # fmt: skip
        return int(proc.stdout.strip() or 0)

    assert count(f"inspect --full {llama_file}") == 32
    assert count(f"inspect --names {llama_file}") == 32
    assert count(f"inspect {llama_file}") == 1  # the collapsed row
    assert count(f"inspect --full {wide}") == 3
    out = subprocess.run(f"{cli} inspect --full {wide} | grep -F '.x.x.x.x.x.x.x.x.x.x'",
                         shell=True, capture_output=True, text=True, env=env).stdout  # fmt: skip
    assert [line.split()[0] for line in out.splitlines()] == list(long)


def test_full_limit_sort_and_names(llama_file):
    names = run_cli("inspect", "--names", llama_file).stdout.splitlines()
    assert names == [t["key"][0] for t in inspect_json(llama_file)["tensors"]]
    assert sorted(names) == sorted(llama_like())
    full = run_cli("inspect", "--full", llama_file).stdout.splitlines()
    assert full[7] == "tensors: 227" and len(full) == 9 + 227
    limited = run_cli("inspect", "--limit", "3", llama_file).stdout.splitlines()
    assert limited[-1] == "  … 7 more rows (--limit 0 or --full)"
    assert len(limited) == 9 + 3 + 1
    by_size = run_cli("inspect", "--sort", "size", "--limit", "2", llama_file).stdout
    rows = [line.split()[0] for line in by_size.splitlines()[9:11]]
    assert rows == ["model.layers.{0..31}.mlp.gate_proj.weight",
                    "model.layers.{0..31}.self_attn.k_proj.weight"]  # fmt: skip
    by_name = run_cli("inspect", "--sort", "name", llama_file).stdout.splitlines()[9:]
    assert [line.split()[0] for line in by_name] == sorted(line.split()[0] for line in by_name)
    from helpers import check_error

    check_error(run_cli("inspect", "--sort", "bytes", llama_file), 2, "'bytes'", "name")
    check_error(run_cli("inspect", "--limit", "-1", llama_file), 2, "--limit")


def test_metadata_in_json_and_file_per_tensor(tmp_path, llama_file):
    report = inspect_json(llama_file)
    assert report["metadata"] == {"format": "pt", "ss_network_dim": "128"}
    assert {t["file"] for t in report["tensors"]} == {str(llama_file)}
    folder = tmp_path / "hf"
    assert run_cli("convert", llama_file, "--to", "safetensors", "--max-shard-size", "10KB",
                   "-o", f"{folder}/").returncode == 0  # fmt: skip
    shards = sorted(str(p) for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    report = inspect_json(folder)
    assert report["files"] == [str(folder / "model.safetensors.index.json"), *shards]
    by_name = {t["key"][0]: t["file"] for t in report["tensors"]}
    assert by_name["lm_head.weight"] == shards[0]  # the first name, sorted
    assert by_name["model.norm.weight"] == shards[-1]
    assert report["metadata"] == {"total_size": 30224}
    # --full: a file column, each row naming its shard
    lines = run_cli("inspect", "--full", folder).stdout.splitlines()
    header = next(line for line in lines if line.startswith("  name"))
    assert header.split() == ["name", "dtype", "shape", "size", "file"]
    row = next(line for line in lines if line.startswith("  model.norm.weight"))
    assert row.endswith(shards[-1])
    # the shell's expansion of folder/*.safetensors is that folder
    expanded = inspect_json(*shards)
    assert expanded["format"] == "safetensors-sharded" and expanded["files"] == report["files"]
    from helpers import check_error

    check_error(
        run_cli("inspect", *shards[:2]), 2, f"2 of the {len(shards)} shards", "pass the folder"
    )


def test_filter_narrows_the_tree_and_says_when_nothing_matches(tmp_path):
    path = tmp_path / "snap.pt"
    model = {f"module.layers.{i}.w": torch.ones(2) for i in range(4)}
    model["module.lm_head.weight"] = torch.ones(3)
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2)} for i in range(4)}
    optim = {"state": state, "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}]}
    torch.save({"model": model, "optimizer": optim, "epoch": 3, "step": 120}, path)
    lines = run_cli("inspect", path).stdout.splitlines()
    assert "values: optimizer.param_groups.0.lr=0.1, epoch=3, step=120 (+1 below)" in lines
    assert lines[-3:] == [
        "",
        "values: 1 more (the others are in the summary)",
        "  optimizer.param_groups.0.params  list  [0, 1, 2, 3]",
    ]
    structure = lines[lines.index("structure:") + 1 :]
    assert structure[:6] == [
        "  model      model state dict",
        "  optimizer  dict of 2",
        "    state         dict of 4",
        "      {0..3}  dict of 2: step, exp_avg  ×4",
        "    param_groups  list of 1",
        "      0  dict of 2: lr, params",
    ]
    out = run_cli("inspect", "--filter", "lm_head", path).stdout
    assert "lm_head" in out and "optimizer" not in out and "layers" not in out
    proc = run_cli("inspect", "--filter", "nothing_like_this", path)
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[-1] == "nothing matches --filter 'nothing_like_this'"
    assert "tensors:" not in proc.stdout


@pytest.mark.parametrize(
    ("env", "args", "coloured"),
    [
        ({"FORCE_COLOR": "1"}, [], True),
        ({"FORCE_COLOR": "1", "NO_COLOR": "1"}, [], False),
        ({"FORCE_COLOR": "1"}, ["--no-color"], False),
        ({}, [], False),  # a pipe: no colours
    ],
)
def test_colours_follow_no_color_and_the_flag(snapshot, env, args, coloured):
    full_env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    proc = subprocess.run([sys.executable, "-m", "ckpttool", "inspect", snapshot, *args],
                          capture_output=True, text=True, env={**full_env, **env,
                          "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert ("\x1b[" in proc.stdout) is coloured


def test_text_from_the_file_cannot_draw_lines_or_escapes(tmp_path):
    """A key, value or class name with control characters is shown escaped: it cannot
    start a fake "security: ... none dangerous" line or send terminal escapes."""
    fake = "security: read without running code; 0 globals, none dangerous"
    path = tmp_path / "evil-names.pt"
    torch.save({f"w\n{fake}": torch.ones(1), f"\r{fake}": torch.ones(2),
                "note": f"\x1b[2J\n{fake}", "epoch": 1}, path)  # fmt: skip
    for args in ([], ["--full"], ["--names"], ["--filter", "w"]):
        proc = run_cli("inspect", *args, path)
        assert proc.returncode == 0, proc.stderr
        assert "\x1b" not in proc.stdout and "\r" not in proc.stdout
        security = [line for line in proc.stdout.splitlines() if line.startswith("security")]
        assert len(security) <= 1 and (args == ["--names"] or len(security) == 1)
        assert all("3 globals" in line for line in security)
    out = run_cli("inspect", path).stdout
    assert f"w\\n{fake}" in out and f"\\r{fake}" in out and "'\\x1b[2J\\nsecurity: read" in out
    # the error line of a bad --select names the key escaped too
    proc = run_cli("diff", path, tmp_path / "missing\x1b[31m.pt")
    assert proc.returncode == 2 and "\x1b" not in proc.stderr and "\\x1b[31m" in proc.stderr


def test_stats_of_big_tensors_are_exact_by_chunk(tmp_path):
    """Tensors over one chunk are reduced chunk by chunk: same numbers as in one go."""
    from ckpttool.stats import STATS_CHUNK

    g = torch.Generator().manual_seed(0)
    x = torch.randn(STATS_CHUNK * 2 + 123, generator=g) * 3 + 1
    y = x.clone()
    y[[5, STATS_CHUNK + 7]] = float("nan")
    y[-1] = float("inf")
    y[STATS_CHUNK * 2 :] = float("nan")  # the short last chunk has no finite value but one
    y[-5] = 2.5
    torch.save({"x": x.to(torch.bfloat16), "y": y}, tmp_path / "big.pt")
    proc = run_cli("inspect", "--stats", "--json", tmp_path / "big.pt")
    assert proc.returncode == 0, proc.stderr
    stats = {t["key"][0]: t["stats"] for t in json.loads(proc.stdout)["tensors"]}
    for name, t in (("x", x.to(torch.bfloat16)), ("y", y)):
        f = t.to(torch.float64)
        finite = f[torch.isfinite(f)]
        s = stats[name]
        assert (s["nan"], s["inf"]) == (int(f.isnan().sum()), int(f.isinf().sum()))
        assert (s["min"], s["max"]) == (float(finite.min()), float(finite.max()))
        assert s["mean"] == pytest.approx(float(finite.mean()), rel=1e-12, abs=1e-12)
        assert s["std"] == pytest.approx(float(finite.std()), rel=1e-12)


def test_docs_show_the_real_output_for_a_7b_shaped_file(tmp_path):
    """The command reference's inspect example is what ckpttool prints for the file of
    benchmarks/llama7b_shaped.py (the real Llama-2-7B header; the 12.6 GiB of data a
    hole in a sparse file)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "llama7b_shaped.py"),
                           str(tmp_path / "llama2-7b.safetensors")], check=True)  # fmt: skip
    assert proc.returncode == 0
    out = run_cli("inspect", "llama2-7b.safetensors", cwd=tmp_path).stdout
    readme = (ROOT / "docs" / "cli.md").read_text()
    start = readme.index("$ ckpttool inspect llama2-7b.safetensors\n") + len(
        "$ ckpttool inspect llama2-7b.safetensors\n"
    )
    assert readme[start : readme.index("```", start)] == out
    assert "model.layers.{0..31}.mlp.gate_proj.weight             bf16   [11008, 4096]" in out


def test_device_column_only_where_a_tensor_was_saved_off_the_cpu(tmp_path):
    gpu = ROOT / "fixtures" / "gpu_saved.pt"
    if not gpu.exists():
        pytest.skip("fixture not generated")
    lines = run_cli("inspect", gpu).stdout.splitlines()
    assert "size: 32 B in 2 tensors (fp32 32 B), saved on cuda:0" in lines
    assert lines[lines.index("tensors: 2") + 1].split() == ["name", "dtype", "shape", "device",
                                                            "size"]  # fmt: skip
    torch.save({"w": torch.ones(2)}, tmp_path / "one.pt")
    lines = run_cli("inspect", tmp_path / "one.pt").stdout.splitlines()
    assert "size: 8 B in 1 tensor (fp32 8 B)" in lines  # singular, and no device column
    assert lines[lines.index("tensors: 1") + 1].split() == ["name", "dtype", "shape", "size"]


def test_a_tied_weight_is_counted_once_and_shown_as_tied(tmp_path):
    """One storage under two names (a head tied to its embedding) is one weight: its
    bytes and parameters once, the second name marked ``tied_to`` the first."""
    emb = torch.arange(12.0).reshape(4, 3)
    path = tmp_path / "tied.bin"
    torch.save({"wte.weight": emb, "h.bias": torch.ones(3), "lm_head.weight": emb}, path)
    proc = run_cli("inspect", "--json", path)
    report = json.loads(proc.stdout)
    assert (report["num_params"], report["nbytes"], report["num_tensors"]) == (15, 60, 3)
    tied = [t for t in report["tensors"] if "tied_to" in t]
    assert [(t["key"], t["tied_to"]) for t in tied] == [(["lm_head.weight"], ["wte.weight"])]
    text = run_cli("inspect", path).stdout.splitlines()
    assert "size: 60 B in 3 tensors (fp32 60 B); 1 tied (lm_head.weight = wte.weight)" in text
    copies = tmp_path / "copies.pt"  # an equal copy is a weight of its own
    torch.save({"wte.weight": emb, "lm_head.weight": emb.clone()}, copies)
    report = json.loads(run_cli("inspect", "--json", copies).stdout)
    assert report["nbytes"] == 96 and not any("tied_to" in t for t in report["tensors"])
