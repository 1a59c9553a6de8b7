"""The reference trainer (trainers/ddp_trainer.py) end to end, under torchrun on CPU/gloo.

The multi-process tests launch real torchrun jobs of the tiny GPT and compare the final
snapshots tensor by tensor (model, optimizer, RNG): resuming must be bitwise exact. Runs are
shared through a module-scoped fixture to keep the file under two minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, _descendants, assert_identical, finish, run_cli, start_torchrun

import ckpttool

TRAINER = ROOT / "trainers" / "ddp_trainer.py"
sys.path.insert(0, str(TRAINER.parent))
import ddp_trainer  # noqa: E402  (hook names)
import snapshot_io  # noqa: E402  (the trainer's snapshot helpers, tested directly below)

# every test here launches the trainer under torchrun: run after the quick suite (see .ci/run)
pytestmark = pytest.mark.slow

# Small and quick: ~4 steps an epoch on 2 ranks; dropout keeps the RNG in play.
TINY = ["--backend", "gloo", "--model", "gpt", "--dim", "16", "--layers", "1"]
TIMEOUT_S = 180


def torchrun(
    snapshot_dir: Path,
    *args: str,
    nproc: int = 2,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    check: bool = True,
    tiny: bool = True,
) -> subprocess.CompletedProcess:
    """Run the trainer under torchrun; fail with its output unless it exits 0 (``check``)."""
    trainer_args = ["--snapshot-dir", str(snapshot_dir), *(TINY if tiny else []), *args]
    proc = start_torchrun(
        TRAINER, *trainer_args, nproc=nproc, max_restarts=max_restarts, env=env,
        cwd=snapshot_dir.parent,
    )  # fmt: skip
    proc = finish(proc, TIMEOUT_S)
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(proc.args)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def final_snapshot(snapshot_dir: Path, fmt: str, epoch: int = 3) -> list[str] | str:
    """What to hand ckpttool.load for the snapshot after ``epoch``."""
    if fmt == "dcp":
        return str(snapshot_dir / f"ep{epoch}")
    return sorted(str(p) for p in snapshot_dir.glob(f"ep{epoch}-rank*.pt"))


def load_all(snapshot: list[str] | str) -> dict:
    """The whole snapshot, full tensors: per rank for ddp (RNG differs), merged otherwise."""
    if isinstance(snapshot, list) and "MODEL_STATE" in ckpttool.load(snapshot[0], select="all"):
        return {Path(p).name: ckpttool.load(p, select="all") for p in snapshot}
    return ckpttool.load(snapshot, select="all")


def epoch_losses(stdout: str) -> list[float]:
    # "epoch 0 (1 of 4) | ...": numbered from 0, as the snapshot files are
    line = r"^epoch \d+ \(\d+ of \d+\) .*\| loss (\S+) \|"
    return [float(x) for x in re.findall(line, stdout, re.M)]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """4 epochs in one go, per save format, run once for the whole module."""
    done: dict[tuple[str, int], Path] = {}

    def get(fmt: str, nproc: int = 2) -> Path:
        if (fmt, nproc) not in done:
            run_dir = tmp_path_factory.mktemp(f"straight-{fmt}-{nproc}") / "snapshots"
            torchrun(run_dir, "--epochs", "4", "--save-format", fmt, nproc=nproc)
            done[fmt, nproc] = run_dir
        return done[fmt, nproc]

    return get


# --- the picking function and helpers, no processes ------------------------------------


def _fake_snapshot(snapshot_dir: Path, epoch: int, marker: bool = True) -> None:
    parts = [f"ep{epoch}-rank{r}.pt" for r in range(2)]
    for name in parts:
        (snapshot_dir / name).write_bytes(b"x" * 10)
    if marker:
        snapshot_io.write_complete_marker(snapshot_dir, epoch, "ddp", 2, parts)


def test_find_latest_snapshot_skips_incomplete(tmp_path):
    for epoch in range(5):
        _fake_snapshot(tmp_path, epoch, marker=epoch != 2)  # 2: died before the marker
    (tmp_path / "ep3-rank1.pt").unlink()  # a rank file went missing
    (tmp_path / "ep4-rank1.pt").write_bytes(b"x")  # changed after the marker: truncated
    (tmp_path / "ep5.complete").write_text("{not json")
    (tmp_path / ".ep6-rank1.pt.tmp").write_bytes(b"half")

    latest = snapshot_io.find_latest_snapshot(tmp_path)

    assert (latest["epoch"], latest["format"], latest["world_size"]) == (1, "ddp", 2)
    assert latest["paths"] == [str(tmp_path / "ep1-rank0.pt"), str(tmp_path / "ep1-rank1.pt")]
    assert latest["files"] == {"ep1-rank0.pt": 10, "ep1-rank1.pt": 10}


def test_complete_marker_lists_every_file_of_a_dcp_folder(tmp_path):
    folder = tmp_path / "ep0"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"m" * 3)
    (folder / "__0_0.distcp").write_bytes(b"d" * 5)

    snapshot_io.write_complete_marker(tmp_path, 0, "dcp", 2, ["ep0"])

    latest = snapshot_io.find_latest_snapshot(tmp_path)
    assert latest["paths"] == [str(folder)]
    assert latest["files"] == {"ep0/.metadata": 3, "ep0/__0_0.distcp": 5}
    (folder / "__0_0.distcp").unlink()
    assert snapshot_io.find_latest_snapshot(tmp_path) is None


def test_find_latest_snapshot_empty_or_missing_dir(tmp_path):
    assert snapshot_io.find_latest_snapshot(tmp_path) is None
    assert snapshot_io.find_latest_snapshot(tmp_path / "nope") is None


def test_find_latest_snapshot_orders_epochs_numerically(tmp_path):
    for epoch in (2, 9, 10):
        _fake_snapshot(tmp_path, epoch)
    assert snapshot_io.find_latest_snapshot(tmp_path)["epoch"] == 10


def test_optimizer_state_round_trips_between_index_and_name_keys():
    names = ["a.weight", "a.bias", "b.weight"]
    by_index = {
        "state": {0: {"step": torch.tensor(1.0)}, 2: {"step": torch.tensor(2.0)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}],
    }

    by_name = snapshot_io.optim_state_by_name(by_index, names)

    assert list(by_name["state"]) == ["a.weight", "b.weight"]
    assert by_name["param_groups"] == [{"lr": 0.1, "params": names}]
    assert snapshot_io.optim_state_by_index(by_name, names) == by_index


def test_snapshot_layouts_find_their_model_where_ckpttool_does():
    import ckpttool

    for layout in snapshot_io.SNAPSHOT_LAYOUTS:
        assert layout[0] in ckpttool.MODEL_KEYS


def test_strip_wrapper_prefixes_stacked():
    sd = {"module._orig_mod.fc.weight": torch.zeros(1), "module._orig_mod.fc.bias": torch.ones(1)}
    assert list(snapshot_io.strip_wrapper_prefixes(sd)) == ["fc.weight", "fc.bias"]


@pytest.mark.parametrize(
    ("snapshot", "epochs"),
    [
        ({"MODEL_STATE": {"w": 1}, "OPTIMIZER_STATE": {"state": {}}, "EPOCHS_RUN": 3}, 3),
        (
            {
                "state": {
                    "model": {"w": 1},
                    "optimizers": {"AdamW": {"state": {}}},
                    "timestamp": {"epoch": 2},
                },
                "rng": [],
            },
            2,
        ),
        ({"model": {"w": 1}, "optimizer": {"state": {}}, "epoch": 5}, 5),
    ],
)
def test_unpack_snapshot_layouts(snapshot, epochs):
    parts = snapshot_io.unpack_snapshot(snapshot)
    assert (parts.model, parts.optimizer, parts.epochs_run) == ({"w": 1}, {"state": {}}, epochs)


def test_unpack_snapshot_unknown_layout():
    assert snapshot_io.unpack_snapshot({"fc.weight": torch.zeros(1)}) is None


def test_lr_schedule_does_not_depend_on_total_epochs():
    factor = ddp_trainer.lr_schedule(decay_steps=40)
    assert [round(factor(s), 6) for s in (0, 3)] == [0.25, 1.0]
    assert factor(40) == pytest.approx(0.1) and factor(400) == pytest.approx(0.1)


def test_schedule_position_keeps_samples_seen():
    # 2 epochs of 4 steps (2 ranks) are 2 epochs of 8 steps on 1 rank, of 3 on 3 ranks
    assert snapshot_io.schedule_position(8, 2, 8) == 16
    assert snapshot_io.schedule_position(8, 2, 3) == 6
    assert snapshot_io.schedule_position(8, 2, 4) == 8
    assert snapshot_io.schedule_position(0, 0, 4) == 0
    # not whole epochs (a snapshot saved mid-epoch, elsewhere): cannot be placed
    assert snapshot_io.schedule_position(7, 2, 8) is None
    assert snapshot_io.schedule_position(5, 0, 8) is None


# --- torchrun end to end -----------------------------------------------------------------


# "2 epochs, then resume to 4 == 4 in one go" in two halves, to launch fewer jobs: a run of
# 2 epochs writes the very snapshot a run of 4 writes after its second epoch, and resuming
# from that snapshot reproduces the rest bitwise.


@pytest.mark.slow
def test_two_epoch_run_snapshot_equals_four_epoch_run_after_two(tmp_path, straight_run):
    run_dir = tmp_path / "snapshots"
    torchrun(run_dir, "--epochs", "2", "--save-format", "ddp")

    assert_identical(
        load_all(final_snapshot(straight_run("ddp"), "ddp", epoch=1)),
        load_all(final_snapshot(run_dir, "ddp", epoch=1)),
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ddp", "sharded", "dcp"])
def test_resume_is_bitwise_exact(tmp_path, straight_run, fmt):
    run_dir = tmp_path / "snapshots"
    shutil.copytree(straight_run(fmt), run_dir, ignore=_later_than_epoch_1)

    resumed = torchrun(run_dir, "--epochs", "4", "--save-format", fmt, "--resume", "auto")

    assert "after 2 epoch(s)" in resumed.stdout
    assert len(epoch_losses(resumed.stdout)) == 2  # epochs 3 and 4 only, none re-trained
    tensors = assert_identical(
        load_all(final_snapshot(straight_run(fmt), fmt)), load_all(final_snapshot(run_dir, fmt))
    )
    assert tensors > 20  # model, optimizer moments and steps, RNG


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "nproc"), [("ddp", 3), ("ddp", 4), ("sharded", 3), ("dcp", 3)])
def test_resume_is_bitwise_exact_at_3_and_4_processes(tmp_path, straight_run, fmt, nproc):
    """At 3 or more ranks gloo sums a gradient bucket in an order that depends on where
    it is cut: DDP's first step (one bucket, before it rebuilds them) would sum other
    than the same step of a run that never stopped. Every rank's file is compared
    (each holds its own RNG)."""
    run_dir = tmp_path / "snapshots"
    shutil.copytree(straight_run(fmt, nproc), run_dir, ignore=_later_than_epoch_1)

    resumed = torchrun(
        run_dir, "--epochs", "4", "--save-format", fmt, "--resume", "auto", nproc=nproc
    )

    assert "after 2 epoch(s)" in resumed.stdout
    straight, again = final_snapshot(straight_run(fmt, nproc), fmt), final_snapshot(run_dir, fmt)
    if fmt != "dcp":
        assert len(straight) == len(again) == nproc
    assert assert_identical(load_all(straight), load_all(again)) > 20


def _later_than_epoch_1(folder: str, names: list[str]) -> list[str]:
    """copytree filter: keep the snapshots of epochs 0 and 1 (files, dcp folders, markers)."""
    if Path(folder).name.startswith("ep"):  # inside a dcp folder
        return []
    return [n for n in names if not re.match(r"ep[01](-rank\d+\.pt|\.complete)?$", n)]


@pytest.mark.slow
def test_worker_killed_mid_run_restarts_from_last_snapshot(tmp_path, straight_run):
    run_dir = tmp_path / "snapshots"
    run = torchrun(
        run_dir, "--epochs", "4", max_restarts=2, env={ddp_trainer.KILL_AT_EPOCH_ENV: "2"}
    )

    assert (run_dir / ".killed-at-ep2").exists()  # the hook did fire
    assert "resuming from" in run.stdout and "after 2 epoch(s)" in run.stdout
    assert_identical(
        load_all(final_snapshot(straight_run("ddp"), "ddp")),
        load_all(final_snapshot(run_dir, "ddp")),
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ddp", "dcp"])
def test_rank_killed_while_saving_leaves_previous_snapshot(tmp_path, straight_run, fmt):
    run_dir = tmp_path / "snapshots"
    died = torchrun(
        run_dir,
        "--epochs",
        "4",
        "--save-format",
        fmt,
        check=False,
        env={ddp_trainer.DIE_DURING_SAVE_ENV: "2"},
    )

    assert died.returncode != 0
    assert not (run_dir / "ep2.complete").exists()
    if fmt == "ddp":
        partial = run_dir / ".ep2-rank1.pt.tmp"
        assert partial.exists() and not (run_dir / "ep2-rank1.pt").exists()
        with pytest.raises(ckpttool.CkptError):  # what a naive picker would have failed on
            ckpttool.load(str(partial))
    latest = snapshot_io.find_latest_snapshot(run_dir)
    assert (latest["epoch"], latest["format"]) == (1, fmt)

    resumed = torchrun(run_dir, "--epochs", "4", "--save-format", fmt)
    assert "after 2 epoch(s)" in resumed.stdout
    assert_identical(
        load_all(final_snapshot(straight_run(fmt), fmt)), load_all(final_snapshot(run_dir, fmt))
    )


@pytest.mark.slow
def test_merged_sharded_snapshot_resumes_on_one_process(tmp_path, straight_run):
    shards = sorted(straight_run("sharded").glob("ep1-rank*.pt"))
    assert [p.name for p in shards] == ["ep1-rank0.pt", "ep1-rank1.pt"]
    merged = tmp_path / "merged.pt"

    merge = run_cli("merge", *map(str, shards), "-o", str(merged))
    assert merge.returncode == 0, merge.stderr
    run_dir = tmp_path / "one"
    run = torchrun(run_dir, "--epochs", "4", "--resume", str(merged), nproc=1)

    assert "after 2 epoch(s)" in run.stdout
    losses = epoch_losses(run.stdout)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert sorted(p.name for p in run_dir.glob("*.pt")) == ["ep2-rank0.pt", "ep3-rank0.pt"]
    # The merged weights are the sharded run's, in full: the first step starts from them.
    start = ckpttool.load(str(merged))
    assert torch.equal(start["wte.weight"], ckpttool.load(list(map(str, shards)))["wte.weight"])


@pytest.mark.slow
def test_inspect_json_on_ddp_snapshot(straight_run):
    snapshot = straight_run("ddp") / "ep0-rank0.pt"

    result = run_cli("inspect", "--json", str(snapshot))

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["prefix"] == "module."
    assert report["model_key"] == ["MODEL_STATE"]
    assert {"key": ["EPOCHS_RUN"], "type": "int", "value": 1} in report["values"]


def test_nccl_without_cuda_fails_clearly(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: this checks the CPU-only error")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit, match="--backend nccl needs CUDA; use --backend gloo"):
        ddp_trainer.setup("nccl")


def test_setup_outside_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit, match="launch me with torchrun"):
        ddp_trainer.setup("auto")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ddp", "sharded", "dcp"])
def test_nccl_resume_is_bitwise_exact(tmp_path, fmt):
    """On GPUs with NCCL: 2 epochs, then a resume to 3, equal bitwise to 3 epochs in one go
    (model, optimizer, CUDA RNG), the weights saved on the GPUs and readable on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    nproc = min(2, torch.cuda.device_count())  # NCCL wants one GPU per rank
    args = ["--backend", "nccl", "--save-format", fmt, "--model", "gpt", "--dim", "16",
            "--layers", "1"]  # fmt: skip
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # cuBLAS picks the same kernels every run
    straight, run_dir = tmp_path / "straight", tmp_path / "snapshots"
    torchrun(straight, "--epochs", "3", *args, nproc=nproc, tiny=False, env=env)
    torchrun(run_dir, "--epochs", "2", *args, nproc=nproc, tiny=False, env=env)
    resumed = torchrun(run_dir, "--epochs", "3", *args, nproc=nproc, tiny=False, env=env)

    assert "after 2 epoch(s)" in resumed.stdout
    assert len(epoch_losses(resumed.stdout)) == 1
    tensors = assert_identical(
        load_all(final_snapshot(straight, fmt, epoch=2)), load_all(final_snapshot(run_dir, fmt, 2))
    )
    assert tensors > 20
    first = final_snapshot(run_dir, fmt, epoch=2)
    first = first if isinstance(first, str) else first[0]
    report = json.loads(run_cli("inspect", "--json", first).stdout)
    devices = {t["device"] for t in report["tensors"]} - {"cpu"}  # RNG, optimizer steps
    if fmt != "dcp":  # DCP records no device
        assert devices and devices <= {f"cuda:{r}" for r in range(nproc)}
    # Saved on GPUs, read on the CPU.
    model = ckpttool.load(first, map_location="cpu")
    assert all(t.device.type == "cpu" and torch.isfinite(t).all() for t in model.values())


def _lr_after(epochs: int, steps_per_epoch: int, lr: float = 3e-3, decay_epochs: int = 10) -> str:
    """The lr the trainer logs after ``epochs`` epochs of ``steps_per_epoch`` steps."""
    factor = ddp_trainer.lr_schedule(decay_epochs * steps_per_epoch)
    return f"{lr * factor(epochs * steps_per_epoch):.2e}"


@pytest.mark.slow
def test_resume_on_another_world_size_keeps_the_schedule_by_samples(tmp_path, straight_run):
    """2 epochs on 2 ranks (4 steps an epoch) resumed on 1 rank (8 steps an epoch): the
    schedule continues at 2 epochs of 8 steps, as a 1-rank run would, instead of jumping
    back to step 8 of the longer horizon (issue 32: 3.0e-4 back to 9.1e-4)."""
    snapshot = straight_run("ddp") / "ep1-rank0.pt"
    run_dir = tmp_path / "one"
    run = torchrun(run_dir, "--epochs", "3", "--resume", str(snapshot), nproc=1)
    assert "the snapshot counted 8 steps for 2 epoch(s), this run takes 8 an epoch: " \
        "continuing at step 16" in run.stdout  # fmt: skip
    assert "epoch 2 (3 of 3) | steps 8 | loss" in run.stdout
    assert re.search(rf"^epoch 2 .*\| lr {_lr_after(3, 8)} \|", run.stdout, re.M), run.stdout
    # a schedule that is not at whole epochs cannot be placed: refused, naming the flag
    state = torch.load(snapshot, weights_only=True)
    state["SCHEDULER_STATE"]["last_epoch"] = 7
    odd = tmp_path / "odd.pt"
    torch.save(state, odd)
    refused = torchrun(tmp_path / "two", "--epochs", "3", "--resume", str(odd), nproc=1,
                       check=False)  # fmt: skip
    assert refused.returncode != 0
    assert "cannot be carried over to 8 steps an epoch" in refused.stderr
    assert "--lr-schedule-reset" in refused.stderr
    reset = torchrun(tmp_path / "three", "--epochs", "3", "--resume", str(odd),
                     "--lr-schedule-reset", nproc=1)  # fmt: skip
    assert "continuing at step 0" in reset.stdout


@pytest.mark.slow
def test_workers_exit_when_their_launcher_is_killed(tmp_path):
    """SIGKILL of torchrun (or the OOM killer) left its workers training on: they die
    with it (PR_SET_PDEATHSIG)."""
    run_dir = tmp_path / "run"
    proc = start_torchrun(
        TRAINER, "--snapshot-dir", str(run_dir), *TINY, "--epochs", "100000", nproc=2,
        cwd=tmp_path,
    )  # fmt: skip
    workers: list[int] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (run_dir / "ep0.complete").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no snapshot written"
            time.sleep(0.2)
        workers = _descendants(proc.pid)
        assert len(workers) >= 2
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() and _running(pid) for pid in workers):
            assert time.monotonic() < deadline, "workers outlived their launcher"
            time.sleep(0.2)
    finally:  # (orphaned workers would hold our pipes open: communicate would hang)
        for pid in [proc.pid, *_descendants(proc.pid), *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead worker whose launcher is gone waits for init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
