"""DCP's ``.metadata`` written without torch (``ckpttool.writers.dcp_metadata_pickle``):
byte for byte ``pickle.dumps`` of torch's own ``Metadata`` built the way the DCP writer
built it before (kept here as the reference), for generated tensor sets and for the
writer's real plans; loaded by torch as those objects; ``convert --to dcp`` in a fresh
process never imports torch."""

from __future__ import annotations

import pickle
import pickletools
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import FIXTURES, ROOT, assert_identical, subprocess_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckpttool
from ckpttool.api.reading import flatten_tensors, select_node
from ckpttool.dtypes import DTYPES
from ckpttool.writers import dcp, output_dtype
from ckpttool.writers.dcp_metadata_pickle import DcpItem, metadata_pickle
from ckpttool.writers.plan import WriteOptions
from ckpttool.writers.torch_zip import plan_zip

DATA_FILE = dcp.DATA_FILE


def reference_metadata(items: list[DcpItem], data_file: str = DATA_FILE) -> Metadata:
    """torch's objects, as ``writers/dcp.py`` built them before it stopped importing torch."""
    entries: dict = {}
    storage: dict = {}
    for item in items:
        shape = torch.Size(item.shape)
        zeros = torch.Size([0] * len(shape))
        properties = TensorProperties(
            dtype=getattr(torch, item.dtype), requires_grad=item.requires_grad
        )
        entries[item.name] = TensorStorageMetadata(
            properties=properties,
            size=shape,
            chunks=[ChunkStorageMetadata(offsets=zeros, sizes=shape)],
        )
        storage[MetadataIndex(item.name, zeros, 0)] = _StorageInfo(
            data_file, item.offset, item.length
        )
    return Metadata(
        state_dict_metadata=entries,
        planner_data={item.name: (item.name,) for item in items},
        storage_data=storage,
    )


def assert_same_bytes(items: list[DcpItem]) -> bytes:
    ours, want = metadata_pickle(items, DATA_FILE), pickle.dumps(reference_metadata(items))
    if ours != want:  # the first opcode that differs, not two walls of bytes
        got = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(ours)]
        ref = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(want)]
        first = next(
            (i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
            min(len(got), len(ref)),
        )
        shown = slice(first, first + 4)
        raise AssertionError(f"opcode {first}: {got[shown]} != {ref[shown]}")
    return ours


FLOATING = [name for name, dt in DTYPES.items() if dt.is_floating]
SOME_DTYPES = ["float32", "bfloat16", "bool", "float8_e4m3fn", "int64", "complex64", "uint16"]


def items_of(n: int, dtypes: list[str] = SOME_DTYPES) -> list[DcpItem]:
    return [
        DcpItem(
            f"model.layers.{i}.weight",
            dtypes[i % len(dtypes)],
            ((i % 5) + 1, 3 * i)[: i % 3],
            i % 3 == 1,
            i * 4096,
            4096,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("n", [0, 1, 2, 11, 300, 999, 1000, 1001, 2000])
def test_bytes_equal_torch_pickle_around_batch_sizes(n: int):
    """No tensor, one (SETITEM), several (SETITEMS), the C pickler's batches of 1000
    (an empty MARK SETITEMS after a full last batch), memo indexes past 255."""
    assert_same_bytes(items_of(n))


def test_many_tensors_past_64k_memo_entries_and_many_frames():
    """5000 tensors: GETs of memo indexes past 65,535 (LONG_BINGET), frames of 64 KiB cut
    where an object's save begins, five full batches of 1000."""
    raw = assert_same_bytes(items_of(5000))
    ops = list(pickletools.genops(raw))
    frames = [arg for op, arg, _ in ops if op.name == "FRAME"]
    assert len(frames) > 5 and all(size >= 64 * 1024 for size in frames[:-1])
    assert max(arg for op, arg, _ in ops if op.name == "LONG_BINGET") > 65536


def test_every_dtype_is_torchs_and_pickles_by_its_name():
    """Every dtype ckpttool knows exists in torch 2.13 and is written as torch names it
    (``torch.bfloat16``, ``torch.float8_e4m3fn``, ``torch.bool``...), each once."""
    for name in DTYPES:
        assert isinstance(getattr(torch, name), torch.dtype), name
        assert getattr(torch, name).__reduce__() == name
    items = [
        DcpItem(f"t.{name}", name, (2, 3), name in FLOATING, i * 64, 64)
        for i, name in enumerate(DTYPES)
    ]
    assert_same_bytes(items + [item._replace(name=item.name + ".again") for item in items])


def test_edge_shapes_names_and_offsets():
    """0-d and empty tensors, dims and offsets past 2**31 and 2**63 (LONG1), names of
    every width: 255/256 UTF-8 bytes (SHORT_BINUNICODE/BINUNICODE), 64 KiB and more
    (written outside any frame), non-BMP characters, a lone surrogate, the empty name."""
    items = [
        DcpItem("", "float32", (), False, 0, 1),
        DcpItem("scalar", "bfloat16", (), True, 1, 2),
        DcpItem("empty", "float32", (0, 4), True, 2**31 - 1, 0),
        DcpItem("huge", "float8_e4m3fn", (2**40, 2**31, 1), False, 2**31, 2**63 + 5),
        DcpItem("x" * 255, "bool", (1,) * 8, False, 65535, 65536),
        DcpItem("é" * 128, "int8", (256, 65536, 2**16 - 1), False, 2**32, 2**64),
        DcpItem("🙂 poids.ß.層", "complex64", (7,), True, 3, 4),
        DcpItem("lone \ud800 surrogate", "uint8", (2,), False, 3, 4),  # pickle's surrogatepass
        DcpItem("n" * (64 * 1024), "float16", (5, 5), False, 4, 5),
        DcpItem("m" * (64 * 1024 - 1), "float16", (5, 5), False, 4, 5),
        DcpItem("ü" * 70_000, "float32", (1, 2, 3, 4), True, 5, 6),
    ]
    assert_same_bytes(items)
    assert_same_bytes(items[::-1])


def test_names_that_are_torchs_own_strings():
    """A tensor named like an attribute, a class or a module torch's pickle writes: the
    C pickler memoizes by identity, so an interned name is torch's own string object
    (written once), another equal one is not; one-character names are shared objects."""
    words = ["size", "offset", "fqn", "chunks", "torch", "Size", "Metadata", "_StorageInfo"]
    words += ["_get_layout", "version", "float32", "torch.strided", "a", "__0_0.distcp"]
    interned = [sys.intern(word) for word in words]
    fresh = [word if len(word) == 1 else "".join([word[:1], word[1:]]) for word in words]
    for names in (interned, fresh):
        assert_same_bytes([DcpItem(name, "float32", (1,), False, 0, 4) for name in names])


@st.composite
def tensor_sets(draw) -> list[DcpItem]:
    names = draw(
        st.lists(
            st.one_of(
                st.text(max_size=12),
                st.sampled_from(["size", "torch", "weight", "offset", "a", ""]),
                st.text(alphabet="ab.é🙂", min_size=250, max_size=300),
            ),
            unique=True,
            max_size=40,
        )
    )
    items = []
    for name in names:
        dtype = draw(st.sampled_from(list(DTYPES)))
        dims = st.one_of(st.integers(0, 300), st.integers(0, 2**63))
        shape = tuple(draw(st.lists(dims, max_size=6)))
        grad = draw(st.booleans())
        offset = draw(st.integers(0, 2**64))
        length = draw(st.integers(0, 2**40))
        items.append(DcpItem(name, dtype, shape, grad, offset, length))
    return items


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_sets())
def test_generated_tensor_sets_pickle_as_torch_does(items: list[DcpItem]):
    raw = assert_same_bytes(items)
    loaded = pickle.loads(raw)  # torch's own classes, as torch's FileSystemReader loads them
    assert loaded == reference_metadata(items)


# ---------------------------------------------------------------- the writer's plans


def old_plan_metadata(tensors: dict, options: WriteOptions) -> bytes:
    """``.metadata`` as ``writers/dcp.py`` made it with torch (its code before)."""
    items, offset = [], 0
    for name, leaf in tensors.items():
        _, size = plan_zip(leaf, cast=options.cast, base=offset)
        dtype = output_dtype(leaf, options.cast)
        grad = leaf.requires_grad and not leaf.sharded
        grad = grad and (dtype.is_floating or dtype.name.startswith("complex"))
        items.append(DcpItem(name, dtype.name, tuple(leaf.shape), grad, offset, size))
        offset += size
    return pickle.dumps(reference_metadata(items))


def model_tensors(path: Path) -> dict:
    key_path, node = select_node(ckpttool.read(str(path)), "auto", "auto")
    return flatten_tensors(node, str(key_path[-1]) if key_path else "")


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """Parameters (requires_grad), views, ints, bools, bf16, fp8, 0-d and empty tensors."""
    from helpers import tricky_tensors

    state = tricky_tensors()
    state["param"] = torch.nn.Parameter(torch.randn(3, 2))
    state["frozen"] = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    state["cgrad"] = torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))
    path = tmp_path / "in.pt"
    torch.save(state, path)
    return path


@pytest.mark.parametrize("cast", [None, "bfloat16"])
@pytest.mark.parametrize("source", ["snapshot", "dcp", "ddp", "safetensors"])
def test_writer_plan_metadata_is_the_old_bytes(source: str, cast: str | None, request):
    path = request.getfixturevalue("snapshot") if source == "snapshot" else FIXTURES / source
    tensors = model_tensors(path)
    options = WriteOptions(cast=DTYPES[cast] if cast else None)
    plan = dcp.plan(tensors, options)
    (metadata,) = [f for f in plan.files if f.name == ".metadata"]
    assert [piece.data for piece in metadata.pieces] == [old_plan_metadata(tensors, options)]


def test_convert_to_dcp_in_a_fresh_process_imports_no_torch(tmp_path: Path):
    """``ckpttool convert --to dcp`` of tensors stored as they are (no view to gather,
    no cast): the whole command without torch; torch's own DCP loader then reads every
    tensor bitwise, with requires_grad as torch would record it."""
    g = torch.Generator().manual_seed(5)
    snapshot = tmp_path / "plain.pt"
    torch.save(
        {
            "param": torch.nn.Parameter(torch.randn(3, 2, generator=g)),
            "frozen": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
            "cgrad": torch.nn.Parameter(torch.randn(2, dtype=torch.complex64, generator=g)),
            "bf16": torch.randn(4, 4, generator=g).bfloat16(),
            "fp8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
            "flags": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 3),
            "ids": torch.arange(10),
        },
        snapshot,
    )
    out = tmp_path / "out-dcp"
    code = (
        "import sys\nfrom ckpttool.cli import main\n"
        "sys.argv = ['ckpttool', 'convert', sys.argv[1], '--to', 'dcp', '-o', sys.argv[2]]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(snapshot), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    import torch.distributed.checkpoint as torch_dcp

    want = {k: v.detach().contiguous() for k, v in torch.load(snapshot).items()}
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in one process"
        torch_dcp.load(state, checkpoint_id=str(out))
    assert_identical(state, want)
    metadata = torch_dcp.FileSystemReader(str(out)).read_metadata()
    assert list(metadata.state_dict_metadata) == list(want)
    grads = {k: m.properties.requires_grad for k, m in metadata.state_dict_metadata.items()}
    assert grads == {k: k in ("param", "cgrad") for k in want}
