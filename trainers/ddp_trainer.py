"""Reference DDP / FSDP trainer whose snapshots ckpttool inspects, converts and resumes from.

Launch it with torchrun from the repository root:

    torchrun --standalone --nproc_per_node=2 trainers/ddp_trainer.py \
        --epochs 10 --save-every 1 --snapshot-dir runs/demo --save-format ddp

After epoch E (0-based) every rank writes its part of the snapshot:

    ddp      ep{E}-rank{R}.pt  {"MODEL_STATE" (keys "module."), "OPTIMIZER_STATE",
                                "SCHEDULER_STATE", "EPOCHS_RUN", "RNG", "CONFIG"}
    sharded  ep{E}-rank{R}.pt  Composer layout of FSDP SHARDED_STATE_DICT (ShardedTensor leaves):
                               {"state": {"model", "optimizers": {"AdamW"},
                                          "schedulers": {"LambdaLR"},
                                          "timestamp": {"epoch", "batch", ...}, "config"},
                                "rng": [one entry per rank]}
    dcp      ep{E}/            torch.distributed.checkpoint folder of
                               {"model", "optimizer", "scheduler", "epoch", "rng", "config"}

A snapshot exists only once rank 0 has written ``ep{E}.complete`` beside it, after every rank
finished; ``--resume auto`` ignores anything without that marker.

Test hooks (environment variables, used by tests/test_trainer.py):
    CKPTTOOL_TRAINER_KILL_AT_EPOCH=E     rank 1 SIGKILLs itself once, after a step of epoch E,
                                         and joins 2 s late after torchrun restarts it
    CKPTTOOL_TRAINER_DIE_DURING_SAVE=E   rank 1 dies half-way through writing snapshot E
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

# isort: split
# Our siblings in trainers/, importable because Python puts the script's folder on sys.path.
from snapshot_io import (
    COMPLETE_MARKER,
    SNAPSHOT_DIR,
    SNAPSHOT_FILE,
    Snapshot,
    atomic_write,
    find_latest_snapshot,
    get_rng_state,
    optim_state_by_index,
    optim_state_by_name,
    schedule_position,
    set_rng_state,
    snapshot_layout,
    snapshot_part,
    write_complete_marker,
)
from tinytask import build_task

import ckpttool  # (snapshot_io put the checkout on sys.path when it is not installed)

# FSDP1's SHARDED_STATE_DICT is deprecated in favour of DTensor, but it is the layout that
# Composer and many published checkpoints use, so this trainer writes it on purpose.
warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*state_dict_type.*", category=FutureWarning)
# Noise from FSDP1 internals on gloo and on a single rank (where it falls back to NO_SHARD).
for _noise in (
    ".*_get_pg_default_device.*",
    ".*Multiple backends are registered.*",
    ".*NO_SHARD.*full_state_dict.*",
):
    warnings.filterwarnings("ignore", message=_noise, category=UserWarning)

KILL_AT_EPOCH_ENV = "CKPTTOOL_TRAINER_KILL_AT_EPOCH"
DIE_DURING_SAVE_ENV = "CKPTTOOL_TRAINER_DIE_DURING_SAVE"


def exit_with_launcher() -> int:
    """Die with the launcher: a SIGKILLed (or OOM-killed) torchrun must not leave its
    workers training on with nobody watching. Returns the launcher's pid, which
    ``Trainer`` checks every step as well (where the parent-death signal is missing).

    Linux delivers PR_SET_PDEATHSIG when the parent dies; a parent that died before the
    call is caught by the pid check after it (we were re-parented already).
    """
    launcher = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if launcher == 1 or os.getppid() != launcher:
        sys.exit("ddp_trainer.py: the launcher is gone; exiting")
    return launcher


def log(*parts: object) -> None:
    """Print on rank 0 only: N ranks printing the same line helps nobody."""
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def _store_for_this_attempt() -> dist.Store | None:
    """torchrun's shared TCPStore, namespaced by restart attempt (None: torchrun shares none).

    torchrun hands every restart attempt the same store and torch's own keys carry no
    attempt number, so a restarted rank can read a dead rank's gloo address or NCCL id from
    the attempt before and hang in init_process_group (pytorch/pytorch#135712; the
    kill-and-restart test provokes it by delaying the restarted rank). The attempt
    count is per node: on several nodes set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def setup(backend: str) -> torch.device:
    """Join the process group torchrun describes in the environment; return this rank's device."""
    if "LOCAL_RANK" not in os.environ:
        sys.exit(
            "ddp_trainer.py: launch me with torchrun, e.g. "
            "torchrun --standalone --nproc_per_node=2 trainers/ddp_trainer.py"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            sys.exit("ddp_trainer.py: --backend nccl needs CUDA; use --backend gloo on CPU")
        # Pick the GPU before the process group exists, or every rank's NCCL communicator
        # (and its memory) lands on cuda:0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    store = _store_for_this_attempt()
    if store is None:
        dist.init_process_group(backend=backend)
    else:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    return device


def lr_schedule(decay_steps: int, warmup_steps: int = 4, min_factor: float = 0.1):
    """nanoGPT's schedule as a LambdaLR factor: linear warmup, cosine decay, then flat.

    The horizon is its own flag, not --epochs: a run of 2 epochs resumed to 4 must see the
    same learning rates as a run of 4, so the schedule cannot depend on the total.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# --- the trainer -------------------------------------------------------------------------


class Trainer:
    def __init__(self, args: argparse.Namespace, device: torch.device, launcher: int = 0):
        self.args = args
        self.launcher = launcher  # the parent pid to outlive never (0: not checked)
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.snapshot_dir = Path(args.snapshot_dir)
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        self.config = {
            "model": args.model,
            "dim": args.dim,
            "layers": args.layers,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "lr_decay_epochs": args.lr_decay_epochs,
            "seed": args.seed,
            "world_size": self.world_size,
        }

        # Same seed on every rank: FSDP does not broadcast initial weights the way DDP does.
        torch.manual_seed(args.seed)
        model, dataset = build_task(args.model, args.dim, args.layers)
        model.to(device)
        self.param_names = [name for name, _ in model.named_parameters()]

        # Load the snapshot before wrapping: the bare model's keys have no "module." and
        # FSDP then shards the restored weights instead of random ones.
        self.epochs_run = 0
        snapshot = self._load_snapshot(args.resume, model)

        if args.save_format == "ddp":
            self.model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            # Sharded formats need a model that is actually sharded. On CPU FSDP needs
            # device_id=cpu spelled out, or it refuses to run.
            self.model = FSDP(model, use_orig_params=True, device_id=device)

        # shuffle=True with a fixed seed: set_epoch(e) then gives the same order on every
        # rank, in every run and after every resume, without touching the global RNG.
        self.sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
        self.loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=self.sampler,
            pin_memory=device.type == "cuda",
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_schedule(args.lr_decay_epochs * len(self.loader))
        )

        if snapshot is not None:
            self._restore_training_state(snapshot)
        else:
            # One dropout stream per rank, as nanoGPT does with its seed offset.
            torch.manual_seed(args.seed + 1 + self.rank)
            random.seed(args.seed + 1 + self.rank)

    # -- resuming -------------------------------------------------------------------------

    def _resume_source(self, resume: str):
        if resume == "none":
            return None
        if resume != "auto":
            return resume
        latest = find_latest_snapshot(self.snapshot_dir)
        if latest is None:
            return None
        if latest["format"] == "ddp":
            # Every rank saved the same weights but its own RNG: read your own file.
            return latest["paths"][min(self.rank, len(latest["paths"]) - 1)]
        return latest["paths"] if latest["format"] == "sharded" else latest["paths"][0]

    def _load_snapshot(self, resume: str, model: torch.nn.Module) -> Snapshot | None:
        """Copy the snapshot's weights into ``model`` and return the rest of its state."""
        source = self._resume_source(resume)
        if source is None:
            log("starting fresh")
            return None
        # ckpttool is the safe reader: no code from the file runs. load_into reads each
        # weight straight into the parameter on our device (sharded tensors merged on the
        # way), never the whole snapshot in memory; the rest is loaded as plain data.
        try:
            ckpt = ckpttool.read(source)
            layout = snapshot_layout(ckpt)
            ckpttool.load_into(model, ckpt, select=".".join(layout[0]) if layout else "auto")
            if layout is None:  # a plain weights file: train on from those weights
                snapshot = Snapshot({})
            else:
                parts = [snapshot_part(ckpt, path) for path in layout[1:]]
                optimizer, scheduler, epochs_run, rng = (
                    None if part is None else ckpttool.materialize(part, self.device)
                    for part in parts
                )
                snapshot = Snapshot({}, optimizer, scheduler, int(epochs_run or 0), rng)
        except ckpttool.StateMismatchError as e:
            sys.exit(
                f"ddp_trainer.py: the snapshot's weights do not fit --model {self.args.model} "
                f"--dim {self.args.dim} --layers {self.args.layers}: {str(e)[:400]}"
            )
        except ckpttool.CkptError as e:
            sys.exit(f"ddp_trainer.py: cannot resume: {e}")
        shown = source if isinstance(source, str) else f"{source[0]} (+{len(source) - 1})"
        log(
            f"resuming from {shown} after {snapshot.epochs_run} epoch(s) "
            f"(epochs 0-{snapshot.epochs_run - 1} done)"
        )
        return snapshot

    def _restore_training_state(self, snapshot: Snapshot) -> None:
        self.epochs_run = snapshot.epochs_run
        if snapshot.optimizer is not None:
            by_name = optim_state_by_name(snapshot.optimizer, self.param_names)
            if isinstance(self.model, FSDP):
                # Full (merged) tensors in, this rank's flat shards out.
                with FSDP.state_dict_type(
                    self.model,
                    StateDictType.FULL_STATE_DICT,
                    FullStateDictConfig(rank0_only=False),
                    FullOptimStateDictConfig(rank0_only=False),
                ):
                    flat = FSDP.optim_state_dict_to_load(self.model, self.optimizer, by_name)
                self.optimizer.load_state_dict(flat)
            else:
                self.optimizer.load_state_dict(optim_state_by_index(by_name, self.param_names))
            self._keep_param_group_order()
        if snapshot.scheduler is not None:
            self.scheduler.load_state_dict(snapshot.scheduler)
            self._keep_schedule_by_samples()
        # The snapshot holds this rank's RNG (ddp) or every rank's (sharded, dcp). From
        # another world size there is no exact match: reseed, deterministically.
        rng = snapshot.rng
        if isinstance(rng, list):
            rng = rng[self.rank] if len(rng) == self.world_size else None
        if isinstance(rng, dict):
            set_rng_state(rng, self.device)
        else:
            log("snapshot has no RNG state for this world size: reseeding, resume is not exact")
            torch.manual_seed(self.args.seed + 1 + self.rank + 1000 * self.epochs_run)
            random.seed(self.args.seed + 1 + self.rank + 1000 * self.epochs_run)

    def _keep_param_group_order(self) -> None:
        """Each param group's settings in the order this optimizer made them, not the
        snapshot's: load_state_dict takes the saved dicts as they come, and a DCP
        snapshot keeps its entries in the order its ranks' plans were merged (it varies
        with the world size), so the next snapshot would differ in key order alone."""
        for group in self.optimizer.param_groups:
            own = ["params", *self.optimizer.defaults, "initial_lr"]  # as the optimizer made them
            order = {key: i for i, key in enumerate(own)}
            items = sorted(group.items(), key=lambda item: order.get(item[0], len(order)))
            group.clear()
            group.update(items)

    def _keep_schedule_by_samples(self) -> None:
        """The schedule counts steps; on another world size (or batch size) an epoch is
        another number of steps, and the saved count would put the cosine elsewhere
        (3.0e-4 back to 9.1e-4). Continue at the same samples seen instead: the epochs
        run, in this run's steps. The same steps per epoch (a resume on the same world
        size) change nothing: resuming stays bitwise exact."""
        saved = self.scheduler.last_epoch
        steps = len(self.loader)
        if saved == self.epochs_run * steps:
            return
        position = schedule_position(saved, self.epochs_run, steps)
        if position is None:
            if not self.args.lr_schedule_reset:
                sys.exit(
                    f"ddp_trainer.py: the snapshot's learning-rate schedule is at step {saved}, "
                    f"not whole epochs of {self.epochs_run}: it cannot be carried over to "
                    f"{steps} steps an epoch by samples seen (pass --lr-schedule-reset to "
                    "restart the schedule from its first step)"
                )
            position = 0
        factor = self.scheduler.lr_lambdas[0](position)
        self.scheduler.last_epoch = position
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * factor
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        log(
            f"schedule: the snapshot counted {saved} steps for {self.epochs_run} epoch(s), "
            f"this run takes {steps} an epoch: continuing at step {position} "
            f"(lr {self.scheduler._last_lr[0]:.2e})"
        )

    # -- training -------------------------------------------------------------------------

    def _run_epoch(self, epoch: int) -> float:
        self.sampler.set_epoch(epoch)
        self.model.train()
        total = 0.0
        for step, (inputs, targets) in enumerate(self.loader):
            if self.launcher and os.getppid() != self.launcher:  # (no parent-death signal)
                sys.exit("ddp_trainer.py: the launcher is gone; exiting")
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.model(inputs, targets)
            loss.backward()
            if isinstance(self.model, FSDP):  # the norm must cover every rank's shard
                self.model.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            total += loss.item()
            if step == 0:
                self._maybe_kill_for_test(epoch)
        return total / len(self.loader)

    def _settle_ddp_buckets(self) -> None:
        """One backward that changes nothing, so that every step of every run reduces
        its gradients in the same buckets.

        DDP reduces its first backward in one bucket of every gradient, then rebuilds
        its buckets in the order the gradients came. Gloo (and NCCL) at 3 or more ranks
        sums a buffer in an order that depends on where it is cut, so the first step
        after a resume (one bucket) would sum other than the same step of a run that
        never stopped (rebuilt buckets): a resume off by a few ulps. After this backward
        every real step, the first of a fresh run and of a resumed one alike, runs with
        the rebuilt buckets, and DDP keeps overlapping their reductions with backward.
        Nothing else moves: no optimizer step, the gradients dropped, the RNG streams
        put back (dropout draws from them), no batch drawn from the sampler.
        """
        from torch.utils.data import default_collate

        inputs, targets = default_collate([self.loader.dataset[0]])
        devices = [self.device] if self.device.type == "cuda" else []
        python_rng = random.getstate()
        self.model.train()
        with torch.random.fork_rng(devices=devices):
            self.model(inputs.to(self.device), targets.to(self.device)).backward()
        random.setstate(python_rng)
        self.optimizer.zero_grad(set_to_none=True)

    def _maybe_kill_for_test(self, epoch: int) -> None:
        """Test hook: rank 1 dies once in epoch N, so torchrun --max-restarts restarts us."""
        if self.rank != 1 or os.environ.get(KILL_AT_EPOCH_ENV) != str(epoch):
            return
        once = self.snapshot_dir / f".killed-at-ep{epoch}"
        if not once.exists():
            once.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def _snapshot_state(self, epoch: int) -> dict:
        rng = get_rng_state(self.device)  # first: nothing below may move the RNG
        if isinstance(self.model, DDP):
            return {
                "MODEL_STATE": self.model.state_dict(),
                "OPTIMIZER_STATE": self.optimizer.state_dict(),
                "SCHEDULER_STATE": self.scheduler.state_dict(),
                "EPOCHS_RUN": epoch + 1,
                "RNG": rng,
                "CONFIG": self.config,
            }
        with FSDP.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            model_state = self.model.state_dict()
            optim_state = FSDP.optim_state_dict(self.model, self.optimizer)
        # Shards merge into one file later (ckpttool merge), so every rank's file carries
        # every rank's RNG, indexed by rank, as Composer does.
        all_rng = [None] * self.world_size
        dist.all_gather_object(all_rng, rng)
        if self.args.save_format == "dcp":
            return {
                "model": model_state,
                "optimizer": optim_state,
                "scheduler": self.scheduler.state_dict(),
                "epoch": epoch + 1,
                "rng": all_rng,
                "config": self.config,
            }
        steps = (epoch + 1) * len(self.loader)
        return {
            "state": {
                "model": model_state,
                "optimizers": {type(self.optimizer).__name__: optim_state},
                "schedulers": {type(self.scheduler).__name__: self.scheduler.state_dict()},
                "timestamp": {
                    "epoch": epoch + 1,
                    "batch": steps,
                    "sample": steps * self.args.batch_size * self.world_size,
                    "batch_in_epoch": 0,
                },
                "config": self.config,
            },
            "rng": all_rng,
        }

    def _save_snapshot(self, epoch: int) -> None:
        state = self._snapshot_state(epoch)
        fmt = self.args.save_format
        die = os.environ.get(DIE_DURING_SAVE_ENV) == str(epoch) and self.rank == 1
        marker = self.snapshot_dir / COMPLETE_MARKER.format(epoch=epoch)
        if self.rank == 0:
            # Overwriting epoch E (say after --resume none): drop its marker first, so a
            # half-rewritten snapshot is never mistaken for a complete one.
            marker.unlink(missing_ok=True)
            if fmt == "dcp":
                shutil.rmtree(
                    self.snapshot_dir / SNAPSHOT_DIR.format(epoch=epoch), ignore_errors=True
                )
        dist.barrier()

        if fmt == "dcp":
            folder = self.snapshot_dir / SNAPSHOT_DIR.format(epoch=epoch)
            dcp.save(state, checkpoint_id=folder)  # collective; every rank writes its chunks
            if die:
                os.kill(os.getpid(), signal.SIGKILL)  # folder written, marker never
            parts = [folder.name]
        else:
            path = self.snapshot_dir / SNAPSHOT_FILE.format(epoch=epoch, rank=self.rank)
            atomic_write(path, lambda f: torch.save(state, f), die_half_way=die)
            parts = [SNAPSHOT_FILE.format(epoch=epoch, rank=r) for r in range(self.world_size)]
        dist.barrier()  # every rank's part is on disk before the marker says so

        if self.rank == 0:
            write_complete_marker(self.snapshot_dir, epoch, fmt, self.world_size, parts)
        # epochs are numbered from 0 in logs as in file names: "epoch 0" is saved as ep0-*
        log(f"epoch {epoch} | saved snapshot {self.snapshot_dir / parts[0]}")

    def train(self) -> None:
        total = self.args.epochs
        if self.epochs_run >= total:
            log(f"nothing to do: {self.epochs_run} of {total} epochs already run")
        elif isinstance(self.model, DDP):
            self._settle_ddp_buckets()
        # Continue with the epoch after the snapshot; never re-train the saved one.
        for epoch in range(self.epochs_run, total):
            start = time.perf_counter()
            loss = self._run_epoch(epoch)
            log(
                f"epoch {epoch} ({epoch + 1} of {total}) | steps {len(self.loader)} | "
                f"loss {loss:.4f} | "
                f"lr {self.scheduler.get_last_lr()[0]:.2e} | {time.perf_counter() - start:.2f}s"
            )
            if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == total:
                self._save_snapshot(epoch)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        # every option's default in --help, the way `torchrun --help` shows them
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example: torchrun --standalone --nproc_per_node=2 trainers/ddp_trainer.py "
        "--epochs 4 --snapshot-dir runs/demo. After epoch E (numbered from 0, in the "
        "logs too) it writes ep{E}-rank{R}.pt, or the folder ep{E}/ for --save-format dcp.",
    )
    p.add_argument("--epochs", type=int, default=10, help="total epochs, also when resuming")
    p.add_argument("--save-every", type=int, default=1, help="snapshot every N epochs")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--snapshot-dir", default="runs/demo", help="where snapshots go")
    p.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="auto: nccl with CUDA, else gloo",
    )
    p.add_argument(
        "--save-format",
        choices=["ddp", "sharded", "dcp"],
        default="ddp",
        help="ddp: one full file per rank; sharded: ShardedTensor per rank; dcp: a folder",
    )
    p.add_argument(
        "--resume",
        default="auto",
        help="auto (newest complete snapshot in --snapshot-dir), none, or a PATH",
    )
    p.add_argument("--seed", type=int, default=0, help="data order and initial weights")
    p.add_argument("--model", choices=["gpt", "mlp"], default="gpt", help="what to train")
    p.add_argument("--dim", type=int, default=32, help="model width (even, for 2 heads)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (gpt)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument(
        "--lr-schedule-reset",
        action="store_true",
        help="resuming a snapshot whose schedule cannot be carried over by samples seen: "
        "restart the schedule instead of refusing",
    )
    p.add_argument(
        "--lr-decay-epochs",
        type=int,
        default=10,
        help="cosine decay horizon; independent of --epochs so resuming is exact",
    )
    args = p.parse_args(argv)
    if args.save_every < 1 or args.epochs < 1:
        p.error("--epochs and --save-every must be at least 1")
    return args


@record  # a failing rank's traceback goes into torchrun's error summary
def main() -> None:
    args = parse_args()
    launcher = exit_with_launcher() if "LOCAL_RANK" in os.environ else 0
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if os.environ.get(KILL_AT_EPOCH_ENV) and restarted and os.environ.get("RANK") == "1":
        # Test hook: the killed rank comes back late, as a slow node would, so its peers
        # reach the store first. This is what used to hang restarts (see setup()).
        time.sleep(2)
    device = setup(args.backend)
    try:
        Trainer(args, device, launcher).train()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
