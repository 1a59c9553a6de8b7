"""``--dtype`` casts without torch (``ckpttool/writers/casts.py``): every value of every
16- and 8-bit source, and float32/float64 values at every rounding boundary, cast to
float32, float16 and bfloat16 give torch's ``.to()`` bytes (NaN by the module's rule,
which is what torch's x86 loops write), and the same bytes however the elements are
cut into windows."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from ckpttool.dtypes import DTYPES
from ckpttool.writers import casts

TARGETS = ["float32", "float16", "bfloat16"]
SMALL = ["float16", "bfloat16", *(n for n in DTYPES if n.startswith("float8_"))]
X86 = platform.machine().lower() in ("x86_64", "amd64")


def torch_cast(data: bytes, source: str, target: str) -> bytes:
    tensor = torch.frombuffer(bytearray(data), dtype=getattr(torch, source))
    return tensor.to(getattr(torch, target)).view(torch.uint8).numpy().tobytes()


def ours(data: bytes, source: str, target: str) -> bytes:
    return bytes(casts.cast_bytes(data, DTYPES[source], DTYPES[target]))


def assert_like_torch(data: bytes, source: str, target: str) -> None:
    got, want = ours(data, source, target), torch_cast(data, source, target)
    if X86:
        assert got == want
        return
    # elsewhere torch's NaN bits differ by loop and build: every other value must agree
    size = DTYPES[target].itemsize
    kind = {4: "<f4", 2: "<f2"}[size] if target != "bfloat16" else None
    if kind is not None:
        nan = np.isnan(np.frombuffer(want, dtype=kind))
    else:
        bits = np.frombuffer(want, dtype="<u2")
        nan = (bits & 0x7FFF) > 0x7F80
    g = np.frombuffer(got, dtype=f"<u{size}")
    w = np.frombuffer(want, dtype=f"<u{size}")
    assert (g[~nan] == w[~nan]).all()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SMALL)
def test_every_value_of_a_small_type(source, target):
    count = 1 << (8 * DTYPES[source].itemsize)
    data = np.arange(count, dtype="<u2" if count > 256 else "u1").tobytes()
    assert_like_torch(data, source, target)


def _float32_boundaries() -> np.ndarray:
    """Every sign and exponent with the mantissas where float16 and bfloat16 rounding
    turns (ties to even, just below and above), the extremes, and every NaN class."""
    lows = [0, 1, 2, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001]
    lows += [0xFFFF, 0x10000, 0x18000, 0x17FFF, 0x400000, 0x7FFFFF, 0x7FE000, 0x7FF000]
    rest = np.arange(512, dtype=np.uint32) << 23
    bits = (rest[:, None] | np.array(lows, dtype=np.uint32)[None, :]).ravel()
    rng = np.random.default_rng(31)
    return np.concatenate([bits, rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_float32_at_every_rounding_boundary(target):
    assert_like_torch(_float32_boundaries().astype("<u4").tobytes(), "float32", target)


@pytest.mark.parametrize("target", TARGETS)
def test_float64_rounds_through_float32_as_torch_does(target):
    """float64 -> float16/bfloat16 is float64 -> float32 -> target in torch (rounded
    twice): 1 + 2**-11 + 2**-40 is 1.0 in float16 there, not the next value up."""
    rng = np.random.default_rng(64)
    wide = _float32_boundaries().astype(np.uint64) << 29
    tails = np.array([0, 1, 1 << 28, (1 << 28) - 1, (1 << 28) + 1, (1 << 29) - 1], np.uint64)
    near = wide | rng.choice(tails, size=len(wide))
    special = np.array([1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40, 1e300, -1e-300, 3.4028235e38])
    data = np.concatenate(
        [near.view("<f8"), special, rng.integers(0, 1 << 64, 1 << 18, np.uint64).view("<f8")]
    ).astype("<f8")
    assert_like_torch(data.tobytes(), "float64", target)
    if target == "float16":
        assert ours(np.array([1 + 2**-11 + 2**-40]).tobytes(), "float64", target) == b"\x00\x3c"


def test_nan_bits_follow_one_rule():
    f32 = np.array([0x7FC00000, 0xFF812345, 0x7F800001], dtype="<u4").tobytes()
    assert ours(f32, "float32", "float16") == bytes.fromhex("007e09fe007e")
    assert ours(f32, "float32", "bfloat16") == bytes.fromhex("ffff" * 3)
    half_nan = np.array([0x7C01, 0xFE00], dtype="<u2").tobytes()
    assert ours(half_nan, "float16", "float32") == bytes.fromhex("0020c07f0000c0ff")
    assert ours(half_nan, "float16", "bfloat16") == bytes.fromhex("c07f" * 2)


def test_a_cast_cut_anywhere_gives_the_same_bytes(monkeypatch):
    """cast_stored over any byte range, a few elements a window: the bytes of the whole
    cast, sliced."""
    from ckpttool.sources import ByteSpan
    from ckpttool.tree import StorageRef, TensorRef

    rng = np.random.default_rng(5)
    values = rng.standard_normal(1000).astype("<f4")
    values[::97] = np.nan
    data = values.tobytes()
    half = len(data) // 2
    parts = []
    f32 = DTYPES["float32"]
    for lo, hi in ((0, half), (half, len(data))):
        n = (hi - lo) // 4
        storage = StorageRef("0", f32, n, "cpu", ByteSpan(data=data[lo:hi], length=hi - lo))
        parts.append(TensorRef(f32, (n,), (1,), 0, storage))
    whole = ours(data, "float32", "bfloat16")
    monkeypatch.setattr(casts, "CAST_ELEMENTS", 7)
    for start, length in [(0, len(whole)), (1, 5), (13, 999), (998, 2), (500, 1000)]:
        got = b"".join(casts.cast_stored(parts, f32, DTYPES["bfloat16"], start, length))
        assert got == whole[start : start + length]


def test_no_rule_for_other_types():
    with pytest.raises(casts.CkptError, match="no cast from int64 to bfloat16"):
        casts.cast_bytes(b"\0" * 8, DTYPES["int64"], DTYPES["bfloat16"])
    with pytest.raises(casts.CkptError, match="no cast from float32 to float64"):
        casts.cast_bytes(b"\0" * 4, DTYPES["float32"], DTYPES["float64"])


def test_a_converted_cast_needs_no_torch_and_equals_torchs(tmp_path):
    """``convert --dtype bfloat16`` of stored tensors (here three uneven FSDP rank files)
    runs without importing torch, window by window, and writes torch's ``.to()`` bytes."""
    import subprocess
    import sys

    from helpers import FIXTURES, subprocess_env
    from safetensors.torch import load_file

    from ckpttool import load

    inputs = [str(FIXTURES / "fsdp_uneven" / f"model-rank{r}.pt") for r in range(3)]
    out = tmp_path / "m.safetensors"
    code = (
        "import sys; from ckpttool.cli import main\n"
        "try:\n    main(['convert', *sys.argv[1:], '--to', 'safetensors', '--dtype', 'bfloat16'])\n"
        "except SystemExit as e:\n    code = e.code\n"
        "assert code == 0, code\nassert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *inputs, "-o", str(out)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got, want = load_file(str(out)), load(inputs)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        cast = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(got[name].view(torch.uint8), cast.contiguous().view(torch.uint8))
