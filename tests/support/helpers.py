"""The test suite's shared helpers: the CLI runner and its error check, one bitwise
nested-equality check, small real checkpoints, and the torchrun launcher.

Fixtures (pytest's) live in ``conftest.py``; malicious pickles in ``payloads.py``; the
code the torchrun workers run in ``dist_workers.py``. Every test module imports its
helpers from here, so each exists once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ckpttool import sources

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"


# --------------------------------------------------------------------- processes


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment, with the checkout first on ``PYTHONPATH`` and one OpenMP thread
    (2 cores are shared by every process a test starts)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def make_per_rank(out: Path, kind: str, ranks: int, *extra: str) -> Path:
    """``ranks`` rank files of ``kind`` (``dtensor``, ``sharded``) of the tiny shape of
    ``benchmarks/make_dcp_scale.py`` in ``out`` (``--data``: real tensors)."""
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "make_dcp_scale.py"), "--shape", "tiny"]
        + ["--per-rank", kind, "--ranks", str(ranks), "--out", str(out), *extra],
        check=True,
        capture_output=True,
    )
    return out


def run_cli(
    *args: Any, timeout: float = 300, columns: int = 80, fresh: bool = False, **kwargs: Any
) -> subprocess.CompletedProcess:
    """Run ``ckpttool ARGS``, capturing text stdout/stderr and the exit code.

    In this interpreter, through the real entry point (``ckpttool.cli.main``), unless
    ``fresh`` asks for ``python -m ckpttool`` in a subprocess: where the point is a
    process of its own (what it imports, its memory, signals, ``preexec_fn`` limits,
    remote sources made from the environment).
    80 columns, as rich assumes without a terminal: an error message that wraps fails
    the one-line checks. Tests that read whole table rows ask for more. ``kwargs`` go
    to :func:`subprocess.run` (``cwd``, ``preexec_fn``); in process, only ``cwd``.
    """
    argv = [str(a) for a in args]
    # a URL: the sources and their caches, counters and settings (read from the
    # environment when first made) live as long as the process
    fresh = fresh or any("://" in a for a in argv)
    if fresh or set(kwargs) - {"cwd"}:
        env = subprocess_env(COLUMNS=str(columns))
        env.pop("CKPTTOOL_DEBUG", None)
        return subprocess.run(
            [sys.executable, "-m", "ckpttool", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            **kwargs,
        )
    code, out, err = _run_in_process(argv, columns, kwargs.get("cwd"))
    return subprocess.CompletedProcess(["ckpttool", *argv], code, out, err)


def _run_in_process(argv: list[str], columns: int, cwd: Any) -> tuple[int, str, str]:
    """``ckpttool.cli.main(argv)`` with its own stdout, stderr, terminal width and
    working folder, as a fresh process would have them."""
    import io

    from ckpttool.cli import main

    saved_env = {k: os.environ.get(k) for k in ("COLUMNS", "CKPTTOOL_DEBUG")}
    os.environ["COLUMNS"] = str(columns)
    os.environ.pop("CKPTTOOL_DEBUG", None)
    here = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.chdir(here)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code, out.getvalue(), err.getvalue()


def check_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Assert the contract's error shape: exit ``code``, ONE stderr line starting with
    ``ckpttool: ``, no traceback, nothing on stdout.

    Returns the stderr line; every ``needle`` must occur in it.
    """
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckpttool: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert proc.stdout == "", proc.stdout[-2000:]
    return lines[0]


def completed(argv: list[Any], run: dict) -> subprocess.CompletedProcess:
    """One :func:`run_many` result as the process :func:`run_cli` returns (for
    :func:`check_error`)."""
    return subprocess.CompletedProcess(argv, run["code"], run["stdout"], run["stderr"])


def run_many(
    argvs: list[list[Any]], columns: int = 200, env: dict[str, str] | None = None
) -> list[dict]:
    """Run several CLI commands, in order, in one fresh interpreter (``children.py
    cli-batch``: one torch import for all): a list of ``{"code", "stdout", "stderr"}``."""
    items = [[str(a) for a in argv] for argv in argvs]
    proc = run_child("cli-batch", items=items, env={**(env or {}), "COLUMNS": str(columns)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def run_child(
    name: str,
    *args: Any,
    items: Any = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = 600,
) -> subprocess.CompletedProcess:
    """Run the child program ``name`` of ``children.py`` in a fresh interpreter, with
    ``items`` as JSON on its stdin; text stdout/stderr captured (``timeout`` is a hang
    guard, no timing)."""
    return subprocess.run(
        [sys.executable, str(Path(__file__).with_name("children.py")), name, *map(str, args)],
        input=None if items is None else json.dumps(items),
        capture_output=True,
        text=True,
        env=subprocess_env(**(env or {})),
        cwd=cwd,
        timeout=timeout,
    )


def _descendants(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return children + [d for c in children for d in _descendants(c)]


def start_torchrun(
    script: Path,
    *args: Any,
    nproc: int,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """Start ``torchrun --standalone --nproc_per_node=NPROC SCRIPT ARGS`` on CPU; wait for
    it with :func:`finish`. Several may run at once (each picks its own port)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        str(script),
        *map(str, args),
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(**(env or {})),
        cwd=cwd,
    )


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``proc``; past ``timeout`` kill it AND its workers, then fail the test.

    torchrun's workers run in sessions of their own; left alive they would hang in a
    collective forever and hold our pipes open.
    """
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"timed out after {timeout}s: {' '.join(proc.args)}\n{stdout[-3000:]}\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# --------------------------------------------------------------------------- files


def sha256(path: Path) -> str:
    """Hash of a file, or of every file under a folder (names included)."""
    path = Path(path)
    h = hashlib.sha256()

    def add(file: Path) -> None:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):  # inputs of hundreds of MB: not all at once
                h.update(chunk)

    if path.is_dir():
        for p in sorted(path.rglob("*")):
            h.update(str(p.relative_to(path)).encode())
            if p.is_file():
                add(p)
    elif path.exists():
        add(path)
    return h.hexdigest()


def tree_files(folder: Path) -> list[str]:
    """Every entry under ``folder`` (hidden ones included), relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, in file order (read by hand, not by the library)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def rewrite_zip(src: Path, dst: Path, edit) -> None:
    """Copy the zip ``src`` to ``dst`` with ``edit(name, data) -> bytes | None`` applied to
    every entry (None keeps the entry as it is). Entries stay uncompressed, as torch writes."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            new = edit(info.filename, data)
            zout.writestr(info.filename, data if new is None else new)


def fixture_path(name: str) -> Path:
    """A committed fixture; skip the test when it has not landed yet."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"fixture fixtures/{name} is not committed yet")
    return path


# ------------------------------------------------------------------------ equality


def _bits(t: Any) -> Any:
    import torch

    # a fresh copy with standard strides (.contiguous() keeps odd strides of size-0/1 dims;
    # the copy also resolves conj/neg bits), seen as bytes: NaNs compare by their bits and
    # dtypes without an equal kernel on CPU (float8, uint16) compare at all
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1)
    return flat.view(torch.uint8)


def same_bits(got: Any, want: Any) -> bool:
    """Two dense tensors of the same dtype and shape with the same bytes."""
    import torch

    return (
        got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got), _bits(want))
    )


def assert_identical(
    got: Any, want: Any, *, ordered: bool = True, exact_types: bool = True, path: tuple = ()
) -> int:
    """Assert ``got`` is ``want``, bitwise: the same container types, the same keys in the
    same order, equal plain values, every tensor of the same type, on the same kind of
    device, with the same dtype, shape, layout and bytes.

    Args:
        ordered: False compares dict keys as a set (DCP stores keys in its own order).
        exact_types: False accepts any mapping for a dict (torch.load gives a saved
            ``state_dict()`` back as an ``OrderedDict``) and a list for a tuple.

    Returns:
        How many tensors were compared.
    """
    import torch

    def same_type(kind: type | tuple[type, ...]) -> None:
        if exact_types:
            assert type(got) is type(want), (path, type(got), type(want))
        else:
            assert isinstance(got, kind), (path, type(got), type(want))

    if isinstance(want, torch.Tensor):
        same_type(torch.Tensor)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), (path, got, want)
        assert got.device.type == want.device.type, (path, got.device, want.device)
        assert got.layout == want.layout, (path, got.layout, want.layout)
        if want.layout == torch.strided and not want.is_quantized:
            assert same_bits(got, want), f"tensor differs at {path}"
        else:
            assert torch.equal(got, want), f"tensor differs at {path}"
        return 1
    kw = {"ordered": ordered, "exact_types": exact_types}
    if isinstance(want, dict):
        same_type(dict)
        if ordered:
            assert list(got) == list(want), (path, list(got), list(want))
        else:
            assert set(got) == set(want), (path, set(got) ^ set(want))
        return sum(assert_identical(got[k], want[k], path=(*path, k), **kw) for k in want)
    if isinstance(want, (list, tuple)):
        same_type((list, tuple))
        assert len(got) == len(want), (path, len(got), len(want))
        pairs = enumerate(zip(got, want, strict=True))
        return sum(assert_identical(g, w, path=(*path, i), **kw) for i, (g, w) in pairs)
    assert got == want, (path, got, want)
    return 0


# ------------------------------------------------------------- small checkpoints


def small_state_dict(seed: int = 0) -> dict:
    """A deterministic model state dict with a submodule, a bias and an int buffer."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "fc.weight": torch.randn(4, 3, generator=g),
        "fc.bias": torch.randn(4, generator=g),
        "head.weight": torch.randn(2, 4, generator=g),
        "bn.num_batches_tracked": torch.tensor(7),
    }


def tricky_tensors() -> dict:
    """Tied weights sharing one storage, views with offsets and strides, several dtypes."""
    import torch

    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 4, generator=g)
    ints = torch.arange(20, dtype=torch.int64)
    return {
        "embed.weight": w,
        "lm_head.weight": w,  # tied: the same tensor twice
        "cols": w[:, 1:3],  # non-contiguous, storage offset 1
        "transposed": w.t(),
        "every_other_row": w[::2],
        "ints_view": ints[5:9],
        "half": torch.randn(3, generator=g).half(),
        "bf16": torch.randn(2, 2, generator=g).bfloat16(),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),  # an UntypedStorage
        "u16": torch.tensor([1, 60000], dtype=torch.int32).to(torch.uint16),
    }


def write_hf_shards(folder, sd, shard_format="safetensors"):
    """A Hugging Face style sharded checkpoint of ``sd`` in two shards; returns the index.

    ``safetensors``: ``model-0000k-of-00002.safetensors`` + ``model.safetensors.index.json``;
    ``zip`` / ``legacy``: ``pytorch_model-0000k-of-00002.bin`` (torch.save) +
    ``pytorch_model.bin.index.json``, as transformers 4 wrote them.
    """
    import torch
    from safetensors.torch import save_file

    names = list(sd)
    stem, suffix = (
        ("model", "safetensors") if shard_format == "safetensors" else ("pytorch_model", "bin")
    )
    parts = [{k: sd[k] for k in names[:2]}, {k: sd[k] for k in names[2:]}]
    folder.mkdir(exist_ok=True)
    weight_map = {}
    for i, part in enumerate(parts, 1):
        file = f"{stem}-{i:05d}-of-00002.{suffix}"
        if shard_format == "safetensors":
            save_file(part, folder / file, metadata={"format": "pt"})
        else:
            torch.save(part, folder / file, _use_new_zipfile_serialization=shard_format == "zip")
        weight_map.update({k: file for k in part})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = folder / f"{stem}.{suffix}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index


def shard_source() -> dict:
    """float32 tensors of 120, 40, 40, 20, 1200, 4, 600 and 400 bytes."""
    import torch

    g = torch.Generator().manual_seed(1)
    sizes = {"a": 30, "b": 10, "c": 10, "d": 5, "e": 300, "f": 1, "g": 150, "h": 100}
    return {k: torch.randn(n, generator=g) for k, n in sizes.items()}


def write_dcp(folder: Path, state: dict) -> None:
    """A single-process ``torch.distributed.checkpoint`` save (no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))


def autograd_view(node: Any) -> tuple[dict, dict]:
    """Each tensor's (type name, requires_grad, dtype), and its values as a dense plain
    tensor, by dotted key path: a nested structure and its flattened conversion compare
    alike."""
    import torch

    flags, tensors = {}, {}

    def visit(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            flags[path] = (type(value).__name__, value.requires_grad, value.dtype)
            # values to compare with torch.equal, whatever the layout
            if value.is_quantized:
                value = value.int_repr()
            tensors[path] = value.detach().to_dense()
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{path}.{k}" if path else str(k))

    visit(node, "")
    return flags, tensors


def parameter_snapshot() -> dict:
    """Parameters (trainable, frozen, integer, sparse, quantized) and tensors with requires_grad."""
    import torch

    linear = torch.nn.Linear(3, 2)
    return {
        "params": dict(linear.named_parameters()),  # Parameters, requires_grad
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "int_param": torch.nn.Parameter(torch.arange(3), requires_grad=False),
        "grad": torch.zeros(3, requires_grad=True),  # a leaf tensor that requires grad
        "plain": torch.arange(4.0),
        "sparse_param": torch.nn.Parameter(torch.eye(3).to_sparse()),
        "quantized_param": torch.nn.Parameter(
            torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), requires_grad=False
        ),
    }


# --------------------------------------------------------------------- byte sources


class CountingSource(sources.Source):
    """Local files behind the URL scheme ``counting://`` (``counting:///abs/path``) with
    no local path: every byte a reader wants goes through :meth:`read_into`, counted.

    A stand-in for a remote source that proves two things: no reader opens a file
    behind the byte-source interface's back (it would fail on the URL), and what a
    command reads (``bytes_read``, ``requests``; ``reads``: ``(path, offset, size)``).
    """

    name = "counting"
    PREFIX = "counting://"

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, int, int]] = []

    def local(self, path: str) -> str:
        assert path.startswith(self.PREFIX), path
        return path[len(self.PREFIX) :] or "/"

    def size(self, path: str) -> int:
        return sources.LOCAL.size(self.local(path))

    def read_into(self, path: str, view: memoryview, offset: int) -> None:
        self.count(len(view))
        self.reads.append((path, offset, len(view)))
        with open(self.local(path), "rb", buffering=0) as f:
            sources.read_fd_into(f.fileno(), view, offset, path)

    def listdir(self, path: str) -> list[str]:
        return sources.LOCAL.listdir(self.local(path))

    def isdir(self, path: str) -> bool:
        return sources.LOCAL.isdir(self.local(path))

    def exists(self, path: str) -> bool:
        return sources.LOCAL.exists(self.local(path))

    def identity(self, path: str) -> Any:
        return sources.LOCAL.identity(self.local(path))

    def reset(self) -> None:
        self.bytes_read = self.requests = 0
        self.reads.clear()


def counting_url(path: Path | str) -> str:
    """``counting:///abs/path`` for a local path (see :class:`CountingSource`)."""
    return CountingSource.PREFIX + str(Path(path).resolve())
