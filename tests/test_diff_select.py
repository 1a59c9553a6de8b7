"""``diff --select`` and ``--strip-prefix``, exactly as ``convert`` takes them: "did my
resume restore the optimizer?" answered by one command on the snapshots themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import check_error, completed, run_many

from ckpttool.diff import diff


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).pow(2).sum().backward()
        opt.step()


def snapshot(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, prefix: str) -> Path:
    """A trainer's snapshot: the (DDP-prefixed) model, the optimizer, the epoch."""
    sd = {f"{prefix}{k}": v for k, v in model.state_dict().items()}
    torch.save({"MODEL_STATE": sd, "OPTIMIZER": opt.state_dict(), "EPOCHS_RUN": 2}, path)
    return path


@pytest.fixture
def snapshots(tmp_path: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    saved = snapshot(tmp_path / "saved.pt", model, opt, "module.")
    # a resume that restored the optimizer: the same bytes, saved again without DDP
    resumed = torch.nn.Linear(6, 3)
    resumed.load_state_dict(model.state_dict())
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(opt.state_dict())
    restored = snapshot(tmp_path / "restored.pt", resumed, resumed_opt, "")
    # a resume that forgot it: same weights, a fresh optimizer after one more step of
    # its own on the same weights (its moments start from zero)
    fresh_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    lost = snapshot(tmp_path / "lost.pt", resumed, fresh_opt, "module.")
    return {"saved": saved, "restored": restored, "lost": lost}


STATE = [f"OPTIMIZER.state.{i}.{k}" for i in (0, 1) for k in ("step", "exp_avg", "exp_avg_sq")]
MODEL = ["MODEL_STATE.module.weight", "MODEL_STATE.module.bias"]


def test_select_all_compares_the_optimizer_state(snapshots: dict[str, Path]):
    saved, restored, lost = snapshots["saved"], snapshots["restored"], snapshots["lost"]
    runs = run_many(
        [
            ["diff", saved, lost],  # the model only: equal
            ["diff", saved, lost, "--select", "all"],
            ["diff", saved, lost, "--select", "all", "--json"],
            ["diff", saved, restored, "--select", "OPTIMIZER"],
            ["diff", saved, saved, "--select", "all"],
        ]
    )
    assert runs[0]["code"] == 0
    assert runs[0]["stdout"] == "equal: 2 tensors compared (bitwise)\n"
    assert runs[1]["code"] == 1
    assert runs[1]["stdout"] == (
        "".join(f"- only in A: {name}\n" for name in STATE)
        + "different: 6 only in A; 2 tensors compared (bitwise)\n"
    )
    result = json.loads(runs[2]["stdout"])
    assert result["only_in_a"] == STATE and result["only_in_b"] == []
    assert result["compared"] == 2 and result["equal"] is False
    # the restored optimizer: every state tensor bitwise equal (named from the selection)
    assert runs[3]["code"] == 0
    assert runs[3]["stdout"] == "equal: 6 tensors compared (bitwise)\n"
    assert runs[4]["stdout"] == "equal: 8 tensors compared (bitwise)\n"
    # the Python API takes the same words
    assert diff(saved, lost, select="all") == result
    names = diff(saved, restored, select="OPTIMIZER")
    assert names["equal"] and names["compared"] == 6


def test_select_all_finds_one_changed_moment(snapshots: dict[str, Path], tmp_path: Path):
    saved = snapshots["saved"]
    state = torch.load(saved, weights_only=True)
    state["OPTIMIZER"]["state"][1]["exp_avg_sq"][2] += 1e-3
    changed = tmp_path / "changed.pt"
    torch.save(state, changed)
    runs = run_many([["diff", saved, changed], ["diff", saved, changed, "--select", "all"]])
    assert runs[0]["code"] == 0
    assert runs[1]["code"] == 1
    lines = runs[1]["stdout"].splitlines()
    assert lines[0] == "different values (largest first):"
    assert lines[2].split() == ["OPTIMIZER.state.1.exp_avg_sq", "0.001", "1"]
    assert lines[-1] == "different: 1 values; 8 tensors compared (bitwise)"


def test_strip_prefix_as_convert_takes_it(snapshots: dict[str, Path]):
    saved, restored = snapshots["saved"], snapshots["restored"]  # module.x vs x
    runs = run_many(
        [
            ["diff", saved, restored],  # auto: each side's wrapper prefix stripped
            ["diff", saved, restored, "--strip-prefix", "none", "--json"],
            ["diff", saved, restored, "--strip-prefix", "module."],
            ["diff", saved, restored, "--select", "nope"],
            ["convert", saved, "--to", "safetensors", "--select", "nope"],
        ]
    )
    paired = "equal: 2 tensors compared (bitwise); prefixes stripped: A module., B none\n"
    assert runs[0]["stdout"] == paired  # the summary says what each side lost
    result = json.loads(runs[1]["stdout"])
    assert result["only_in_a"] == ["module.weight", "module.bias"]
    assert result["only_in_b"] == ["weight", "bias"]
    assert runs[1]["code"] == 1
    assert runs[2]["stdout"] == paired
    # a bad selection: the same one line from diff and convert
    diff_line = check_error(completed([], runs[3]), 2)
    convert_line = check_error(completed([], runs[4]), 2)
    assert (
        diff_line
        == convert_line
        == ("ckpttool: error: no key 'nope' under the root (see the tree with: ckpttool inspect)")
    )


def test_diff_and_convert_share_the_options():
    """One definition of each option (cli/options.py): the same names, metavar, help,
    default in both commands."""
    import typer

    from ckpttool.cli import app

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]

    def options(command: str) -> list[tuple]:
        return [
            (p.opts, p.metavar, p.help, p.default)
            for p in commands[command].params
            if p.name in ("select", "strip_prefix")
        ]

    assert options("diff") == options("convert")
    assert [o[0] for o in options("diff")] == [["--select"], ["--strip-prefix"]]


def test_diff_pairs_two_layouts_per_side(tmp_path: Path):
    """A Lightning checkpoint (``state_dict``, ``model.`` on every key) against its
    export, and a Composer-like snapshot (``state.model``) against a plain one: per-side
    selections and prefixes, or ``auto`` finding the head one side's every name has."""
    import torch
    from safetensors.torch import save_file

    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    lightning = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in weights.items()}, "epoch": 3}, lightning)
    export = tmp_path / "export.safetensors"
    save_file(weights, export)
    composer = tmp_path / "composer.pt"
    torch.save({"state": {"model": weights, "optimizers": {}}}, composer)
    plain = tmp_path / "plain.pt"
    torch.save({"model": weights, "epoch": 1}, plain)
    runs = run_many(
        [
            ["diff", lightning, export],
            ["diff", lightning, export, "--strip-prefix-a", "model.", "--json"],
            ["diff", composer, plain, "--select-a", "state.model", "--select-b", "model"],
            ["diff", lightning, export, "--strip-prefix-b", "model."],
        ]
    )
    assert runs[0]["stdout"] == (
        "equal: 2 tensors compared (bitwise); prefixes stripped: A model., B none\n"
    )
    result = json.loads(runs[1]["stdout"])
    assert result["equal"] and result["prefixes"] == {"a": "model.", "b": None}
    assert runs[2]["stdout"] == "equal: 2 tensors compared (bitwise)\n"
    # a prefix for one side alone must match that side
    assert check_error(completed([], runs[3]), 2).startswith(
        "ckpttool: error: --strip-prefix 'model.' matches no key; the keys begin with "
    )


def test_a_tie_one_side_alone_names_is_no_difference(tmp_path: Path):
    """A pytorch_model.bin keeps a tied head over the embedding's storage; save_pretrained's
    safetensors leaves it out; a copy saved apart is two equal tensors. None differ."""
    import torch
    from safetensors.torch import save_file

    emb = torch.arange(12.0).reshape(4, 3)
    tied_bin = tmp_path / "pytorch_model.bin"
    torch.save({"wte.weight": emb, "h.bias": torch.ones(3), "lm_head.weight": emb}, tied_bin)
    exported = tmp_path / "model.safetensors"
    save_file({"wte.weight": emb, "h.bias": torch.ones(3)}, exported)
    copies = tmp_path / "copies.pt"
    torch.save({"wte.weight": emb, "h.bias": torch.ones(3), "lm_head.weight": emb.clone()}, copies)
    runs = run_many(
        [
            ["diff", exported, tied_bin],
            ["diff", exported, tied_bin, "--json"],
            ["diff", tied_bin, copies],
            ["diff", exported, copies],  # an untied copy is a weight of its own
        ]
    )
    assert runs[0]["code"] == 0, runs[0]
    assert runs[0]["stdout"] == (
        "equal: 2 tensors compared (bitwise); 1 name tied on one side only "
        "(lm_head.weight = wte.weight in B)\n"
    )
    result = json.loads(runs[1]["stdout"])
    assert result["tied"] == [{"name": "lm_head.weight", "side": "b", "to": "wte.weight"}]
    assert result["only_in_b"] == [] and result["equal"]
    assert runs[2]["stdout"] == "equal: 3 tensors compared (bitwise)\n"
    assert runs[3]["code"] == 1 and "+ only in B: lm_head.weight" in runs[3]["stdout"]
