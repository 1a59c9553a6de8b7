"""inspect's small things (issue 32, item 9): --names gives the names convert writes,
parameters count shared storage once, a run folder of several formats says so, and the
human view fits a terminal by shortening names in the middle, piped keeps every row whole
on one line, and a tiny snapshot fits one screen."""

from __future__ import annotations

import json

import torch
from helpers import fixture_path, run_many

import ckpttool

DDP = fixture_path("ddp") / "ep0-rank0.pt"
TRAINER_CHECKPOINTS = fixture_path("transformers")


def test_names_are_output_names_and_raw_the_key_paths(tmp_path):
    nested = tmp_path / "nested.pt"
    torch.save({"optimizer": {"lr": 0.1}, "counts": torch.ones(2)}, nested)  # no model
    runs = run_many(
        [
            ["inspect", DDP, "--names"],
            ["inspect", DDP, "--names", "--raw"],
            ["inspect", DDP, "--names", "--filter", "fc1"],
            ["inspect", nested, "--names"],
        ]
    )
    assert runs[0]["stdout"].splitlines() == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    with ckpttool.open(str(DDP)) as f:
        assert list(f.keys()) == runs[0]["stdout"].splitlines()
    raw = runs[1]["stdout"].splitlines()
    assert raw[:4] == [f"MODEL_STATE.module.{n}" for n in ("fc1.weight", "fc1.bias",
                       "fc2.weight", "fc2.bias")]  # fmt: skip
    assert "RNG.torch" in raw and len(raw) == 17
    assert runs[2]["stdout"].splitlines() == ["fc1.weight", "fc1.bias"]
    # no model state dict: what `convert --select all` names, the key paths
    assert runs[3]["stdout"].splitlines() == ["counts"]


def test_parameters_count_a_tied_embedding_once():
    """transformers 4's pytorch_model.bin keeps lm_head.weight on wte's storage: the
    model has 1,272 parameters (model.num_parameters()), not 1,272 + 96."""
    folder = TRAINER_CHECKPOINTS / "gpt2_bin" / "checkpoint-2"
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    unique = {t.data_ptr(): t.numel() for t in state.values()}
    runs = run_many([["inspect", folder, "--json"], ["inspect", folder]])
    assert json.loads(runs[0]["stdout"])["num_params"] == sum(unique.values()) == 1272
    model_line = next(line for line in runs[1]["stdout"].splitlines() if line.startswith("model:"))
    assert "1.27K parameters (1,272)" in model_line


def test_a_run_folder_of_several_formats_says_which():
    runs = run_many(
        [
            ["inspect", TRAINER_CHECKPOINTS / "gpt2_tied" / "checkpoint-2"],
            ["inspect", fixture_path("dcp")],
            ["inspect", fixture_path("safetensors_sharded")],
        ]
    )
    assert runs[0]["stdout"].splitlines()[0] == (
        "format: safetensors (the model); torch-zip: optimizer.pt, rng_state.pth, scheduler.pt"
    )
    assert runs[1]["stdout"].splitlines()[0] == "format: dcp, world size 2"
    assert runs[2]["stdout"].splitlines()[0] == "format: safetensors-sharded"


def test_tiny_snapshot_fits_one_screen_of_100_columns(tmp_path):
    long = "encoder." + ".".join(f"block{i}" for i in range(20)) + ".attention.weight"
    wide = tmp_path / "wide.pt"
    torch.save(
        {"model": {long: torch.ones(2), "short.weight": torch.ones(3)}, "note": "x" * 300}, wide
    )
    runs = run_many([["inspect", DDP], ["inspect", wide], ["inspect", wide, "--full"]])
    lines = runs[0]["stdout"].splitlines()
    assert len(lines) <= 41, "\n".join(lines)
    assert max(len(line) for line in lines) <= 100
    assert lines[-1].startswith("  … ") and "(--limit 0 or --full)" in lines[-1]
    lines = runs[1]["stdout"].splitlines()
    name = f"model.{long}"
    # piped: the row whole, on one line, whitespace between its columns (awk, grep)
    (row,) = [line for line in lines if name in line]
    assert row.split() == [name, "fp32", "[2]", "8", "B"]
    assert any(line.endswith("…") and "'xxx" in line for line in lines)  # the value, cut
    # --full: every row whole on one line too
    assert any(line.split() == [name, "fp32", "[2]", "8", "B"]
               for line in runs[2]["stdout"].splitlines())  # fmt: skip


def test_on_a_terminal_rows_fit_its_width_by_shortening_names():
    """Never a row broken over two lines: a name too long for the terminal's width keeps
    its start and its end, the middle shortened."""
    from ckpttool.cli.fit import cut_middle, fit_columns

    long = "model.layers.0.self_attn." + "x" * 80 + ".q_proj.weight"
    table = [["name", "dtype", "shape", "size"], [long, "fp32", "[4, 4]", "64 B"],
             ["short.w", "fp32", "[2]", "8 B"]]  # fmt: skip
    for width in (60, 80, 120):
        lines = fit_columns(table, right={3}, width=width)
        assert len(lines) == 3 and all(len(line) <= width for line in lines), lines
        assert lines[1].split()[0].startswith("model.layers.0.")
        assert lines[1].split()[0].endswith("q_proj.weight") and "…" in lines[1]
        assert lines[1].split()[1:] == ["fp32", "[4,", "4]", "64", "B"]
    piped = fit_columns(table, right={3}, width=None)
    assert piped[1].split()[0] == long
    assert cut_middle("abcdefghij", 5) == "ab…ij" and cut_middle("abc", 5) == "abc"


def test_the_text_view_counts_what_json_counts_under_a_filter(tmp_path):
    """One report, two renderings: with --filter the text's model line says the tensors
    and parameters the JSON's num_params counts, not the whole model's."""
    sd = {"enc.weight": torch.zeros(4, 5), "enc.bias": torch.zeros(4), "dec.w": torch.zeros(7)}
    torch.save({"model": sd, "step": 3}, tmp_path / "ck.pt")
    text, as_json = run_many(
        [
            ["inspect", tmp_path / "ck.pt", "--filter", "enc"],
            ["inspect", tmp_path / "ck.pt", "--filter", "enc", "--json"],
        ]
    )
    report = json.loads(as_json["stdout"])
    assert report["num_params"] == 24
    model = next(ln for ln in text["stdout"].splitlines() if ln.startswith("model:"))
    assert model == "model: model, 2 tensors matching --filter, 24 parameters, no wrapper prefix"
