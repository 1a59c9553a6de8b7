"""One product whatever route writes it (issue 42): every input family through every output
layout, written by one process, by ``--workers 2``, by torchrun with 3 ranks, and to
``s3://`` (moto on 127.0.0.1) from one process and from torchrun, gives the same files with
the same sha256, or the same one error line and exit code, and leaves nothing behind.

The quick suite runs a sample that covers every output layout and input family; the slow
suite (``-m slow``) the whole matrix.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES, finish, run_many, subprocess_env
from servers import S3Server

from ckpttool import sources

pytest.importorskip("s3fs")
moto_models = pytest.importorskip("moto.s3.models")

BUCKET = "routes"
PART = 64 << 10  # moto is told to take parts this small: several parts per file
UNIT = "4096"  # the ranks' unit: several units per file, claimed by every rank
HF = FIXTURES / "transformers" / "gpt2_tied" / "checkpoint-2"

# input family -> the paths given to ckpttool
INPUTS = {
    "per-rank": [str(FIXTURES / "fsdp_uneven" / f"model-rank{r}.pt") for r in range(3)],
    "dtensor": [str(FIXTURES / "dtensor" / f"dt-rank{r}.pt") for r in range(2)],
    "ddp": [str(FIXTURES / "ddp" / "ep0-rank0.pt")],
    "dcp": [str(FIXTURES / "dcp")],
    "deepspeed": [str(FIXTURES / "deepspeed" / "zero2")],
    "st-sharded": [str(FIXTURES / "safetensors_sharded")],
    "hf-folder": [str(HF)],
    "megatron-legacy": [str(FIXTURES / "megatron" / "legacy_tp2_pp2_vp2")],
}
# output layout -> (the command and its options, the -o given: DIR/ for a folder)
OUTPUTS = {
    "safetensors": (["convert", "--to", "safetensors"], "out.safetensors"),
    "bf16": (["convert", "--to", "safetensors", "--dtype", "bf16"], "out.safetensors"),
    "shards": (["convert", "--to", "safetensors", "--max-shard-size", "3KB"], "shards"),
    "folder": (["convert", "--to", "safetensors"], "model/"),
    "pt": (["convert", "--to", "pt"], "out.pt"),
    "dcp": (["convert", "--to", "dcp"], "out-dcp"),
    "merge": (["merge"], "merged.pt"),
}
QUICK = [
    ("hf-folder", "folder"),
    ("hf-folder", "shards"),
    ("per-rank", "merge"),
    ("dcp", "dcp"),
    ("ddp", "pt"),
    ("st-sharded", "bf16"),
    ("dtensor", "safetensors"),
]
FULL = [(i, o) for i in INPUTS for o in OUTPUTS]
# inputs every route must refuse with one line: (name, the paths, the command)
REFUSED = {
    "missing": (["nosuch.pt"], ["convert", "--to", "safetensors"], "out.safetensors"),
    "sparse": (None, ["convert", "--to", "safetensors"], "out.safetensors"),
}


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    undo = server.configure()
    sources.forget("s3")
    saved = moto_models.S3_UPLOAD_PART_MIN_SIZE
    moto_models.S3_UPLOAD_PART_MIN_SIZE = PART
    server.client().create_bucket(Bucket=BUCKET)
    server.env = {**server.env, "CKPTTOOL_S3_PART_SIZE": str(PART)}
    yield server
    moto_models.S3_UPLOAD_PART_MIN_SIZE = saved
    sources.forget("s3")
    undo()
    server.close()


@pytest.fixture(scope="module")
def sparse_input(tmp_path_factory) -> str:
    import torch

    path = tmp_path_factory.mktemp("sparse") / "sp.pt"
    torch.save({"w": torch.ones(3), "s": torch.eye(3).to_sparse()}, path)
    return str(path)


# ------------------------------------------------------------------------- the routes


def argv(inputs: list[str], output: str, out: str) -> list[str]:
    command, target = OUTPUTS[output]
    return [command[0], *inputs, *command[1:], "-o", out + ("/" if target.endswith("/") else "")]


def launch(route: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``ckpttool ARGS`` on ``route`` (``workers``: ``--workers 2``; ``torchrun``:
    3 ranks under ``torch.distributed.run``)."""
    env = {**env, "CKPTTOOL_UNIT_BYTES": UNIT, "CKPTTOOL_DIST_TIMEOUT": "30"}
    if route == "workers":
        cmd = [sys.executable, "-m", "ckpttool", *args, "--workers", "2"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node=3", "--monitor-interval=0.1", "-m", "ckpttool", *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(**env),
        start_new_session=True,
    )


def local_files(path: Path) -> dict[str, str]:
    """sha256 of the output's files, by name inside it ("" for a single file)."""
    if path.is_dir():
        return {
            str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*"))
        }
    return {"": hashlib.sha256(path.read_bytes()).hexdigest()} if path.exists() else {}


def remote_files(s3: S3Server, prefix: str) -> dict[str, str]:
    """sha256 of every object under ``prefix``, by name inside it ("" for the object itself)."""
    client = s3.client()
    found = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents") or []
    files = {}
    for obj in found:
        name = obj["Key"][len(prefix) :].lstrip("/")
        if obj["Key"] != prefix and not obj["Key"].startswith(prefix + "/"):
            continue  # another case's output that shares the first letters
        body = client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
        files[name] = hashlib.sha256(body).hexdigest()
    return files


def open_uploads(s3: S3Server, prefix: str) -> list[str]:
    uploads = s3.client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")
    return [u["Key"] for u in uploads or []]


def ours(stderr: str) -> list[str]:
    """ckpttool's lines of a run's stderr (torchrun's own summary is not ckpttool's)."""
    mine = ("ckpttool:", "wrote ", "warning: ")
    return [ln for ln in stderr.splitlines() if ln.startswith(mine)]


def same_line(line: str, out: str) -> str:
    """A line with the output's place and the units said under several ranks left out."""
    line = line.replace(out, "OUT")
    return re.sub(r"; \d+ units?\b.*$", "", line)


def run_matrix(tmp_path: Path, s3: S3Server, cases: list[tuple[str, str]], routes: list[str]):
    """Every case on every route; each output equal to one process's, nothing left."""
    base = tmp_path / "one"
    base.mkdir()
    one_args = [argv(INPUTS[i], o, str(base / f"{i}-{o}" / "out")) for i, o in cases]
    one = run_many(one_args)
    want, said = {}, {}
    for (inputs, output), run in zip(cases, one, strict=True):
        assert run["code"] == 0, (inputs, output, run["stderr"])
        folder = base / f"{inputs}-{output}"
        want[inputs, output] = local_files(folder / "out")
        said[inputs, output] = [same_line(ln, str(folder / "out")) for ln in ours(run["stderr"])]
        assert sorted(os.listdir(folder)) == ["out"], (inputs, output)  # nothing beside it
        assert len(want[inputs, output]) >= 1
    if "s3" in routes:  # one process, in one interpreter for every case
        prefix = f"one/{tmp_path.name}"
        urls = [f"s3://{BUCKET}/{prefix}/{i}-{o}" for i, o in cases]
        runs = run_many(
            [argv(INPUTS[i], o, u) for (i, o), u in zip(cases, urls, strict=True)], env=s3.env
        )
        for (inputs, output), run, url in zip(cases, runs, urls, strict=True):
            assert run["code"] == 0, (inputs, output, run["stderr"])
            lines = [same_line(ln, url) for ln in ours(run["stderr"])]
            assert lines == said[inputs, output], (inputs, output, run["stderr"])
            key = f"{prefix}/{inputs}-{output}"
            assert remote_files(s3, key) == want[inputs, output], (inputs, output)
            assert open_uploads(s3, key) == []
    launched = [r for r in routes if r != "s3"]
    pending = []
    for route in launched:
        for inputs, output in cases:
            if route.startswith("s3-"):
                key = f"{route}/{tmp_path.name}/{inputs}-{output}"
                out = f"s3://{BUCKET}/{key}"
            else:
                folder = tmp_path / route / f"{inputs}-{output}"
                folder.mkdir(parents=True)
                out, key = str(folder / "out"), ""
            proc = launch(route.removeprefix("s3-"), argv(INPUTS[inputs], output, out), s3.env)
            pending.append((route, inputs, output, out, key, proc))
            if len(pending) >= 3:  # a few at a time: 2 cores
                _check(s3, want, said, *pending.pop(0))
    for item in pending:
        _check(s3, want, said, *item)


def _check(s3, want, said, route, inputs, output, out, key, proc) -> None:
    done = finish(proc, 300)
    case = (route, inputs, output)
    assert done.returncode == 0, (case, done.stderr[-3000:])
    lines = ours(done.stderr)
    assert [same_line(ln, out) for ln in lines] == said[inputs, output], (case, done.stderr)
    if route == "workers":  # ckpttool's own launch: nothing of torch's logging
        assert done.stderr.splitlines() == lines, (case, done.stderr[-3000:])
    if key:
        assert remote_files(s3, key) == want[inputs, output], case
        assert open_uploads(s3, key) == []
    else:
        assert local_files(Path(out)) == want[inputs, output], case
        assert sorted(os.listdir(Path(out).parent)) == ["out"], case  # no work folder left


def test_a_sample_of_every_layout_and_family_on_every_quick_route(tmp_path, s3):
    run_matrix(tmp_path, s3, QUICK, ["s3", "workers"])


@pytest.mark.slow
def test_every_input_and_layout_on_every_route(tmp_path, s3):
    run_matrix(tmp_path, s3, FULL, ["s3", "workers", "torchrun"])


@pytest.mark.slow
def test_every_input_from_torchrun_to_s3(tmp_path, s3):
    cases = [(i, "shards" if i == "hf-folder" else "pt") for i in INPUTS] + [("dcp", "merge")]
    run_matrix(tmp_path, s3, cases, ["s3-torchrun"])


# ------------------------------------------------------------------ refused on every route


@pytest.mark.parametrize("name", REFUSED)
def test_refused_with_the_same_line_on_every_route(tmp_path, s3, sparse_input, name):
    paths, command, target = REFUSED[name]
    paths = paths or [sparse_input]
    local = tmp_path / "one"
    local.mkdir()
    (one,) = run_many([[command[0], *paths, *command[1:], "-o", str(local / target)]])
    assert one["code"] != 0 and len(one["stderr"].splitlines()) == 1, one
    want = (one["code"], same_line(one["stderr"].strip(), str(local / target)))
    url = f"s3://{BUCKET}/refused/{name}/{target}"
    (remote,) = run_many([[command[0], *paths, *command[1:], "-o", url]], env=s3.env)
    assert (remote["code"], same_line(remote["stderr"].strip(), url)) == want
    workers = tmp_path / "workers"
    workers.mkdir()
    out = str(workers / target)
    done = finish(launch("workers", [command[0], *paths, *command[1:], "-o", out], s3.env), 300)
    assert (done.returncode, same_line(done.stderr.strip(), out)) == want, done.stderr[-3000:]
    assert os.listdir(local) == [] and os.listdir(workers) == []
    assert remote_files(s3, f"refused/{name}") == {} and open_uploads(s3, "refused/") == []


# ------------------------------------------------------------------ failures, on every route


def limit_file_size(limit: int):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.fixture(scope="module")
def four_mib(tmp_path_factory) -> Path:
    import torch

    path = tmp_path_factory.mktemp("four") / "four.pt"
    torch.save({f"l{i}.weight": torch.full((256, 1024), float(i)) for i in range(4)}, path)
    return path


def test_a_full_disk_says_the_same_line_and_leaves_nothing_on_every_route(tmp_path, four_mib):
    """One process and --workers 2: the bytes needed and free, exit 2, and no work folder
    left behind to keep the disk full (nothing of it could be used by a rerun)."""
    lines = {}
    for route, extra in (("one", []), ("workers", ["--workers", "2"])):
        folder = tmp_path / route
        folder.mkdir()
        done = subprocess.run(
            [sys.executable, "-m", "ckpttool", "convert", str(four_mib), "--to", "safetensors"]
            + ["-o", "out.safetensors", *extra],
            capture_output=True,
            text=True,
            cwd=folder,
            env=subprocess_env(CKPTTOOL_UNIT_BYTES=str(1 << 20)),
            preexec_fn=limit_file_size(1 << 20),
            timeout=300,
        )
        assert done.returncode == 2, done.stderr
        lines[route] = re.sub(r"[\d.]+ GiB free", "N free", done.stderr)
        assert os.listdir(folder) == [], (route, os.listdir(folder))
    assert lines["one"] == lines["workers"]
    assert lines["one"] == (
        "ckpttool: error: out.safetensors: cannot write the output (disk full or file too "
        "large: the output needs 4.0 MiB, N free there); nothing was written\n"
    )


def test_workers_find_a_missing_input_or_a_bad_option_before_starting(tmp_path):
    runs = run_many(
        [
            ["convert", "nosuch.pt", "--to", "pt", "-o", tmp_path / "a.pt", "--workers", "2"],
            ["merge", "nos*.pt", "-o", tmp_path / "a.pt", "--workers", "2"],
            ["convert", *INPUTS["ddp"], "--to", "pt", "--dtype", "fp8", "-o", tmp_path / "b.pt"]
            + ["--workers", "2"],
        ]
    )
    assert [(r["code"], r["stderr"]) for r in runs] == [
        (2, "ckpttool: error: nosuch.pt: no such file or directory\n"),
        (2, "ckpttool: error: nos*.pt: no file matches this pattern\n"),
        (
            2,
            "ckpttool: error: unknown --dtype 'fp8' (choose one of float32, float16, bfloat16 "
            "(or fp32, fp16, half, bf16))\n",
        ),
    ]
    assert os.listdir(tmp_path) == []


def test_work_of_an_interrupted_run_is_removed_once_another_route_finishes_it(tmp_path):
    """A --workers run killed midway leaves its resume folder; the same output written by
    one process makes that folder of no use: it goes, and the run says so."""
    import json
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    work = tmp_path / ".out.pt.ckpttool-resume"
    (work / "files").mkdir(parents=True)
    (work / "journal").mkdir()
    (work / "files" / "output").write_bytes(bytes(5000))
    (work / "state.json").write_text(json.dumps({"key": "k", "inputs": []}))
    (work / "lease").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    (run,) = run_many([["convert", *INPUTS["ddp"], "--to", "pt", "-o", tmp_path / "out.pt"]])
    assert run["code"] == 0, run["stderr"]
    assert os.listdir(tmp_path) == ["out.pt"]
    first = run["stderr"].splitlines()[0]
    assert first.startswith("ckpttool: removed a temporary file of killed runs (")
    assert f"{work} (pid {dead.pid})" in first


def start_workers(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ckpttool", *args, "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=subprocess_env(CKPTTOOL_UNIT_BYTES=str(1 << 20)),
        start_new_session=True,
    )


def wait_for_work(proc: subprocess.Popen, folder: Path) -> list[int]:
    """The workers' pids, once a unit is durable (its line in a journal of the resume
    folder): what a rerun must reuse."""
    import time

    from helpers import _descendants

    for _ in range(600):
        workers = _descendants(proc.pid)
        logs = [log for log in folder.glob(".*-resume/journal/*.log") if log.stat().st_size]
        if len(workers) >= 2 and logs:
            return workers
        time.sleep(0.05)
    pytest.fail("the workers never started writing")


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    import torch

    path = tmp_path_factory.mktemp("big") / "big.pt"
    torch.save({f"w{i}": torch.full((1024, 4096), float(i)) for i in range(24)}, path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "kill -9 a worker"])
def test_workers_interrupted_or_killed_say_one_line(tmp_path, big, how):
    import signal

    proc = start_workers(["convert", str(big), "--to", "pt", "-o", "out.pt"], tmp_path)
    workers = wait_for_work(proc, tmp_path)
    if how == "ctrl-c":  # the terminal sends SIGINT to the whole foreground group
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(workers[-1], signal.SIGKILL)
    done = finish(proc, 120)
    lines = done.stderr.splitlines()
    if how == "ctrl-c":
        assert (done.returncode, lines) == (130, ["ckpttool: interrupted; no output was written"])
    else:
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert re.fullmatch(
            r"ckpttool: error: worker \d \(pid \d+\) was killed by SIGKILL; nothing was written "
            r"under the output \(run the same command again: it resumes the work already "
            r"durable\)",
            lines[0],
        ), lines[0]
    assert not (tmp_path / "out.pt").exists()
    again = subprocess.run(  # the rerun resumes, and finishes the same bytes
        [sys.executable, "-m", "ckpttool", "convert", str(big), "--to", "pt", "-o", "out.pt"]
        + ["--workers", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=subprocess_env(CKPTTOOL_UNIT_BYTES=str(1 << 20)),
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert "reused" in again.stderr
    assert os.listdir(tmp_path) == ["out.pt"]


def on_a_terminal(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``python -m ckpttool ARGS`` with a pseudo-terminal as stdout and stderr: its
    exit code and everything it drew there."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpttool", *args],
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env=subprocess_env(CKPTTOOL_UNIT_BYTES=str(1 << 20), COLUMNS="120", TERM="xterm"),
    )
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the last writer closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    return proc.wait(timeout=300), drawn.decode(errors="replace")


@pytest.mark.slow
def test_workers_show_one_progress_bar_of_the_whole_output(tmp_path, big):
    code, drawn = on_a_terminal(
        ["convert", str(big), "--to", "safetensors", "-o", "out.safetensors", "--workers", "2"],
        tmp_path,
    )
    assert code == 0, drawn
    assert "writing out.safetensors" in drawn and "MiB/s" in drawn, drawn[-2000:]
    assert drawn.count("wrote out.safetensors (24 tensors, 384.0 MiB)") == 1, drawn[-2000:]


@pytest.mark.slow
def test_under_torchrun_an_error_is_said_once_first_and_every_rank_exits_with_its_code(tmp_path):
    """torchrun's own summary is torchrun's; ckpttool's line comes once, before it, and
    every rank exits with the contract's code (none is ended by torchrun's SIGTERM)."""
    proc = launch("torchrun", ["convert", "nosuch.pt", "--to", "pt", "-o", "x.pt"], {})
    done = finish(proc, 120)
    assert ours(done.stderr) == ["ckpttool: error: nosuch.pt: no such file or directory"]
    first = done.stderr.index("ckpttool: error")
    assert "Traceback" not in done.stderr[:first]  # torchrun's report comes after ours
    codes = re.findall(r"exitcode +: (-?\d+)", done.stderr)  # the summary, one per rank
    assert sorted(codes) == ["2", "2", "2"], done.stderr[-3000:]
