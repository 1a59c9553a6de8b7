"""What is measured: the commands (ckpttool and baselines) and the rows of the table.

A row compares one ckpttool measurement with one baseline measurement of the same
run; ``ratio`` is always ckpttool wall time / baseline wall time (lower is better).
A measurement used by several rows (``import torch``, ``cp -r``) runs once.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from data import Input
from measure import MiB

HERE = Path(__file__).resolve().parent
GROUPS = ("inspect", "help", "convert", "merge", "diff", "stats", "load", "load-gpu")
# load-gpu needs a CUDA device: only run when asked for (--only load-gpu)
DEFAULT_GROUPS = GROUPS[:-1]
LOADERS = str(HERE / "loaders.py")
LOAD_MMAP = "import sys, torch; torch.load(sys.argv[1], mmap=True, weights_only=True)"
LOAD_FULL = "import sys, torch; torch.load(sys.argv[1], weights_only=True)"
IMPORT_TORCH = "import torch"
DCP_TO_TORCH = (
    "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
)
CP_FSYNC = 'cp "$1" "$2" && sync "$2"'
CP_R_FSYNC = 'cp -r "$1" "$2" && find "$2" -type f -exec sync {} +'


@dataclass
class Command:
    cmd: list[str]
    needs: list[str] = field(default_factory=list)  # input names
    outputs: list[str] = field(default_factory=list)
    expect_rc: tuple[int, ...] = (0,)
    expect_format: str | None = None  # for `inspect --json`: the format it must report

    def check_stdout(self, stdout: bytes) -> str | None:
        if self.expect_format is None:
            return None
        try:
            found = json.loads(stdout)["format"]
        except (ValueError, KeyError, TypeError):
            return "stdout is not the inspect JSON"
        return None if found == self.expect_format else f"format {found!r}"


@dataclass
class Row:
    group: str
    case: str
    tool: str  # Command key
    base: str  # Command key
    max_wall: float | None = None  # seconds
    max_ratio: float | None = None
    ratio_text: str | None = None  # how the ratio target reads, e.g. "1/7"
    max_rss: float | None = None  # MiB
    max_rss_ratio: float | None = None  # ckpttool's peak RSS / the baseline's
    max_rss_extra: float | None = None  # MiB over the baseline's peak RSS

    @property
    def informative(self) -> bool:
        return all(
            limit is None
            for limit in (
                self.max_wall,
                self.max_ratio,
                self.max_rss,
                self.max_rss_ratio,
                self.max_rss_extra,
            )
        )


def ckpttool_command() -> list[str]:
    """The console script next to this interpreter (what users run), else ``-m ckpttool``."""
    script = Path(sys.executable).with_name("ckpttool")
    if script.exists():
        return [str(script)]
    found = shutil.which("ckpttool")
    return [found] if found else [sys.executable, "-m", "ckpttool"]


def commands(inputs: dict[str, Input], out: Path) -> dict[str, Command]:
    tool = ckpttool_command()
    py = sys.executable
    snap1, snap4 = str(inputs["snap-1g"].paths["pt"]), str(inputs["snap-4g"].paths["pt"])
    rank4_dir, dcp2 = inputs["rank4"].paths["dir"], str(inputs["dcp2"].paths["dir"])
    rank4 = str(rank4_dir / "ep0-rank*.pt")  # a quoted glob: ckpttool expands it
    model = inputs["model-1g"].paths
    o = {  # outputs: removed after every run
        name: str(out / file)
        for name, file in [
            ("st4", "snap4.safetensors"),
            ("cp4", "cp-snap4.pt"),
            ("torch4", "torch-snap4.safetensors"),
            ("st-rank4", "rank4.safetensors"),
            ("st-dcp2", "dcp2.safetensors"),
            ("pt-rank4", "rank4.pt"),
            ("pt-dcp2", "dcp2.pt"),
            ("cp-rank4", "cp-rank4"),
            ("cp-dcp2", "cp-dcp2"),
            ("floor-rank4", "floor-rank4.bin"),
            ("floor-dcp2", "floor-dcp2.bin"),
            ("dcp2torch", "dcp_to_torch_save.pt"),
        ]
    }
    c = {
        "inspect 1g": Command(
            [*tool, "inspect", "--json", snap1], ["snap-1g"], expect_format="torch-zip"
        ),
        "inspect 4g": Command(
            [*tool, "inspect", "--json", snap4], ["snap-4g"], expect_format="torch-zip"
        ),
        "inspect rank4": Command(
            [*tool, "inspect", "--json", rank4], ["rank4"], expect_format="per-rank"
        ),
        "inspect dcp2": Command([*tool, "inspect", "--json", dcp2], ["dcp2"], expect_format="dcp"),
        "mmap 1g": Command([py, "-c", LOAD_MMAP, snap1], ["snap-1g"]),
        "load 1g": Command([py, "-c", LOAD_FULL, snap1], ["snap-1g"]),
        "mmap 4g": Command([py, "-c", LOAD_MMAP, snap4], ["snap-4g"]),
        "load 4g": Command([py, "-c", LOAD_FULL, snap4], ["snap-4g"]),
        "import torch": Command([py, "-c", IMPORT_TORCH]),
        "help": Command([*tool, "--help"]),
        "python": Command([py, "-c", "pass"]),
        "convert 4g": Command(
            [*tool, "convert", snap4, "--to", "safetensors", "--select", "all", "-o", o["st4"]],
            ["snap-4g"],
            [o["st4"]],
        ),
        "cp 4g": Command(["cp", snap4, o["cp4"]], ["snap-4g"], [o["cp4"]]),
        "cp+fsync 4g": Command(
            ["sh", "-c", CP_FSYNC, "sh", snap4, o["cp4"]], ["snap-4g"], [o["cp4"]]
        ),
        "torch 4g": Command(
            [py, str(HERE / "baselines.py"), "load-save-safetensors", snap4, o["torch4"]],
            ["snap-4g"],
            [o["torch4"]],
        ),
        "convert rank4": Command(
            [*tool, "convert", rank4, "--to", "safetensors", "-o", o["st-rank4"]],
            ["rank4"],
            [o["st-rank4"]],
        ),
        "convert dcp2": Command(
            [*tool, "convert", dcp2, "--to", "safetensors", "-o", o["st-dcp2"]],
            ["dcp2"],
            [o["st-dcp2"]],
        ),
        "convert all rank4": Command(
            [*tool, "convert", rank4, "--to", "safetensors", "--select", "all"]
            + ["-o", o["st-rank4"]],
            ["rank4"],
            [o["st-rank4"]],
        ),
        "convert all dcp2": Command(
            [*tool, "convert", dcp2, "--to", "safetensors", "--select", "all"]
            + ["-o", o["st-dcp2"]],
            ["dcp2"],
            [o["st-dcp2"]],
        ),
        "merge rank4": Command(
            [*tool, "merge", rank4, "-o", o["pt-rank4"]], ["rank4"], [o["pt-rank4"]]
        ),
        "merge dcp2": Command([*tool, "merge", dcp2, "-o", o["pt-dcp2"]], ["dcp2"], [o["pt-dcp2"]]),
        "cp rank4": Command(
            ["cp", "-r", str(rank4_dir), o["cp-rank4"]], ["rank4"], [o["cp-rank4"]]
        ),
        "cp dcp2": Command(["cp", "-r", dcp2, o["cp-dcp2"]], ["dcp2"], [o["cp-dcp2"]]),
        "cp+fsync rank4": Command(
            ["sh", "-c", CP_R_FSYNC, "sh", str(rank4_dir), o["cp-rank4"]],
            ["rank4"],
            [o["cp-rank4"]],
        ),
        "cp+fsync dcp2": Command(
            ["sh", "-c", CP_R_FSYNC, "sh", dcp2, o["cp-dcp2"]], ["dcp2"], [o["cp-dcp2"]]
        ),
        "floor rank4": Command(
            [py, str(HERE / "baselines.py"), "durable-write", str(rank4_dir), o["floor-rank4"]],
            ["rank4"],
            [o["floor-rank4"]],
        ),
        "floor dcp2": Command(
            [py, str(HERE / "baselines.py"), "durable-write", dcp2, o["floor-dcp2"]],
            ["dcp2"],
            [o["floor-dcp2"]],
        ),
        "dcp_to_torch_save": Command(
            [py, "-c", DCP_TO_TORCH, dcp2, o["dcp2torch"]], ["dcp2"], [o["dcp2torch"]]
        ),
        "diff equal": Command(
            [*tool, "diff", str(model["pt"]), str(model["safetensors"])], ["model-1g"]
        ),
        "diff changed": Command(
            [*tool, "diff", str(model["pt"]), str(model["perturbed"])],
            ["model-1g"],
            expect_rc=(1,),
        ),
        "stats 1g": Command(
            [*tool, "inspect", "--stats", "--json", str(model["safetensors"])],
            ["model-1g"],
            expect_format="safetensors",
        ),
        "safe_open stats 1g": Command(
            [py, str(HERE / "baselines.py"), "safe-open-stats", str(model["safetensors"])],
            ["model-1g"],
        ),
        "naive diff equal": Command(
            [
                py,
                str(HERE / "baselines.py"),
                "naive-diff",
                str(model["pt"]),
                str(model["safetensors"]),
            ],
            ["model-1g"],
        ),
        "naive diff changed": Command(
            [
                py,
                str(HERE / "baselines.py"),
                "naive-diff",
                str(model["pt"]),
                str(model["perturbed"]),
            ],
            ["model-1g"],
            expect_rc=(1,),
        ),
    }
    mpt, mst, d2 = str(model["pt"]), str(model["safetensors"]), dcp2
    for key, args in {
        "load pt": ["ckpttool-load", mpt],
        "torch mmap pt": ["torch-mmap", mpt],
        "load st": ["ckpttool-load", mst],
        "load_file st": ["safetensors", mst],
        "load_into pt": ["ckpttool-load-into", mpt],
        "load_into st": ["ckpttool-load-into", mst],
        "load_state_dict pt": ["torch-load-state-dict", mpt],
        "model only": ["model-only", mpt],
        "load dcp2": ["ckpttool-load-all", d2],
        "load_into dcp2": ["ckpttool-load-into-all", d2],
        "dcp.load dcp2": ["dcp-load", d2],
        "load cuda st": ["ckpttool-load", mst, "cuda:0"],
        "load cuda pt": ["ckpttool-load", mpt, "cuda:0"],
        "load_into cuda st": ["ckpttool-load-into", mst, "cuda:0"],
        "load_file cuda st": ["safetensors", mst, "cuda:0"],
        "torch mmap cuda pt": ["torch-mmap", mpt, "cuda:0"],
    }.items():
        c[key] = Command([py, LOADERS, *args], ["dcp2" if "dcp2" in key else "model-1g"])
    return c


def rows(inputs: dict[str, Input]) -> list[Row]:
    def sizes(name: str) -> str:
        return f"{inputs[name].total_bytes / (1 << 30):.3g} GiB"

    s1, s4, r4, d2, m1 = (sizes(n) for n in ("snap-1g", "snap-4g", "rank4", "dcp2", "model-1g"))
    sharded_rss = 512 + max(inputs["rank4"].largest_tensor, inputs["dcp2"].largest_tensor) / MiB
    return [
        Row("inspect", f"inspect --json {s1} torch-zip vs torch.load(mmap)", "inspect 1g",
            "mmap 1g", 0.25, 1 / 7, "1/7", 100),
        Row("inspect", f"inspect --json {s1} torch-zip vs torch.load", "inspect 1g",
            "load 1g", max_ratio=1 / 15, ratio_text="1/15"),
        Row("inspect", f"inspect --json {s4} torch-zip vs torch.load(mmap)", "inspect 4g",
            "mmap 4g", 0.25, 1 / 7, "1/7", 100),
        Row("inspect", f"inspect --json {s4} torch-zip vs torch.load", "inspect 4g",
            "load 4g", max_ratio=1 / 15, ratio_text="1/15"),
        Row("inspect", f"inspect --json {s4} vs {s1} (about constant)", "inspect 4g",
            "inspect 1g", max_ratio=1.5, ratio_text="1.5"),
        Row("inspect", f"inspect --json {r4} per-rank (4 ranks) vs import torch",
            "inspect rank4", "import torch", 0.25, 1 / 7, "1/7", 100),
        Row("inspect", f"inspect --json {d2} DCP (2 ranks) vs import torch", "inspect dcp2",
            "import torch", 0.25, 1 / 7, "1/7", 100),
        Row("help", "ckpttool --help vs python -c pass", "help", "python", max_wall=0.3),
        Row("convert", f"convert {s4} torch-zip -> safetensors (--select all) vs cp",
            "convert 4g", "cp 4g", max_ratio=1.5, ratio_text="1.5", max_rss=512),
        Row("convert", "  same vs cp + fsync of the copy", "convert 4g", "cp+fsync 4g"),
        Row("convert", "  same vs torch.load + safetensors save_file", "convert 4g", "torch 4g"),
        # the merge target ("to safetensors"): convert merges every sharded
        # tensor, model and optimizer (--select all), as many bytes as cp -r copies
        Row("merge", f"merge {r4} per-rank (4) -> safetensors (--select all) vs cp -r",
            "convert all rank4", "cp rank4", max_ratio=2, ratio_text="2", max_rss=sharded_rss),
        Row("merge", "  same vs cp -r + fsync of the copies", "convert all rank4",
            "cp+fsync rank4"),
        # the disk's floor: as many bytes written with O_DIRECT + fsync, nothing read
        Row("merge", "  same vs the disk's floor (durable write of zeros)", "convert all rank4",
            "floor rank4"),
        Row("merge", "  the floor itself (not ckpttool) vs cp -r", "floor rank4", "cp rank4"),
        Row("merge", f"merge {d2} DCP (2) -> safetensors (--select all) vs cp -r",
            "convert all dcp2", "cp dcp2", max_ratio=2, ratio_text="2", max_rss=sharded_rss),
        Row("merge", "  same vs cp -r + fsync of the copies", "convert all dcp2", "cp+fsync dcp2"),
        Row("merge", "  same vs the disk's floor (durable write of zeros)", "convert all dcp2",
            "floor dcp2"),
        Row("merge", "  the floor itself (not ckpttool) vs cp -r", "floor dcp2", "cp dcp2"),
        # the default selection: the model state dict only, a third of the bytes
        Row("merge", f"convert {r4} per-rank (4) -> safetensors (model only) vs cp -r",
            "convert rank4", "cp rank4"),
        Row("merge", f"convert {d2} DCP (2) -> safetensors (model only) vs cp -r",
            "convert dcp2", "cp dcp2"),
        # `ckpttool merge` (one torch.save file): the issue bounds its memory, not its time
        Row("merge", f"merge {r4} per-rank (4) -> .pt vs cp -r", "merge rank4", "cp rank4",
            max_rss=sharded_rss),
        Row("merge", "  same vs cp -r + fsync of the copies", "merge rank4", "cp+fsync rank4"),
        Row("merge", f"merge {d2} DCP (2) -> .pt vs cp -r", "merge dcp2", "cp dcp2",
            max_rss=sharded_rss),
        Row("merge", "  same vs cp -r + fsync of the copies", "merge dcp2", "cp+fsync dcp2"),
        Row("merge", "  same vs dcp_to_torch_save", "merge dcp2", "dcp_to_torch_save"),
        Row("diff", f"diff {m1} .pt vs its .safetensors (equal) vs torch.load+equal",
            "diff equal", "naive diff equal", max_rss=512),
        Row("diff", f"diff {m1} .pt vs perturbed copy (3 tensors) vs torch.load+equal",
            "diff changed", "naive diff changed", max_rss=512),
        # issue 21: --stats at least as fast as a safe_open loop computing the same numbers
        Row("stats", f"inspect --stats {m1} safetensors vs a safe_open loop (float64)",
            "stats 1g", "safe_open stats 1g", max_ratio=1, ratio_text="1"),
        # load: every tensor summed after loading, on both sides
        Row("load", f"load {m1} torch-zip + sum vs torch.load(mmap, weights_only) + sum",
            "load pt", "torch mmap pt", max_ratio=1.0, ratio_text="1.0", max_rss_ratio=1.1),
        Row("load", f"load {m1} safetensors + sum vs load_file + sum", "load st",
            "load_file st", max_ratio=1.0, ratio_text="1.0", max_rss_ratio=1.1),
        Row("load", f"load_into nn.Module {m1} torch-zip vs the module alone (RSS +256 MiB)",
            "load_into pt", "model only", max_rss_extra=256),
        Row("load", f"load_into nn.Module {m1} safetensors vs the module alone (RSS +256 MiB)",
            "load_into st", "model only", max_rss_extra=256),
        Row("load", "  load_into torch-zip vs load_state_dict(torch.load(mmap))", "load_into pt",
            "load_state_dict pt"),
        Row("load", f"load {d2} DCP (2 ranks, --select all) + sum vs dcp.load(no_dist) into "
            "preallocated + sum", "load dcp2", "dcp.load dcp2", max_ratio=1.0, ratio_text="1.0"),
        Row("load", "  load_into preallocated tensors vs the same", "load_into dcp2",
            "dcp.load dcp2", max_ratio=1.0, ratio_text="1.0"),
        Row("load-gpu", f"load {m1} safetensors map_location=cuda:0 vs load_file(device=cuda:0)",
            "load cuda st", "load_file cuda st", max_ratio=1.0, ratio_text="1.0"),
        Row("load-gpu", f"load {m1} torch-zip map_location=cuda:0 vs load_file(device=cuda:0)",
            "load cuda pt", "load_file cuda st", max_ratio=1.0, ratio_text="1.0"),
        Row("load-gpu", "  same vs torch.load(mmap, weights_only, map_location=cuda:0)",
            "load cuda pt", "torch mmap cuda pt"),
        Row("load-gpu", f"load_into a CUDA nn.Module {m1} vs load_file(device=cuda:0)",
            "load_into cuda st", "load_file cuda st", max_ratio=1.0, ratio_text="1.0"),
    ]  # fmt: skip
