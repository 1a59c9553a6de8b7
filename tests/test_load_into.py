"""``ckpttool.load_into``: tensors copied straight into a model's parameters and buffers,
keys reported as ``load_state_dict`` reports them, nothing changed on a mismatch."""

from __future__ import annotations

import pytest
import torch
from helpers import write_dcp
from safetensors.torch import save_file

import ckpttool


class Tied(torch.nn.Module):
    """An embedding tied to the output layer, a norm and a persistent integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)


def trained(seed: int = 0) -> Tied:
    torch.manual_seed(seed)
    model = Tied()
    with torch.no_grad():
        model.norm.weight.uniform_()
        model.steps += 41
    return model


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("fmt", ["torch-zip", "legacy", "safetensors", "dcp", "ddp-snapshot"])
def test_load_into_a_model_with_tied_weights_and_buffers(tmp_path, fmt):
    source = trained(0)
    sd = source.state_dict()
    if fmt == "safetensors":
        path = tmp_path / "m.safetensors"
        save_file({k: v.clone() for k, v in sd.items()}, path)  # tied weights saved twice
    elif fmt == "dcp":
        path = tmp_path / "dcp"
        write_dcp(path, {"model": {k: v.clone() for k, v in sd.items()}, "step": 3})
    elif fmt == "ddp-snapshot":
        path = tmp_path / "snap.pt"
        torch.save({"MODEL_STATE": {f"module.{k}": v for k, v in sd.items()}, "EPOCHS_RUN": 2},
                   path)  # fmt: skip
    else:
        path = tmp_path / "m.pt"
        torch.save(sd, path, _use_new_zipfile_serialization=fmt != "legacy")
    target = trained(1)
    embed, norm, steps = target.embed.weight, target.norm.weight, target.steps
    result = ckpttool.load_into(target, path)
    assert result == ckpttool.LoadResult([], [])
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert same_state(target, source)
    # in place: the same Parameter and buffer objects, the tie kept
    assert target.embed.weight is embed and target.norm.weight is norm and target.steps is steps
    assert target.head.weight is target.embed.weight
    assert target.embed.weight.requires_grad


def test_missing_and_unexpected_keys_strict_refuses_before_changing_anything(tmp_path):
    sd = dict(trained(0).state_dict())
    del sd["norm.bias"]
    sd["extra.weight"] = torch.ones(2)
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    target = trained(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ckpttool.CkptError) as info:
        ckpttool.load_into(target, path)
    assert info.value.missing_keys == ["norm.bias"]
    assert info.value.unexpected_keys == ["extra.weight"]
    assert str(info.value) == (
        f"{path}: missing key(s) in the checkpoint: 'norm.bias'; unexpected key(s) in the "
        "checkpoint: 'extra.weight' (pass strict=False to load the keys that match)"
    )
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())
    # what load_state_dict(strict=False) reports, and the matching keys loaded
    reference = trained(1)
    expected = reference.load_state_dict(torch.load(path, weights_only=True), strict=False)
    result = ckpttool.load_into(target, path, strict=False)
    assert result.missing_keys == expected.missing_keys
    assert result.unexpected_keys == expected.unexpected_keys
    assert same_state(target, reference)


def test_a_shape_mismatch_is_refused_before_changing_anything(tmp_path):
    sd = dict(trained(0).state_dict())
    sd["norm.weight"] = torch.ones(5)
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    target = trained(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ckpttool.CkptError, match=r"size mismatch for 'norm.weight': the "
                       r"checkpoint has \[5\], the model \[6\]"):  # fmt: skip
        ckpttool.load_into(target, path, strict=False)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())


def test_load_into_a_state_dict_casts_to_its_dtypes(tmp_path):
    saved = {"w": torch.randn(4, 3), "n": torch.arange(4)}
    path = tmp_path / "sd.pt"
    torch.save(saved, path)
    target = {"w": torch.zeros(4, 3, dtype=torch.bfloat16), "n": torch.zeros(4, dtype=torch.int32),
              "absent": torch.zeros(1)}  # fmt: skip
    result = ckpttool.load_into(target, path, strict=False)
    assert result == (["absent"], [])  # type: ignore[comparison-overlap]
    assert torch.equal(target["w"], saved["w"].bfloat16())
    assert torch.equal(target["n"], saved["n"].int())


def test_load_into_a_non_contiguous_target_and_a_view_in_the_file(tmp_path):
    base = torch.randn(5, 4)
    path = tmp_path / "sd.pt"
    torch.save({"w": base.t(), "rows": base[1:3]}, path)
    target = {"w": torch.zeros(5, 4).t(), "rows": torch.zeros(2, 4)}
    ckpttool.load_into(target, path)
    assert torch.equal(target["w"], base.t()) and torch.equal(target["rows"], base[1:3])


def test_load_into_a_ddp_wrapped_model_matches_its_module_prefix(tmp_path):
    source = trained(0)
    path = tmp_path / "m.safetensors"
    save_file({k: v.clone() for k, v in source.state_dict().items()}, path)

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    target = Wrapper(trained(1))
    assert ckpttool.load_into(target, path) == ([], [])  # type: ignore[comparison-overlap]
    assert same_state(target.module, source)


def test_load_into_refuses_what_is_not_a_model(tmp_path):
    path = tmp_path / "sd.pt"
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(ckpttool.CkptError, match="nn.Module or a dict of tensors, not list"):
        ckpttool.load_into([torch.ones(1)], path)


@pytest.mark.slow
def test_load_into_from_sharded_checkpoints(dist_runs, dist_reference):
    full = dist_reference["two"]["model"]
    for source in (dist_runs.two / "dcp", str(dist_runs.two / "ep0-ba1-rank*.pt")):
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        assert ckpttool.load_into(target, source) == ([], [])  # type: ignore[comparison-overlap]
        assert all(torch.equal(target[k], v) for k, v in full.items())


# ------------------------------------------ CUDA: pinned buffers, overlapped copies


@pytest.fixture(params=[4, 1], ids=["reader-threads", "caller-reads"])
def small_staging(monkeypatch, request):
    """Staging buffers of 1 KiB: every tensor goes through several, each reused; read by
    the reader threads (every chunk) or by the caller's thread alone."""
    import ckpttool.tensors.direct as fastload

    monkeypatch.setattr(fastload, "STAGING_BYTES", 1024)
    monkeypatch.setattr(fastload, "THREAD_MIN_BYTES", 0)
    monkeypatch.setattr(fastload, "READ_THREADS", request.param)


@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors", "dcp"])
@pytest.mark.usefixtures("small_staging")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_into_a_cuda_model(tmp_path, fmt):
    source = trained(0)
    source.embed.weight.data = torch.randn(4000, 6)  # 96 KB: many staging rounds
    source.head.weight = source.embed.weight
    sd = source.state_dict()
    path = tmp_path / ("m.safetensors" if fmt == "safetensors" else "m.pt")
    if fmt == "safetensors":
        save_file({k: v.clone() for k, v in sd.items()}, path)
    elif fmt == "dcp":
        path = tmp_path / "dcp"
        write_dcp(path, {"model": {k: v.clone() for k, v in sd.items()}})
    else:
        torch.save(sd, path)
    target = trained(1)
    target.embed.weight.data = torch.zeros(4000, 6)
    target.head.weight = target.embed.weight
    target.to("cuda:0")
    assert ckpttool.load_into(target, path) == ([], [])  # type: ignore[comparison-overlap]
    assert target.head.weight is target.embed.weight
    got = {k: v.cpu() for k, v in target.state_dict().items()}
    assert all(torch.equal(got[k], v) for k, v in sd.items())


@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors", "dcp"])
@pytest.mark.usefixtures("small_staging")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_with_map_location_cuda(tmp_path, fmt):
    w = torch.randn(3000, 5)
    sd = {"w": w, "tied": w, "view": w[10:20], "n": torch.arange(7), "h": torch.randn(9).half()}
    if fmt == "safetensors":
        path = tmp_path / "sd.safetensors"
        save_file({k: v.clone().contiguous() for k, v in sd.items()}, path)
    elif fmt == "dcp":
        path = tmp_path / "dcp"
        write_dcp(path, {"model": {k: v.clone() for k, v in sd.items()}})
    else:
        path = tmp_path / "sd.pt"
        torch.save(sd, path)
    for mmap in (True, False):
        got = ckpttool.load(path, map_location="cuda:0", mmap=mmap)
        assert sorted(got) == sorted(sd)
        for k, v in sd.items():
            assert got[k].device == torch.device("cuda:0")
            assert torch.equal(got[k].cpu(), v), k
        if fmt == "torch-zip":  # tied weights share one storage on the device too
            assert got["w"].untyped_storage().data_ptr() == got["tied"].untyped_storage().data_ptr()
    with ckpttool.open(path, map_location="cuda:0") as f:
        assert torch.equal(f.get_tensor("w").cpu(), w)
        assert f.get_slice("w")[5:9].device == torch.device("cuda:0")


def test_keys_one_prefix_apart_are_named_with_the_prefix(tmp_path):
    """A Lightning-like checkpoint keeps the model under ``model.``: 21 missing and 21
    unexpected keys say little; that they differ by one prefix, and how to strip it, does."""
    sd = {"model." + k: v for k, v in trained(0).state_dict().items()}
    path = tmp_path / "lightning.pt"
    torch.save({"state_dict": sd}, path)
    target = trained(1)
    with pytest.raises(ckpttool.CkptError) as info:
        ckpttool.load_into(target, path)
    line = str(info.value)
    assert "they differ by the prefix 'model.' every checkpoint key has" in line
    assert line.endswith("(pass strip_prefix='model.')")
    ckpttool.load_into(target, path, strip_prefix="model.")  # and so it loads
    assert same_state(target, trained(0))
