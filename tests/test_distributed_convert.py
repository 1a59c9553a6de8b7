"""``convert`` / ``merge`` under torchrun and ``--workers``: byte identity with one
process at any world size, resume after a killed rank, a stopped rank, inputs changed
between runs, two "nodes" on 127.0.0.1. Units are made tiny (``CKPTTOOL_UNIT_BYTES``) so
that KB-sized fixtures make dozens of units, tensors split across them.

The default suite runs a few launches side by side; ``CKPTTOOL_DIST_TRIALS=1`` (marker
``trials``, run by ``.ci/run``) adds every world size (1, 2, 3, 4, 7) and more seeds.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
from helpers import FIXTURES, finish, make_per_rank, run_many, sha256, subprocess_env
from helpers import _descendants as descendants

from ckpttool.convert import convert
from ckpttool.merge import merge
from ckpttool.targets import journal as journal_mod
from ckpttool.targets.units import crc32_combine, piece_crcs, plan_units, write_unit
from ckpttool.writers.output_file import OutputFile
from ckpttool.writers.plan import Written, allocate, complete, file_path

# most tests here launch torchrun: run after the quick suite (see .ci/run)
pytestmark = pytest.mark.slow

TRIALS = bool(os.environ.get("CKPTTOOL_DIST_TRIALS"))


def trials(test):
    """The larger trial set: marker ``trials``, skipped unless CKPTTOOL_DIST_TRIALS=1."""
    skip = pytest.mark.skipif(not TRIALS, reason="CKPTTOOL_DIST_TRIALS=1 runs the trial set")
    return pytest.mark.trials(skip(test))


# input name -> the paths given to ckpttool
INPUTS = {
    "per-rank": [str(FIXTURES / "fsdp_uneven" / f"model-rank{r}.pt") for r in range(3)],
    "dtensor": [str(FIXTURES / "dtensor" / f"dt-rank{r}.pt") for r in range(2)],
    "ddp": [str(FIXTURES / "ddp" / "ep0-rank0.pt")],
    "dcp": [str(FIXTURES / "dcp")],
    "deepspeed": [str(FIXTURES / "deepspeed" / "zero2")],
    "st-sharded": [str(FIXTURES / "safetensors_sharded")],
}
# output kind -> (command, its options, output name)
OUTPUTS = {
    "safetensors": ("convert", ["--to", "safetensors"], "out.safetensors"),
    "hf-shards": ("convert", ["--to", "safetensors", "--max-shard-size", "200"], "hf"),
    "pt": ("convert", ["--to", "pt"], "out.pt"),
    "dcp": ("convert", ["--to", "dcp"], "out-dcp"),
    "bf16": ("convert", ["--to", "safetensors", "--dtype", "bfloat16"], "bf16.safetensors"),
    "merge": ("merge", [], "merged.pt"),
}


def torchrun(
    args: list[str],
    nproc: int,
    *,
    unit: int | None = 64,
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
) -> subprocess.Popen:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N -m ckpttool ARGS``."""
    extra = dict(env or {})
    if unit is not None:
        extra["CKPTTOOL_UNIT_BYTES"] = str(unit)
    extra.setdefault("CKPTTOOL_DIST_TIMEOUT", "10")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(launcher or ["--standalone"]),
        f"--nproc-per-node={nproc}",
        "--monitor-interval=0.1",
        "-m",
        "ckpttool",
        *args,
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(**extra),
        start_new_session=True,
    )


def ours(stderr: str) -> list[str]:
    """ckpttool's own lines of a torchrun's stderr (torchrun's banner and logs left out)."""
    return [ln for ln in stderr.splitlines() if ln.startswith(("ckpttool:", "wrote "))]


def reference(tmp_path: Path, inputs: list[str], output: str) -> Path:
    """The single-process output, written in this process."""
    command, options, name = OUTPUTS[output]
    out = tmp_path / "one" / name
    out.parent.mkdir(exist_ok=True)
    if command == "merge":
        merge(inputs, str(out))
    else:
        given = dict(zip(options[::2], options[1::2], strict=True))
        convert(
            inputs,
            given["--to"],
            str(out),
            max_shard_size=given.get("--max-shard-size"),
            dtype=given.get("--dtype"),
        )
    return out


def start(
    tmp_path: Path, inputs: str, output: str, nproc: int, **kw
) -> tuple[subprocess.Popen, Path]:
    command, options, name = OUTPUTS[output]
    out = tmp_path / f"n{nproc}" / name
    out.parent.mkdir(exist_ok=True)
    return torchrun([command, *INPUTS[inputs], *options, "-o", str(out)], nproc, **kw), out


def check_same(tmp_path: Path, cases: list[tuple[str, str, int, int | None]]) -> None:
    """Run the cases side by side; every output equals the single-process one."""
    runs = []
    for i, (inputs, output, nproc, unit) in enumerate(cases):
        base = tmp_path / f"case{i}"
        base.mkdir()
        proc, out = start(base, inputs, output, nproc, unit=unit)
        runs.append((base, inputs, output, proc, out))
    for base, inputs, output, proc, out in runs:
        done = finish(proc, 300)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = ours(done.stderr)
        assert len(lines) == 1 and lines[0].startswith("wrote "), done.stderr[-3000:]
        want = reference(base, INPUTS[inputs], output)
        assert sha256(out) == sha256(want), (inputs, output)
        assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no work left


# ---------------------------------------------------------------- byte identity


@pytest.mark.slow
def test_same_bytes_as_one_process(tmp_path):
    check_same(
        tmp_path,
        [
            ("per-rank", "safetensors", 3, 64),
            ("dcp", "hf-shards", 2, 4096),
            ("deepspeed", "pt", 4, 64),
            ("st-sharded", "dcp", 2, 64),
            ("per-rank", "merge", 3, 64),
            ("dtensor", "safetensors", 3, 64),  # (a rank with no rank file of its own)
            ("dcp", "bf16", 2, 4096),
            ("ddp", "safetensors", 3, None),  # more ranks than units: one unit
        ],
    )


@pytest.mark.slow
def test_many_dtensor_rank_files_dealt_in_rounds(tmp_path):
    """34 DTensor rank files (the tiny shape of ``make_dcp_scale.py``: ranks that hold
    nothing of the smaller tensors) among 4 ranks: each reads its share and hands the
    others where the blocks lie, 8 files a round (``per_rank.FILES_A_ROUND``), a round
    in which some ranks have none; the output is the one process's, byte for byte."""
    from ckpttool.formats.per_rank import FILES_A_ROUND

    ranks, nproc = 34, 4
    assert -(-ranks // nproc) > FILES_A_ROUND == ranks // nproc  # 9, 9, 8, 8: two rounds
    folder = make_per_rank(tmp_path / "dt", "dtensor", ranks)
    first = str(folder / "ep0-rank0.pt")
    want = tmp_path / "one.safetensors"
    convert([first], "safetensors", str(want), select="all")
    out = tmp_path / "n4.safetensors"
    done = finish(
        torchrun(
            ["convert", first, "--select", "all", "--to", "safetensors", "-o", str(out)], nproc
        ),
        300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sha256(out) == sha256(want)


@pytest.mark.slow
def test_sharded_tensor_rank_files_read_as_records_under_several_ranks(tmp_path):
    """10 ShardedTensor rank files whose metadata is read as records
    (formats/shard_opcodes.py: each names all 10 ranks' shards of 225 tensors, real
    data), dealt among 3 ranks: the output is the one process's, byte for byte."""
    folder = make_per_rank(tmp_path / "st", "sharded", 10, "--data")
    first = str(folder / "ep0-rank0.pt")
    want = tmp_path / "one.safetensors"
    convert([first], "safetensors", str(want), select="all")
    out = tmp_path / "n3.safetensors"
    args = ["convert", first, "--select", "all", "--to", "safetensors", "-o", str(out)]
    done = finish(torchrun(args, 3), 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sha256(out) == sha256(want)


@trials
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2, 3, 4, 7])
def test_same_bytes_every_world_size(tmp_path, nproc):
    cases = [
        (inputs, output, nproc, 4096 if inputs == "dcp" else 64)
        for inputs in INPUTS
        for output in OUTPUTS
        if not (output == "merge" and inputs == "st-sharded")
    ]
    for batch in range(0, len(cases), 4):
        folder = tmp_path / f"b{batch}"
        folder.mkdir()
        check_same(folder, cases[batch : batch + 4])


@pytest.mark.slow
def test_one_error_line_same_exit_code(tmp_path):
    """A missing input: every rank fails; one line in all, the exit code 2."""
    proc = torchrun(
        ["convert", str(tmp_path / "missing.pt"), "--to", "pt", "-o", str(tmp_path / "o.pt")], 3
    )
    done = finish(proc, 300)
    assert done.returncode != 0
    lines = ours(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("ckpttool: error:"), done.stderr[-3000:]
    assert re.findall(r"exitcode\s*: (\d+)", done.stderr) and set(
        re.findall(r"exitcode\s*: (\d+)", done.stderr)
    ) == {"2"}
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.slow
def test_a_dangerous_rank_file_scanned_by_another_rank_fails_every_rank(tmp_path):
    """Rank files are judged a share each (rank 0 scans model-rank1.pt, rank 1
    model-rank2.pt, the dangerous one): every rank refuses with the gathered verdict,
    one line naming the global and the file, exit 3 on every rank, nothing written."""
    from helpers import rewrite_zip

    marker = tmp_path / "marker"
    command = f"touch {marker}".encode()
    evil = b"X\x04\x00\x00\x00evilcposix\nsystem\n(X"
    evil += len(command).to_bytes(4, "little") + command + b"tRs."
    paths = []
    for rank, src in enumerate(map(Path, INPUTS["per-rank"])):
        dst = tmp_path / src.name
        if rank < 2:
            shutil.copy(src, dst)
        else:  # root["evil"] = posix.system(...) just before the pickle's STOP
            rewrite_zip(src, dst, lambda n, d: d[:-1] + evil if n.endswith("/data.pkl") else None)
        paths.append(str(dst))
    out = tmp_path / "out.safetensors"
    done = finish(torchrun(["convert", *paths, "--to", "safetensors", "-o", str(out)], 2), 300)
    lines = ours(done.stderr)
    assert len(lines) == 1 and "posix.system" in lines[0], done.stderr[-3000:]
    assert "model-rank2.pt" in lines[0]
    assert set(re.findall(r"exitcode\s*: (\d+)", done.stderr)) == {"3"}, done.stderr[-3000:]
    assert not out.exists() and not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(p).name for p in paths)


# ---------------------------------------------------------------- resume


def journal_lines(out: Path) -> tuple[int, dict[str, int]]:
    """(units journaled, {pid: rank}) from an output's resume folder."""
    folder = Path(journal_mod.resume_dir(str(out))) / journal_mod.JOURNAL
    count, pids = 0, {}
    if folder.is_dir():
        for log in folder.iterdir():
            host_pid, _, rank = log.stem.rpartition("-r")
            pids[host_pid.rpartition("-")[2]] = int(rank)
            count += log.read_bytes().count(b"\n")
    return count, pids


def kill_then_resume(tmp_path: Path, seed: int, first: int, second: int) -> None:
    """Kill one rank (SIGKILL) once a seeded number of units is durable; rerun at another
    world size: the same bytes, every journaled unit reused, no final name before."""
    rng = random.Random(seed)
    src = tmp_path / "in.pt"
    subprocess.run(
        [sys.executable, "-c", SAVE_INPUT, str(src), str(seed)], check=True, env=subprocess_env()
    )
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    want = tmp_path / "want.pt"
    convert([str(src)], "pt", str(want))
    args = ["convert", str(src), "--to", "pt", "-o", str(out)]
    proc = torchrun(args, first, unit=4096)
    target = rng.randrange(1, 60)
    victim_rank = rng.randrange(first)
    killed = None
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        assert not out.exists()  # nothing under the final name before the end
        count, pids = journal_lines(out)
        victims = [int(pid) for pid, rank in pids.items() if rank == victim_rank]
        if count >= target and victims:
            os.kill(victims[0], signal.SIGKILL)
            killed = count
            break
        time.sleep(0.01)
    done = finish(proc, 240)
    if killed is None:  # it ended first (a slow poll): then it must have ended well
        assert done.returncode == 0
        assert sha256(out) == sha256(want)
        return
    assert done.returncode != 0
    assert not out.exists()
    durable, _ = journal_lines(out)
    assert durable >= killed  # the others went on until torchrun ended them
    total = len(plan_units_of(want))
    proc = torchrun([*args], second, unit=4096)
    done = finish(proc, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sha256(out) == sha256(want)
    (line,) = ours(done.stderr)
    if durable:
        reused = int(re.search(r"reused (\d+)", line).group(1))
        assert reused == min(durable, total), line  # every durable unit, none redone
    assert sorted(os.listdir(out.parent)) == ["model.pt"]


SAVE_INPUT = """
import sys, torch
g = torch.Generator().manual_seed(int(sys.argv[2]))
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 12
sd = {f"layer{i}.weight": torch.randn(256 + 7 * i, 97, generator=g) for i in range(layers)}
sd["embed"] = torch.randn(250 * layers, 64, generator=g).to(torch.bfloat16)
torch.save({"model": sd, "step": 5}, sys.argv[1])
"""


def plan_units_of(path: Path) -> list:
    from ckpttool.api.reading import read
    from ckpttool.writers.plan import WriteOptions
    from ckpttool.writers.torch_zip import plan as plan_torch

    return plan_units(plan_torch(read(str(path)).root, WriteOptions()), 4096)


@pytest.mark.slow
def test_killed_rank_then_resume_at_another_world_size(tmp_path):
    kill_then_resume(tmp_path, seed=1, first=3, second=2)


@trials
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 12))
def test_killed_rank_trials(tmp_path, seed):
    rng = random.Random(seed)
    kill_then_resume(tmp_path, seed, rng.choice([2, 3, 4]), rng.choice([1, 2, 3]))


@pytest.mark.slow
def test_input_changed_between_runs_starts_over(tmp_path):
    src = tmp_path / "in.pt"
    subprocess.run([sys.executable, "-c", SAVE_INPUT, str(src), "3", "3"], check=True)
    out = tmp_path / "o.safetensors"
    args = ["convert", str(src), "--to", "safetensors", "-o", str(out)]
    proc = torchrun(args, 2, unit=4096)
    while proc.poll() is None and journal_lines(out)[0] < 5:
        time.sleep(0.01)
    for pid in [proc.pid, *descendants(proc.pid)]:  # the whole job: a lost node
        os.kill(pid, signal.SIGKILL)
    finish(proc, 60)
    assert not out.exists() and journal_lines(out)[0] >= 5
    subprocess.run([sys.executable, "-c", SAVE_INPUT, str(src), "4", "3"], check=True)  # changed
    done = finish(torchrun(args, 2, unit=4096), 300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = ours(done.stderr)
    assert "changed since the interrupted run: started over" in line and "reused" not in line
    want = tmp_path / "want.safetensors"
    convert([str(src)], "safetensors", str(want))
    assert sha256(out) == sha256(want)


# ---------------------------------------------------------------- a stopped rank


@pytest.mark.slow
def test_stopped_rank_fails_the_others_naming_it(tmp_path):
    src = tmp_path / "in.pt"
    subprocess.run([sys.executable, "-c", SAVE_INPUT, str(src), "5", "3"], check=True)
    out = tmp_path / "o.pt"
    proc = torchrun(
        ["convert", str(src), "--to", "pt", "-o", str(out)],
        3,
        unit=4096,
        env={"CKPTTOOL_DIST_TIMEOUT": "3"},
    )
    stopped = None
    while proc.poll() is None and stopped is None:
        pids = {rank: int(pid) for pid, rank in journal_lines(out)[1].items()}
        if 0 in pids:
            stopped = pids[0]
            os.kill(stopped, signal.SIGSTOP)
        time.sleep(0.01)
    assert stopped is not None
    at = time.monotonic()
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    while not any("stopped answering" in ln for ln in lines) and time.monotonic() - at < 60:
        time.sleep(0.05)
    took = time.monotonic() - at
    os.kill(stopped, signal.SIGCONT)  # torchrun's SIGTERM, pending, ends it now
    proc.wait(120)
    reader.join(10)
    named = [ln for ln in lines if "stopped answering" in ln]
    assert len(named) == 1, "".join(lines)[-3000:]
    assert f"rank 0 ({socket.gethostname()} pid {stopped}) stopped answering" in named[0]
    assert took < 3 + 10  # the timeout, then a poll or two
    assert proc.returncode != 0 and not out.exists()


# ---------------------------------------------------------------- --workers, two nodes


@pytest.mark.slow
def test_workers_option(tmp_path):
    out = tmp_path / "w.pt"
    done = subprocess.run(
        [sys.executable, "-m", "ckpttool", "merge", *INPUTS["per-rank"], "-o", str(out)]
        + ["--workers", "2"],
        capture_output=True,
        text=True,
        env=subprocess_env(CKPTTOOL_UNIT_BYTES="64"),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ours(done.stderr) == [ln for ln in done.stderr.splitlines() if ln.strip()]
    (line,) = ours(done.stderr)
    assert line.startswith(f"wrote {out} (")
    assert sha256(out) == sha256(reference(tmp_path, INPUTS["per-rank"], "merge"))


@pytest.mark.slow
def test_two_nodes_c10d_rendezvous(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "hf"
    launcher = [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=ckpttool-{port}",
    ]
    args = ["convert", *INPUTS["dcp"], "--to", "safetensors", "--max-shard-size", "30KB"]
    args += ["-o", str(out)]
    nodes = [torchrun(args, 2, unit=4096, launcher=launcher) for _ in range(2)]
    results = [finish(node, 300) for node in nodes]
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-2000:]
    assert sum(len(ours(r.stderr)) for r in results) == 1  # rank 0's summary only
    want = tmp_path / "want"
    convert(INPUTS["dcp"], "safetensors", str(want), max_shard_size="30KB")
    assert sha256(out) == sha256(want)


# ---------------------------------------------------------------- in one process


def test_crc32_combine_matches_zlib():
    rng = random.Random(0)
    for n in [0, 1, 3, 64, 4095, 4096, 100_000]:
        a, b = rng.randbytes(rng.randrange(200)), rng.randbytes(n)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("size", [997, 4096, 1 << 20])
@pytest.mark.parametrize("cast", [None, "bfloat16"])
def test_units_in_any_order_make_the_same_file(tmp_path, size, cast, monkeypatch):
    """Every unit written on its own, in a shuffled order, then the CRC-built pieces:
    the bytes of the front-to-back write (a zip: CRCs split across units combined; a
    cast made a few elements at a time)."""
    from ckpttool.api.reading import read
    from ckpttool.dtypes import DTYPES
    from ckpttool.writers import casts
    from ckpttool.writers.plan import WriteOptions, write_plan
    from ckpttool.writers.torch_zip import plan as plan_torch

    monkeypatch.setattr(casts, "CAST_ELEMENTS", 3)
    ckpt = read(INPUTS["dcp"])
    plan = plan_torch(ckpt.root, WriteOptions(cast=DTYPES[cast] if cast else None))
    write_plan(plan, str(tmp_path / "want.pt"))
    target = str(tmp_path / "got.pt")
    allocate(plan, target)
    units = plan_units(plan, size)
    assert sum(u.nbytes for u in units) == plan.files[0].size
    runs = []
    for unit in random.Random(size).sample(units, len(units)):
        with OutputFile(file_path(target, plan.files[unit.file]), offset=unit.start) as out:
            runs += [(unit.file, run) for run in write_unit(plan, unit, out)]
    crcs = piece_crcs(plan, runs)
    file = plan.files[0]
    pending = [p.offset for p in file.pieces if p.build is not None]
    with open(target, "r+b") as f:

        def patch(offset: int, data: bytes) -> None:
            f.seek(offset)
            f.write(data)

        complete(file, Written(crcs[0], pending), patch)
    assert sha256(Path(target)) == sha256(tmp_path / "want.pt")


def test_journal_ignores_a_cut_line_and_refuses_a_live_lease(tmp_path):
    out = str(tmp_path / "o.pt")
    journal = journal_mod.Journal(out)
    assert journal.open("k1", []) == ""
    log = journal.log(0)
    log.record(3, [(10, 0, 5, 1234)])
    os.write(log.fd, b"4 [[10,5")  # a kill in the middle of a line
    log.close()
    assert journal.done() == {3: [(10, 0, 5, 1234)]}
    assert journal.open("k1", []) == "resumed"  # our own lease
    lease = Path(journal.root) / journal_mod.LEASE
    lease.write_text(f'{{"host": "{socket.gethostname()}", "pid": {os.getppid()}}}')
    with pytest.raises(Exception, match="another ckpttool run .* is writing this output"):
        journal.open("k1", [])
    lease.write_text(f'{{"host": "{socket.gethostname()}", "pid": 999999999}}')  # dead
    assert "started over" in journal.open("k2", [[out, 1, 2]])
    assert journal.done() == {}


def test_a_resume_folder_is_never_there_without_its_state(tmp_path, monkeypatch):
    """A Ctrl-C while the folder was made left it without state.json, and the rerun
    threw the work away as unreadable: it is made under a temp name and renamed whole."""
    from ckpttool.targets import local

    out = str(tmp_path / "o.pt")
    journal = journal_mod.Journal(out)
    real = journal_mod._write_json

    def stopped(path, value):
        if path.endswith(journal_mod.STATE):
            raise KeyboardInterrupt
        real(path, value)

    monkeypatch.setattr(journal_mod, "_write_json", stopped)
    with pytest.raises(KeyboardInterrupt):
        journal.open("k1", [])
    assert not os.path.exists(journal.root)
    [left] = os.listdir(tmp_path)  # the temp, under the name every output's temp has
    assert left == f".o.pt{journal_mod.SUFFIX}{local.TEMP_MARK}{os.getpid()}"
    monkeypatch.setattr(journal_mod, "_write_json", real)
    assert journal.open("k1", []) == ""  # (its own pid's temp, made again)
    assert sorted(os.listdir(tmp_path)) == [f".o.pt{journal_mod.SUFFIX}"]
    assert json.loads(Path(journal.root, journal_mod.STATE).read_text())["key"] == "k1"
    assert journal.open("k1", []) == "resumed"


def test_workers_taken_out_of_the_command_line():
    from ckpttool.distributed.launch import without_workers

    argv = ["convert", "a.pt", "--workers", "3", "--to", "pt", "--workers=2", "-q"]
    assert without_workers(argv) == ["convert", "a.pt", "--to", "pt", "-q"]
    assert without_workers(["merge", "--", "--workers"]) == ["merge", "--", "--workers"]


def test_launched_only_as_torchrun_starts_workers(monkeypatch):
    from ckpttool.distributed import launched

    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert not launched()
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launched()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not launched()  # one process without torchrun's run id: a plain run
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert launched()  # torchrun --nproc-per-node=1: resumable like the others


def test_bad_worker_count_is_one_line():
    (run,) = run_many([["merge", *INPUTS["per-rank"], "-o", "/nonexistent/x.pt", "--workers", "0"]])
    assert run["code"] == 2
    assert run["stderr"] == "ckpttool: error: --workers must be at least 1, got 0\n"


@pytest.mark.slow
def test_a_sparse_tensor_merged_and_converted_by_workers_is_one_process_s_bytes(tmp_path):
    """The ranks write a sparse tensor's pieces through the same piece rule as one
    process (its invariants read before its first bytes): the same sha256, no error."""
    import torch

    indices = torch.tensor([[0, 1, 2], [2, 0, 1]])
    sparse = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, 3.0]), (3, 3))
    src = tmp_path / "sp.pt"
    torch.save({"w": torch.ones(3), "s": sparse}, src)
    for verb in (["merge"], ["convert", "--to", "pt", "--select", "all"]):
        one, two = tmp_path / f"{verb[0]}-1.pt", tmp_path / f"{verb[0]}-2.pt"
        for out, extra in ((one, []), (two, ["--workers", "2"])):
            done = subprocess.run(
                [sys.executable, "-m", "ckpttool", verb[0], str(src), *verb[1:], "-o", str(out)]
                + extra,
                capture_output=True,
                text=True,
                env=subprocess_env(CKPTTOOL_UNIT_BYTES="64"),
                timeout=300,
            )
            assert done.returncode == 0, done.stderr[-3000:]
        assert sha256(two) == sha256(one), verb
        loaded = torch.load(two, weights_only=True)
        assert torch.equal(loaded["s"].to_dense(), sparse.to_dense())
