"""Shared test helpers: real checkpoints built with torch in temp dirs, a CLI runner,
and malicious pickles.

Everything is generated in ``tmp_path`` / ``tmp_path_factory`` from real
``torch.save`` / ``torch.jit.save`` / safetensors / torchrun + gloo runs; the
expensive inputs (the torchrun runs) are session-scoped and shared.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"


# --------------------------------------------------------------------------- CLI


def run_cli(
    *args: Any, cwd: Any = None, timeout: float = 300, columns: int = 80
) -> subprocess.CompletedProcess:
    """Run ``python -m ckpttool ARGS`` in a subprocess, capturing text stdout/stderr.

    80 columns, as rich assumes without a terminal: an error message that wraps fails the
    one-line checks. Tests that read whole table rows ask for more.
    """
    env = dict(os.environ)
    env["COLUMNS"] = str(columns)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CKPTTOOL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "ckpttool", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def check_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Assert the contract's error shape: exit ``code``, ONE stderr line, no traceback.

    Returns the stderr line; every ``needle`` must occur in it.
    """
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def cli():
    return run_cli


# ------------------------------------------------------------------ small files


def sha256(path: Path) -> str:
    """Hash of a file, or of every file under a folder (names included)."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            h.update(str(p.relative_to(path)).encode())
            if p.is_file():
                h.update(p.read_bytes())
    elif path.exists():
        h.update(path.read_bytes())
    return h.hexdigest()


def rewrite_zip(src: Path, dst: Path, edit) -> None:
    """Copy the zip ``src`` to ``dst`` with ``edit(name, data) -> bytes | None`` applied to
    every entry (None keeps the entry as it is). Entries stay uncompressed, as torch writes."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            new = edit(info.filename, data)
            zout.writestr(info.filename, data if new is None else new)


def assert_nested_equal(actual: Any, expected: Any, path: tuple = ()) -> None:
    """The same nested structure, tensors bitwise equal (dict key order is not compared:
    DCP stores keys in its own order)."""
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), (path, set(actual) ^ set(expected))
        for k in expected:
            assert_nested_equal(actual[k], expected[k], path + (k,))
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_nested_equal(a, e, path + (i,))
    else:
        assert actual == expected, path


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


# ------------------------------------------------------------ malicious pickles


class Reduce:
    """An object that pickles as ``func(*args)``; ``func`` may itself be a Reduce."""

    def __init__(self, func: Any, args: tuple = ()):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)

    def __call__(self, *args: Any) -> None:  # pickle insists the reduce callable be callable
        raise AssertionError("never called while pickling")


@dataclass
class Payload:
    """A malicious object, the globals a reader must name, and how to tell that it fired."""

    name: str
    obj: Any
    expected: tuple[str, ...]  # each must be named in the error message / .dangerous
    fired: Any  # callable () -> bool: True when the payload's side effect happened
    reset: Any  # callable () -> None: undo the side effect
    live: bool = True  # whether test_safety proves it fires under a real torch.load


def make_payloads(work: Path) -> dict[str, Payload]:
    """Every payload writes (or deletes) something under ``work`` when really unpickled."""
    import builtins
    import http.server
    import importlib
    import operator
    import pickle
    import pydoc
    import runpy
    import shutil
    import socket
    import subprocess as sp

    import torch

    work.mkdir(parents=True, exist_ok=True)

    out: dict[str, Payload] = {}

    def add(name, build, expected, live=True):
        marker = work / f"marker-{name}"
        reset = lambda: marker.unlink(missing_ok=True)  # noqa: E731
        out[name] = Payload(name, build(str(marker)), expected, marker.exists, reset, live)

    touch_code = "open({!r}, 'w').close()"
    add("os_system", lambda m: Reduce(os.system, (f"touch {m}",)), ("posix.system",))
    add("popen", lambda m: Reduce(sp.Popen, (["touch", m],)), ("subprocess.Popen",))
    add("eval", lambda m: Reduce(builtins.eval, (touch_code.format(m),)), ("builtins.eval",))
    add("exec", lambda m: Reduce(builtins.exec, (touch_code.format(m),)), ("builtins.exec",))
    add(
        "getattr_builtins_eval",  # getattr(__import__("builtins"), "eval")(code)
        lambda m: Reduce(
            Reduce(getattr, (Reduce(builtins.__import__, ("builtins",)), "eval")),
            (touch_code.format(m),),
        ),
        ("builtins.getattr", "builtins.__import__"),
    )
    add(
        "getattr_os_system",  # getattr(importlib.import_module("os"), "system")(cmd)
        lambda m: Reduce(
            Reduce(getattr, (Reduce(importlib.import_module, ("os",)), "system")),
            (f"touch {m}",),
        ),
        ("builtins.getattr", "importlib.import_module"),
    )
    add(
        "attrgetter",  # operator.attrgetter("system")(import_module("os"))(cmd)
        lambda m: Reduce(
            Reduce(operator.attrgetter("system"), (Reduce(importlib.import_module, ("os",)),)),
            (f"touch {m}",),
        ),
        ("operator.attrgetter", "importlib.import_module"),
    )
    add(
        "nested_pickle_loads",
        lambda m: Reduce(pickle.loads, (pickle.dumps(Reduce(os.system, (f"touch {m}",))),)),
        ("pickle.loads",),
    )

    def torch_load(m):
        inner = work / "inner-payload.pt"
        torch.save({"x": Reduce(os.system, (f"touch {m}",))}, inner)
        # torch.load(f, None, pickle) loads with weights_only=False (a pickle_module is given)
        return Reduce(torch.load, (str(inner), None, Reduce(importlib.import_module, ("pickle",))))

    add("torch_load", torch_load, ("torch.serialization.load",))

    def run_path(m):
        script = work / "payload_script.py"
        script.write_text(f"open({m!r}, 'w').close()\n")
        return Reduce(runpy.run_path, (str(script),))

    add("runpy", run_path, ("runpy.run_path",))

    victim = work / "victim"

    def make_victim():
        victim.mkdir(exist_ok=True)
        (victim / "keep.txt").write_text("precious")

    make_victim()
    out["shutil_rmtree"] = Payload(
        "shutil_rmtree",
        Reduce(shutil.rmtree, (str(victim),)),
        ("shutil.rmtree",),
        lambda: not (victim / "keep.txt").exists(),
        make_victim,
    )
    # socket.socket(AF_UNIX).bind(path) creates a socket file at path
    add(
        "socket",
        lambda m: Reduce(Reduce(getattr, (Reduce(socket.socket, (socket.AF_UNIX,)), "bind")), (m,)),
        ("socket.socket",),
    )
    # pydoc.pipepager(text, cmd) runs cmd in a shell
    add("pydoc_pipepager", lambda m: Reduce(pydoc.pipepager, ("", f"touch {m}")), ("pipepager",))
    # torch.save pickles with protocol 2, which writes Python 2 module names: http.server
    # becomes SimpleHTTPServer/CGIHTTPServer, and the real unpickler maps them back.
    # http.server.test() would serve the current folder to the network (never run here).
    add(
        "py2_alias_http_server",
        lambda m: Reduce(http.server.test, ()),
        ("http.server.test",),
        live=False,
    )
    return out


# ---------------------------------------------------------- torchrun + gloo runs

DIST_WORKER = textwrap.dedent(
    '''
    """Writes real FSDP1 / DCP / DTensor checkpoints on CPU + gloo, plus the full reference."""
    import os
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.fsdp import FullStateDictConfig, ShardedOptimStateDictConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if world == 2:  # first dims 5 and 3: uneven shards over 2 ranks
        model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    else:  # a 2-row weight and a 2-element bias over 3 ranks: rank 2 holds nothing
        model = nn.Sequential(nn.Linear(4, 2))
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.Adam(fsdp.parameters(), lr=0.1)
    torch.manual_seed(1)
    fsdp(torch.randn(8, 4)).sum().backward()
    opt.step()
    with FSDP.state_dict_type(
        fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)
    ):
        full = {k: v.clone() for k, v in fsdp.state_dict().items()}
    with FSDP.state_dict_type(
        fsdp,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(),
        ShardedOptimStateDictConfig(),
    ):
        sd = fsdp.state_dict()
        osd = FSDP.optim_state_dict(fsdp, opt)


    def gather(node):
        """Independent reference: every rank's local shards, assembled by hand."""
        if isinstance(node, dict):
            return {k: gather(v) for k, v in node.items()}
        if isinstance(node, list):
            return [gather(v) for v in node]
        if isinstance(node, ShardedTensor):
            mine = [(s.metadata.shard_offsets, s.tensor.clone()) for s in node.local_shards()]
            every = [None] * world
            dist.all_gather_object(every, mine)
            t = torch.empty(node.size(), dtype=node.dtype)
            for blocks in every:
                for offsets, block in blocks:
                    t[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))] = block
            return t
        return node


    reference = {"model": full, "optim": gather(osd)}
    if rank == 0:
        torch.save(reference, os.path.join(out, "full.pt"))
    snapshot = {
        "state": {
            "model": sd,
            "optimizers": {"Adam": osd},
            "schedulers": {},
            "timestamp": {"epoch": 0, "batch": 1},
        },
        "rng": [{"torch": torch.get_rng_state()}],
    }
    torch.save(snapshot, os.path.join(out, f"ep0-ba1-rank{rank}.pt"))
    if world == 3:  # each rank's own piece of each parameter, as a plain tensor
        with FSDP.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
            torch.save({"model": fsdp.state_dict()}, os.path.join(out, f"local-rank{rank}.pt"))
    if world == 2:
        dcp.save({"model": sd, "optim": osd, "step": 7}, checkpoint_id=os.path.join(out, "dcp"))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(2)
        w, b = torch.randn(5, 3), torch.randn(3)
        if rank == 0:
            torch.save({"w": w, "b": b}, os.path.join(out, "dtensor_full.pt"))
        local = {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "b": distribute_tensor(b, mesh, [Replicate()]),
        }
        torch.save(local, os.path.join(out, f"dtensor-rank{rank}.pt"))

        class Holder:  # a custom object (an EMA, a wrapper) whose attributes are sharded
            def __init__(self, weights):
                self.weights = weights
                self.decay = 0.99

        torch.save({"ema": Holder(local), "step": 3}, os.path.join(out, f"holder-rank{rank}.pt"))
    dist.barrier()
    # Every file is written: say so before teardown, where gloo sometimes aborts under load.
    open(os.path.join(out, f"done-rank{rank}"), "w").close()
    dist.destroy_process_group()
    '''
)


MESH_WORKER = textwrap.dedent(
    '''
    """4 ranks on a 2-D (dp=2, tp=2) CPU mesh: DTensors on the mesh and on its dp submesh,
    saved per rank with torch.save, with dcp.save, with dcp.save in the safetensors
    serialization format, and with HuggingFaceStorageWriter(save_distributed=True) in one
    and in two files per rank; on a (1, 2, 2) mesh per rank; FSDP2 over tensor parallel
    per rank; a DTensor in a tuple with dcp.save; plus the full tensors (the reference)."""
    import os
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = {
        "lin.weight": torch.randn(5, 6),  # rows over dp (3 + 2), columns over tp
        "lin.bias": torch.randn(5),  # rows over dp, replicated over tp
        "emb.weight": torch.randn(7, 3).to(torch.bfloat16),  # on the dp submesh only
        "step": torch.tensor(3),  # replicated everywhere
    }
    placements = {
        "lin.weight": (mesh, [Shard(0), Shard(1)]),
        "lin.bias": (mesh, [Shard(0), Replicate()]),
        "emb.weight": (mesh["dp"], [Shard(0)]),
        "step": (mesh, [Replicate(), Replicate()]),
    }
    model = {k: distribute_tensor(v, *placements[k]) for k, v in full.items()}
    if rank == 0:
        torch.save({"model": full, "epoch": 2}, os.path.join(out, "full.pt"))
    torch.save({"model": model, "epoch": 2}, os.path.join(out, f"model-rank{rank}.pt"))
    dcp.save({"model": model, "epoch": 2}, checkpoint_id=os.path.join(out, "dcp"))
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    writer = dcp.FileSystemWriter(
        os.path.join(out, "dcp-safetensors"),
        serialization_format=SerializationFormat.SAFETENSORS,
    )
    dcp.save({"model": model, "epoch": 2, "name": "run"}, storage_writer=writer)
    for name, files in (("hf-dist", None), ("hf-dist2", {"lin.weight": 1, "lin.bias": 1})):
        files = files and {**files, "emb.weight": 2, "step": 2}
        writer = dcp.HuggingFaceStorageWriter(
            os.path.join(out, name), save_distributed=True, fqn_to_index_mapping=files
        )
        dcp.save(model, storage_writer=writer)
    # HSDP with one replica: a size-1 mesh dimension, which the mesh layout records as
    # an empty shape (torch >= 2.9)
    hsdp = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    torch.save(
        {"lin.weight": distribute_tensor(full["lin.weight"], hsdp,
                                         [Replicate(), Shard(0), Shard(1)]),
         "lin.bias": distribute_tensor(full["lin.bias"], hsdp,
                                       [Replicate(), Shard(0), Replicate()])},
        os.path.join(out, f"hsdp-rank{rank}.pt"),
    )  # fmt: skip
    # FSDP2 over tensor parallel: a column-parallel weight is _StridedShard(0) on dp,
    # Shard(0) on tp (7 rows: 4 + 3 over tp, then 2 + 2 and 2 + 1 over dp)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 6),
                              torch.nn.Linear(6, 7))  # fmt: skip
    if rank == 0:
        torch.save(mlp.state_dict(), os.path.join(out, "tp-fsdp-full.pt"))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel()}
    parallelize_module(mlp, mesh["tp"], plan)
    fully_shard(mlp, mesh=mesh["dp"])
    torch.save(mlp.state_dict(), os.path.join(out, f"tp-fsdp-rank{rank}.pt"))
    # a tuple is not flattened by DCP: rank 0 pickles it whole, its DTensor's block only
    dcp.save({"pair": (model["lin.weight"], 1), "step": 1},
             checkpoint_id=os.path.join(out, "dcp-tuple"))  # fmt: skip
    dist.barrier()
    open(os.path.join(out, f"done-rank{rank}"), "w").close()
    dist.destroy_process_group()
    '''
)


@dataclass
class DistRuns:
    """Outputs of the torchrun runs (2 ranks, 3 ranks, 4 ranks on a 2-D mesh)."""

    two: Path  # ep0-ba1-rank{0,1}.pt, dcp/, dtensor-/holder-rank{0,1}.pt, full.pt,
    # dtensor_full.pt
    three: Path  # ep0-ba1-rank{0,1,2}.pt, local-rank{0,1,2}.pt (LOCAL_STATE_DICT), full.pt
    mesh: Path  # model-/hsdp-/tp-fsdp-rank{0..3}.pt, dcp/, dcp-safetensors/, dcp-tuple/,
    # hf-dist/, hf-dist2/, full.pt, tp-fsdp-full.pt


def _torchrun(worker: Path, out: Path, world: int) -> subprocess.Popen:
    out.mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(worker),
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=out
    )


def _complete(out: Path, world: int) -> bool:
    return all((out / f"done-rank{r}").exists() for r in range(world))


@pytest.fixture(scope="session")
def dist_runs(tmp_path_factory) -> DistRuns:
    """Run the torchrun jobs at once (about 15 s together) and share their files.

    A run whose ranks all finished writing counts even if teardown crashed; an
    incomplete run is retried once.
    """
    base = tmp_path_factory.mktemp("dist")
    (base / "worker.py").write_text(DIST_WORKER)
    (base / "mesh_worker.py").write_text(MESH_WORKER)
    runs = {"two": (2, "worker.py"), "three": (3, "worker.py"), "mesh": (4, "mesh_worker.py")}
    procs = {
        name: _torchrun(base / script, base / name, world) for name, (world, script) in runs.items()
    }
    for name, proc in procs.items():
        world, script = runs[name]
        output, _ = proc.communicate(timeout=300)
        if not _complete(base / name, world):
            shutil.rmtree(base / name)
            retry = _torchrun(base / script, base / name, world)
            output, _ = retry.communicate(timeout=300)
            if not _complete(base / name, world):
                pytest.fail(f"torchrun ({name}) failed twice:\n{output[-4000:]}")
    return DistRuns(base / "two", base / "three", base / "mesh")


@pytest.fixture(scope="session")
def dist_reference(dist_runs):
    """The full (unsharded) model and optimizer state of both runs, loaded with torch."""
    import torch

    return {
        "two": torch.load(dist_runs.two / "full.pt", weights_only=True),
        "three": torch.load(dist_runs.three / "full.pt", weights_only=True),
        "dtensor": torch.load(dist_runs.two / "dtensor_full.pt", weights_only=True),
    }


def fixture_path(name: str) -> Path:
    """A committed fixture; skip the test when it has not landed yet."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"fixture fixtures/{name} is not committed yet")
    return path


# ------------------------------------------- malicious checkpoints, three ways

MALICIOUS_KINDS = ("torch-zip", "torch-legacy", "dcp")


def _weight():
    import torch

    return torch.arange(12, dtype=torch.float32).reshape(3, 4)


class _Storage:
    """Pickled as torch's persistent id for storage ``key`` (FloatStorage, cpu)."""

    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


def torch_pickle_bytes(obj: Any) -> bytes:
    """Pickle ``obj`` the way torch.save writes data.pkl (protocol 2, storages as ids)."""
    import io
    import pickle

    import torch

    class TorchPickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _Storage):
                return ("storage", torch.FloatStorage, o.key, "cpu", o.numel)
            return None

    buf = io.BytesIO()
    TorchPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def lazy_tensor(key: str, shape: tuple, numel: int) -> Reduce:
    """A pickled ``torch._utils._rebuild_tensor_v2`` call on storage ``key`` (contiguous)."""
    import collections

    import torch

    stride, acc = [], 1
    for n in reversed(shape):
        stride.insert(0, acc)
        acc *= n
    return Reduce(
        torch._utils._rebuild_tensor_v2,
        (_Storage(key, numel), 0, tuple(shape), tuple(stride), False, collections.OrderedDict()),
    )


def write_malicious_zip(path: Path, evil: Any) -> None:
    """A real torch.save zip whose ``*/data.pkl`` is replaced by one holding ``evil``."""
    import torch

    base = path.with_name(path.name + ".base")
    w = _weight()
    torch.save({"w": w}, base)
    data = torch_pickle_bytes({"w": lazy_tensor("0", tuple(w.shape), w.numel()), "x": evil})
    rewrite_zip(base, path, lambda name, old: data if name.endswith("/data.pkl") else None)
    base.unlink()


def write_malicious_legacy(path: Path, evil: Any) -> None:
    """A legacy (pre-1.6) torch.save stream whose main pickle holds ``evil``."""
    import torch

    torch.save({"w": _weight(), "x": evil}, path, _use_new_zipfile_serialization=False)


def write_dcp(folder: Path, state: dict) -> None:
    """A single-process ``torch.distributed.checkpoint`` save (no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))


def write_malicious_dcp(folder: Path, evil: Any) -> None:
    """A real DCP folder whose ``.metadata`` pickle also holds ``evil`` (in planner_data)."""
    import pickle

    import torch.distributed.checkpoint as dcp

    write_dcp(folder, {"model": {"w": _weight()}, "step": 3})
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    metadata.planner_data = dict(metadata.planner_data or {}, __evil__=evil)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


WRITERS = {
    "torch-zip": write_malicious_zip,
    "torch-legacy": write_malicious_legacy,
    "dcp": write_malicious_dcp,
}


@dataclass
class MaliciousFile:
    kind: str
    path: Path
    payload: Payload


@pytest.fixture(scope="session")
def malicious(tmp_path_factory) -> dict[tuple[str, str], MaliciousFile]:
    """Every payload embedded every way: ``{(kind, payload name): MaliciousFile}``."""
    base = tmp_path_factory.mktemp("malicious")
    out = {}
    for kind in MALICIOUS_KINDS:
        folder = base / kind
        folder.mkdir()
        for name, payload in make_payloads(base / f"work-{kind}").items():
            path = folder / (name if kind == "dcp" else f"{name}.pt")
            WRITERS[kind](path, payload.obj)
            out[(kind, name)] = MaliciousFile(kind, path, payload)
    return out


# The FSDP runs of helpers_dist (2 and 3 ranks, run once per session), for any test module.
@pytest.fixture(scope="session")
def fsdp2(tmp_path_factory) -> Path:
    from helpers_dist import fsdp_checkpoints

    return fsdp_checkpoints(tmp_path_factory, 2)


@pytest.fixture(scope="session")
def fsdp3(tmp_path_factory) -> Path:
    from helpers_dist import fsdp_checkpoints

    return fsdp_checkpoints(tmp_path_factory, 3)


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
