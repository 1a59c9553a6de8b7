"""Where the model state dict is inside a snapshot, and which wrapper prefix it carries."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn as nn
from helpers import run_cli, small_state_dict
from safetensors.torch import load_file

import ckpttool
from ckpttool.inspection import inspect_report
from ckpttool.tree.layout import detect_prefix, strip_prefix

KEYS = list(small_state_dict())


def prefixed(prefix: str) -> dict:
    return {prefix + k: v for k, v in small_state_dict().items()}


def optimizer_state() -> dict:
    """A real Adam state dict after one step: state keyed by int parameter ids."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return opt.state_dict()


def scheduler_state() -> dict:
    return {"last_epoch": 3, "base_lrs": [0.01], "_step_count": 4}


# name -> (object saved, model_key, prefix, plain values expected among report["values"])
LAYOUTS = {
    "plain": (lambda: small_state_dict(), [], None, []),
    "ddp": (lambda: prefixed("module."), [], "module.", []),
    "compile": (lambda: prefixed("_orig_mod."), [], "_orig_mod.", []),
    "ddp_of_compile": (lambda: prefixed("module._orig_mod."), [], "module._orig_mod.", []),
    "torchrun_tutorial": (
        lambda: {"MODEL_STATE": prefixed("module."), "EPOCHS_RUN": 3},
        ["MODEL_STATE"],
        "module.",
        [{"key": ["EPOCHS_RUN"], "type": "int", "value": 3}],
    ),
    "composer": (
        lambda: {
            "state": {
                "model": prefixed("module."),
                "optimizers": {"Adam": optimizer_state()},
                "schedulers": {"LambdaLR": scheduler_state()},
                "timestamp": {"epoch": 2, "batch": 40},
            },
            "rng": [{"python": (3, (1, 2), None), "torch": torch.get_rng_state()}],
        },
        ["state", "model"],
        "module.",
        [
            {"key": ["state", "timestamp", "epoch"], "type": "int", "value": 2},
            {"key": ["state", "schedulers", "LambdaLR", "last_epoch"], "type": "int", "value": 3},
        ],
    ),
    "nanogpt": (
        lambda: {
            "model": prefixed("_orig_mod."),
            "optimizer": optimizer_state(),
            "epoch": 7,
            "best_val_loss": 1.25,
        },
        ["model"],
        "_orig_mod.",
        [
            {"key": ["epoch"], "type": "int", "value": 7},
            {"key": ["best_val_loss"], "type": "float", "value": 1.25},
            {"key": ["optimizer", "param_groups", 0, "lr"], "type": "float", "value": 0.01},
        ],
    ),
    "lightning": (
        lambda: {
            "state_dict": small_state_dict(),
            "epoch": 1,
            "global_step": 250,
            "optimizer_states": [optimizer_state()],
            "pytorch-lightning_version": "2.4.0",
        },
        ["state_dict"],
        None,
        [
            {"key": ["global_step"], "type": "int", "value": 250},
            {"key": ["pytorch-lightning_version"], "type": "str", "value": "2.4.0"},
        ],
    ),
    "model_state": (
        lambda: {
            "model_state": prefixed("module."),
            "optimizer_state": optimizer_state(),
            "step": 100,
        },
        ["model_state"],
        "module.",
        [{"key": ["step"], "type": "int", "value": 100}],
    ),
}


@pytest.fixture(scope="module")
def layout_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layouts")
    out = {}
    for name, (build, *_rest) in LAYOUTS.items():
        out[name] = folder / f"{name}.pt"
        torch.save(build(), out[name])
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_model_key_prefix_and_values(layout_files, name):
    _, model_key, prefix, values = LAYOUTS[name]
    report = inspect_report(ckpttool.read(layout_files[name]))
    assert report["model_key"] == model_key
    assert report["prefix"] == prefix
    for value in values:
        assert value in report["values"]
    model_tensors = [t["key"][-1] for t in report["tensors"] if t["key"][:-1] == model_key]
    assert model_tensors == [(prefix or "") + k for k in KEYS]
    assert report["num_params"] == sum(v.numel() for v in small_state_dict().values())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_load_returns_the_stripped_model_state_dict(layout_files, name):
    sd = ckpttool.load(layout_files[name])
    assert list(sd) == KEYS
    expected = small_state_dict()
    for key in KEYS:
        assert torch.equal(sd[key], expected[key]), key


def test_strip_prefix_none_keeps_the_keys(layout_files):
    sd = ckpttool.load(layout_files["ddp_of_compile"], strip_prefix="none")
    assert list(sd) == ["module._orig_mod." + k for k in KEYS]
    sd = ckpttool.load(layout_files["ddp_of_compile"], strip_prefix="module.")
    assert list(sd) == ["_orig_mod." + k for k in KEYS]


def test_select_all_and_key_path(layout_files):
    everything = ckpttool.load(layout_files["composer"], select="all")
    assert set(everything) == {"state", "rng"}
    assert set(everything["state"]) == {"model", "optimizers", "schedulers", "timestamp"}
    assert list(everything["state"]["model"]) == ["module." + k for k in KEYS]
    adam = everything["state"]["optimizers"]["Adam"]
    assert sorted(adam["state"]) == [0, 1]
    assert torch.equal(adam["state"][0]["exp_avg"], optimizer_state()["state"][0]["exp_avg"])
    opt = ckpttool.load(layout_files["composer"], select="state.optimizers.Adam")
    assert sorted(opt) == ["param_groups", "state"]
    assert opt["param_groups"][0]["params"] == [0, 1]


def test_optimizer_state_keys_are_ints_in_json(layout_files, cli):
    proc = cli("inspect", "--json", layout_files["nanogpt"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    keys = [t["key"] for t in report["tensors"] if t["key"][0] == "optimizer"]
    assert keys == [
        ["optimizer", "state", 0, "step"],
        ["optimizer", "state", 0, "exp_avg"],
        ["optimizer", "state", 0, "exp_avg_sq"],
        ["optimizer", "state", 1, "step"],
        ["optimizer", "state", 1, "exp_avg"],
        ["optimizer", "state", 1, "exp_avg_sq"],
    ]
    assert {"key": ["optimizer", "param_groups", 0, "params"], "type": "list", "value": [0, 1]} in (
        report["values"]
    )


def test_human_output_shows_model_key_and_prefix(layout_files):
    proc = run_cli("inspect", layout_files["torchrun_tutorial"])
    assert proc.returncode == 0, proc.stderr
    model_line = next(line for line in proc.stdout.splitlines() if line.startswith("model:"))
    assert model_line.startswith("model: MODEL_STATE, ")
    assert model_line.endswith(", wrapper prefix module.")
    assert "EPOCHS_RUN" in proc.stdout


@pytest.mark.parametrize(
    "keys,prefix",
    [
        (["module.a", "module.b"], "module."),
        (["module.a", "b"], None),  # every key must carry it
        (["_orig_mod.module.a"], "_orig_mod.module."),
        (["module._orig_mod.a", "module._orig_mod.b"], "module._orig_mod."),
        (["_forward_module.model.a", "_forward_module.model.b"], "_forward_module."),
        (["modulea"], None),
        ([], None),
    ],
)
def test_detect_prefix(keys, prefix):
    assert detect_prefix(keys) == prefix


def test_strip_prefix_does_not_change_its_input():
    sd = {"module.a": 1, "b": 2}
    assert strip_prefix(sd, "module.") == {"a": 1, "b": 2}
    assert sd == {"module.a": 1, "b": 2}


def test_no_model_state_dict(tmp_path, cli):
    path = tmp_path / "values.pt"
    torch.save({"epoch": 3, "losses": [0.5, 0.25]}, path)
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] is None and report["prefix"] is None
    assert report["tensors"] == [] and report["num_params"] == 0
    with pytest.raises(ckpttool.CkptError, match="no model state dict"):
        ckpttool.load(path)
    assert ckpttool.load(path, select="all") == {"epoch": 3, "losses": [0.5, 0.25]}


def test_one_state_dict_found_outside_known_keys(tmp_path):
    path = tmp_path / "custom.pt"
    torch.save(
        {"weights_of_run": {"inner": small_state_dict()}, "optimizer": {"w": torch.zeros(99)}},
        path,
    )
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] == ["weights_of_run", "inner"]


def converted_names(path, out) -> list[str]:
    """The tensor names `convert --to safetensors` (default selection) writes."""
    proc = run_cli("convert", path, "--to", "safetensors", "-o", out)
    assert proc.returncode == 0, proc.stderr
    return sorted(load_file(out))


def _adam_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


def test_an_optimizer_state_dict_is_not_a_model(tmp_path):
    """HF Trainer's optimizer.pt: param 0's moments are not "the model"; taking them
    made diff compare one parameter's state and call two different files equal."""
    a, b = tmp_path / "optimizer_a.pt", tmp_path / "optimizer_b.pt"
    state = _adam_state(0)
    torch.save(state, a)
    state["state"][1]["exp_avg"] += 1
    torch.save(state, b)
    assert inspect_report(ckpttool.read(a))["model_key"] is None
    with pytest.raises(ckpttool.CkptError, match="no model state dict found"):
        ckpttool.load(a)
    proc = run_cli("diff", a, b)  # no model: every tensor is compared
    assert proc.returncode == 1 and "state.1.exp_avg" in proc.stdout


def test_several_models_are_not_guessed(tmp_path):
    """A GAN snapshot holds two nets beside their optimizers: picking the larger one
    would make diff ignore the other, so the choice is left to --select, named."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 8), nn.Linear(8, 1)
    path = tmp_path / "gan.pt"
    snapshot = {
        "generator": gen.state_dict(),
        "discriminator": disc.state_dict(),
        "opt_g": _adam_state(1),
        "opt_d": _adam_state(2),
        "epoch": 5,
    }
    torch.save(snapshot, path)
    assert inspect_report(ckpttool.read(path))["model_key"] is None
    proc = run_cli("convert", path, "--to", "safetensors", "-o", tmp_path / "out.safetensors")
    assert proc.returncode == 2 and not (tmp_path / "out.safetensors").exists()
    assert proc.stderr.count("\n") == 1
    assert "several state dicts could each be the model (generator, discriminator)" in proc.stderr
    loaded = ckpttool.load(path, select="generator")
    assert list(loaded) == ["weight", "bias"] and torch.equal(loaded["weight"], gen.weight)
    changed = tmp_path / "gan_changed.pt"
    snapshot["discriminator"]["bias"] = snapshot["discriminator"]["bias"] + 1
    torch.save(snapshot, changed)
    proc = run_cli("diff", path, changed)  # no single model: nothing may be ignored
    assert proc.returncode == 1 and "discriminator.bias" in proc.stdout


def test_a_model_in_parts_is_taken_whole(tmp_path):
    """{"encoder", "decoder", "epoch"}: both parts are the model, named by key path,
    and a change in the smaller part is a difference."""
    torch.manual_seed(0)
    enc, dec = nn.Linear(2, 3), nn.Linear(3, 40)
    snapshot = {"encoder": enc.state_dict(), "decoder": dec.state_dict(), "epoch": 3}
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(snapshot, a)
    snapshot["encoder"]["bias"] = snapshot["encoder"]["bias"] + 1
    torch.save(snapshot, b)
    report = inspect_report(ckpttool.read(a))
    assert report["model_key"] == [] and report["num_params"] == 9 + 160
    loaded = ckpttool.load(a)  # the structure the parts' modules load
    assert torch.equal(loaded["encoder"]["weight"], enc.weight) and loaded["epoch"] == 3
    assert converted_names(a, tmp_path / "a.safetensors") == [
        "decoder.bias",
        "decoder.weight",
        "encoder.bias",
        "encoder.weight",
    ]
    proc = run_cli("diff", a, b)
    assert proc.returncode == 1 and "encoder.bias" in proc.stdout


def test_a_nested_model_state_dict_is_taken_whole(tmp_path):
    """Megatron-LM nests its model state dict by module (language_model.embedding...):
    all of it is the model, not its largest leaf dict."""
    torch.manual_seed(0)
    model = {
        "language_model": {
            "embedding": {"word_embeddings": {"weight": torch.randn(16, 4)}},
            "encoder": {
                "layers.0.mlp.weight": torch.randn(4, 4),
                "layers.0.mlp.bias": torch.randn(4),
                "final_norm.weight": torch.ones(4),
            },
            "output_layer": {"weight": torch.randn(16, 4)},
        }
    }
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": model, "optimizer": _adam_state(0), "iteration": 10}, path)
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] == ["model"] and report["num_params"] == 64 + 16 + 4 + 4 + 64
    loaded = ckpttool.load(path)  # nested, as Megatron's load_state_dict takes it
    assert torch.equal(
        loaded["language_model"]["output_layer"]["weight"],
        model["language_model"]["output_layer"]["weight"],
    )
    assert converted_names(path, tmp_path / "megatron.safetensors") == [
        "language_model.embedding.word_embeddings.weight",
        "language_model.encoder.final_norm.weight",
        "language_model.encoder.layers.0.mlp.bias",
        "language_model.encoder.layers.0.mlp.weight",
        "language_model.output_layer.weight",
    ]
    proc = run_cli("inspect", path)
    assert proc.returncode == 0 and "model: model, 5 tensors" in proc.stdout


def test_pickled_module_is_not_mistaken_for_one_layer(tmp_path):
    """torch.save(model) keeps one ``_parameters`` dict per layer: none is the state dict."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 8))
    path = tmp_path / "whole_model.pt"
    torch.save({"model": model, "epoch": 1}, path)
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] == ["model"]  # the module itself, not a layer inside it
    keys = [t["key"] for t in report["tensors"]]  # named as state_dict() names them
    assert keys == [["model", "0", "weight"], ["model", "0", "bias"], ["model", "2", "weight"],
                    ["model", "2", "bias"]]  # fmt: skip
    assert {"key": ["epoch"], "type": "int", "value": 1} in report["values"]
    loaded = ckpttool.load(path)  # not silently layer 2's {"weight", "bias"}
    assert list(loaded) == ["0.weight", "0.bias", "2.weight", "2.bias"]


class TiedNet(nn.Module):
    """A model whose state_dict() differs from its attributes in every way torch has."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.body = nn.Sequential(nn.Linear(3, 3, bias=False), nn.BatchNorm1d(3))
        self.head = nn.Linear(3, 5)
        self.head.weight = self.emb.weight  # tied: two names, one tensor
        self.register_buffer("scale", torch.ones(3), persistent=False)  # not in state_dict
        self.register_buffer("offset", torch.arange(3.0))
        self.stride = torch.tensor([8.0, 16.0])  # a plain attribute, not state


def test_pickled_module_reads_as_its_state_dict_everywhere(tmp_path):
    torch.manual_seed(0)
    model = TiedNet()
    path = tmp_path / "snapshot.pt"
    torch.save({"model": model, "epoch": 3}, path)
    truth = model.state_dict()
    names = list(truth)
    assert "scale" not in names and "stride" not in names and "body.0.bias" not in names
    # the model's own class is on no list: constructing it is refused until allowed
    allow = [f"{TiedNet.__module__}.{TiedNet.__qualname__}"]
    refused = run_cli("inspect", path)
    assert refused.returncode == 3 and f"--allow {allow[0]}" in refused.stderr
    loaded = ckpttool.load(path, allow=allow)
    assert list(loaded) == names
    for name in names:
        assert torch.equal(loaded[name], truth[name]), name
    assert loaded["head.weight"].data_ptr() == loaded["emb.weight"].data_ptr()
    report = inspect_report(ckpttool.read(path, allow=allow))  # under the names torch gives
    assert [".".join(t["key"]) for t in report["tensors"]] == [f"model.{n}" for n in names]
    out = tmp_path / "all.safetensors"
    proc = run_cli(
        "convert", path, "--select", "all", "--to", "safetensors", "-o", out, "--allow", allow[0]
    )
    assert proc.returncode == 0, proc.stderr
    written = load_file(out)  # the tied head written once, named in the metadata
    assert list(written) == [f"model.{n}" for n in names if n != "head.weight"]
    written = ckpttool.load(out)
    assert list(written) == [f"model.{n}" for n in names if n != "head.weight"] + [
        "model.head.weight"
    ]
    for name in names:
        assert torch.equal(written[f"model.{name}"], truth[name]), name
    fresh = TiedNet()
    ckpttool.load_into(fresh, path, allow=allow)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, truth[name]), name


def test_ema_module_beside_model_module_is_the_model_as_yolo_loads_it(tmp_path):
    # YOLOv5 / Ultralytics training checkpoints: ckpt.get("ema") or ckpt["model"]
    torch.manual_seed(0)
    model, ema = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
    path = tmp_path / "last.pt"
    torch.save({"epoch": 3, "model": model, "ema": ema, "updates": 9}, path)
    assert inspect_report(ckpttool.read(path))["model_key"] == ["ema"]
    loaded = ckpttool.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in ema.state_dict().items())
    # plain state dicts under both keys: "model", as before
    torch.save({"model": model.state_dict(), "ema": ema.state_dict()}, path)
    assert inspect_report(ckpttool.read(path))["model_key"] == ["model"]


class WithNormLayer(nn.Module):
    """As torchvision's VisionTransformer keeps its norm_layer: a partial of a torch class."""

    def __init__(self) -> None:
        super().__init__()
        self.norm_layer = functools.partial(nn.LayerNorm, eps=1e-6)
        self.norm = self.norm_layer(3)


def test_pickled_module_holding_a_partial_of_a_torch_class_reads(tmp_path):
    model = WithNormLayer()
    path = tmp_path / "vit.pt"
    torch.save(model, path)
    allow = f"{WithNormLayer.__module__}.{WithNormLayer.__qualname__}"  # the model's own class
    proc = run_cli("inspect", path, "--json", "--allow", allow)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["dangerous"] == []
    assert list(ckpttool.load(path, allow=[allow])) == ["norm.weight", "norm.bias"]
    assert run_cli("merge", path, "-o", tmp_path / "out.pt", "--allow", allow).returncode == 0


def test_pickled_module_that_holds_itself_reads_once(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    model._modules["loop"] = model  # torch's own state_dict() would never end
    path = tmp_path / "loop.pt"
    torch.save(model, path)
    proc = run_cli("inspect", path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert [t["key"] for t in json.loads(proc.stdout)["tensors"]] == [
        ["0", "weight"],
        ["0", "bias"],
    ]
    assert list(ckpttool.load(path)) == ["0.weight", "0.bias"]


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("snapshot", [False, True])
def test_pickled_whole_module_gives_its_state_dict(tmp_path, legacy, snapshot):
    """torch.save(model) (old repos do it): the module's parameters and persistent buffers,
    read from the pickled object without running its class."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Sequential(nn.Linear(3, 2)))
    model.register_buffer("scratch", torch.zeros(5), persistent=False)
    path = tmp_path / "whole.pt"
    obj = {"model": model, "epoch": 7} if snapshot else model
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)

    expected = model.state_dict()
    loaded = ckpttool.load(path)
    assert list(loaded) == list(expected)  # scratch (non-persistent) is not in it
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor)
    report = inspect_report(ckpttool.read(path))
    assert report["model_key"] == (["model"] if snapshot else [])
    assert report["num_params"] == sum(t.numel() for t in expected.values())


def test_a_lone_pickled_module_outside_known_keys_is_the_model(tmp_path):
    """Ultralytics' last.pt mid-training: ``"model": None`` and the weights only as the
    pickled half-precision EMA module; two such modules are not guessed between, and a
    state dict beside a helper module is still the model."""
    torch.manual_seed(0)
    ema = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).half()
    path = tmp_path / "last.pt"
    torch.save({"epoch": 3, "model": None, "ema": ema, "optimizer": _adam_state(0)}, path)
    assert inspect_report(ckpttool.read(path))["model_key"] == ["ema"]
    loaded = ckpttool.load(path)
    assert list(loaded) == list(ema.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in ema.state_dict().items())

    two = tmp_path / "two_modules.pt"
    torch.save({"netG": ema, "netD": nn.Linear(2, 2), "epoch": 1}, two)
    proc = run_cli("convert", two, "--to", "safetensors", "-o", tmp_path / "out.safetensors")
    assert proc.returncode == 2
    assert "several state dicts could each be the model (netG, netD)" in proc.stderr

    beside = tmp_path / "beside_a_module.pt"
    torch.save({"weights_g": nn.Linear(2, 2).state_dict(), "lpips": nn.Linear(3, 3)}, beside)
    assert inspect_report(ckpttool.read(beside))["model_key"] == ["weights_g"]


def test_deepspeed_zero3_placeholders_are_refused_with_the_next_step(tmp_path):
    """ZeRO-3 model states hold every parameter as an empty placeholder (its values are
    partitioned over the optimizer states): convert would write an empty model."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    states = {
        "module": {
            k: torch.empty(0) if k in dict(model.named_parameters()) else v
            for k, v in model.state_dict().items()
        },
        "param_shapes": [{n: p.shape for n, p in model.named_parameters()}],
        "ds_version": "0.14.4",
    }
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(states, path)
    proc = run_cli("convert", path, "--to", "safetensors", "-o", tmp_path / "out.safetensors")
    assert proc.returncode == 2 and not (tmp_path / "out.safetensors").exists()
    assert proc.stderr == (
        f"ckpttool: error: {path}: DeepSpeed ZeRO-3 model states: '0.weight' is an empty "
        "placeholder of shape [3, 4]; the weights are partitioned over the "
        "zero_pp_rank_*_optim_states.pt files (pass the folder that holds them to rebuild "
        "the fp32 weights)\n"
    )
    assert inspect_report(ckpttool.read(path))["model_key"] == ["module"]  # still shown
    states["module"] = model.state_dict()  # ZeRO-1/2: the weights are there
    torch.save(states, path)
    assert list(ckpttool.load(path)) == list(model.state_dict())
