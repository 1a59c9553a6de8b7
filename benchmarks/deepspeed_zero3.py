"""Benchmark: a ~2 GB DeepSpeed ZeRO-3 checkpoint (2 ranks) merged to safetensors.

    .venv/bin/python benchmarks/deepspeed_zero3.py                 # full scale, ~2 GiB
    .venv/bin/python benchmarks/deepspeed_zero3.py --scale 0.05    # quick run
    .venv/bin/python benchmarks/deepspeed_zero3.py \
        --deepspeed-python /tmp/ds-venv/bin/python                 # + DeepSpeed's zero_to_fp32

The input is written with plain ``torch.save`` in DeepSpeed's ZeRO-3 layout (what
``engine.save_checkpoint`` writes; see fixtures/make_deepspeed_fixtures.py for the real
thing): a GPT-2-like model (hidden 1024, largest tensor the 64 MiB embedding) whose fp32
masters and Adam moments are partitioned over 2 ranks, each parameter padded to a
multiple of 2, beside bf16 model states holding empty placeholders. Measured in the
same run, warm, median of ``--repeat``: ``ckpttool convert --to safetensors`` (the fp32
weights), ``ckpttool merge`` (the whole state, moments per name), ``cp -r`` of the tag
folder (+ fsync) as the floor, and DeepSpeed's own ``convert_zero_checkpoint_to_fp32_
state_dict(..., safe_serialization=True)`` where an interpreter with deepspeed is given
(deepspeed is never a dependency of ckpttool). Targets (issue 18): convert at most 2x
``cp -r``, peak RSS at most 512 MiB plus the largest tensor.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from cases import CP_R_FSYNC, ckpttool_command
from measure import CommandFailed, MiB, child_env, measure, rss_source
from shapes import ADAM_HYPERPARAMS, fill, largest_tensor_bytes, transformer_params

REPO = Path(__file__).resolve().parent.parent
WORLD = 2
TAG = "global_step10"
FULL_BYTES = 2 << 30  # the checkpoint: masters + exp_avg + exp_avg_sq
ZERO_TO_FP32 = (
    "import sys; from deepspeed.utils.zero_to_fp32 import "
    "convert_zero_checkpoint_to_fp32_state_dict as convert; "
    "convert(sys.argv[1], sys.argv[2], safe_serialization=True)"
)


def generate(run: Path, model_bytes: int) -> None:
    """Write ``run/`` (``latest`` -> ``TAG/``) once; a marker file records it is complete."""
    import torch

    done = run / ".done"
    if done.exists() and done.read_text() == str(model_bytes):
        return
    tag = run / TAG
    tag.mkdir(parents=True, exist_ok=True)
    params = transformer_params(model_bytes)
    shapes = {name: torch.Size(shape) for name, shape in params}
    for rank in range(WORLD):
        flats = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
        for name, shape in params:
            numel = math.prod(shape)
            part = math.ceil(numel / WORLD)
            for key in flats:
                full = fill(shape, key, name, positive=key == "exp_avg_sq").reshape(-1)
                piece = full[rank * part : (rank + 1) * part]
                flats[key].append(torch.cat([piece, piece.new_zeros(part - piece.numel())]))
                del full
        flat = {key: torch.cat(values) for key, values in flats.items()}
        del flats
        state = {0: {"step": torch.tensor(10.0), **{k: flat[k] for k in ("exp_avg", "exp_avg_sq")}}}
        osd = {
            "zero_stage": 3,
            "loss_scaler": None,
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": WORLD,
            "optimizer_state_dict": {
                "state": state,
                "param_groups": [{**ADAM_HYPERPARAMS, "params": [0]}],
            },
            "fp32_flat_groups": [flat["fp32"]],
        }
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": osd, "ds_version": "0.19.8"}, tag / name)
        del flat, state, osd
        placeholders = {n: torch.empty(0, dtype=torch.bfloat16) for n, _ in params}
        states = {
            "module": placeholders,
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": [shapes],
            "frozen_param_shapes": None,
            "shared_params": {},
            "frozen_param_fragments": None,
            "global_steps": 10,
            "dp_world_size": WORLD,
            "mp_world_size": 1,
            "ds_version": "0.19.8",
        }
        torch.save(states, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    (run / "latest").write_text(TAG)
    done.write_text(str(model_bytes))


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-data" / "deepspeed")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--deepspeed-python", help="an interpreter with deepspeed installed")
    args = parser.parse_args(argv)

    model_bytes = int(FULL_BYTES * args.scale / 3)
    run = args.workdir / f"scale-{args.scale:g}"
    print(f"generating {run} ...", file=sys.stderr, flush=True)
    generate(run, model_bytes)
    out = args.workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(args.workdir / "pycache")
    tool = ckpttool_command()
    largest = largest_tensor_bytes(model_bytes)
    commands = {
        "ckpttool convert --to safetensors": (
            [*tool, "convert", str(run), "--to", "safetensors", "-o", str(out / "m.safetensors")],
            [out / "m.safetensors"],
        ),
        "ckpttool merge (whole state)": (
            [*tool, "merge", str(run), "-o", str(out / "merged.pt"), "--quiet"],
            [out / "merged.pt"],
        ),
        "cp -r (tag folder, fsync)": (
            ["sh", "-c", CP_R_FSYNC, "sh", str(run / TAG), str(out / "copy")],
            [out / "copy"],
        ),
    }
    if args.deepspeed_python:
        commands["deepspeed zero_to_fp32 (safetensors)"] = (
            [args.deepspeed_python, "-c", ZERO_TO_FP32, str(run), str(out / "ds")],
            [out / "ds"],
        )
    results = {}
    for label, (cmd, outputs) in commands.items():
        print(f"measuring {label} ...", file=sys.stderr, flush=True)
        try:
            results[label] = measure(
                cmd, outputs=outputs, warmup=args.warmup, repeat=args.repeat, env=env
            )
        except CommandFailed as exc:
            print(f"FAILED {label}: {exc}", file=sys.stderr)
            return 1
    size = folder_bytes(run / TAG)
    floor = results["cp -r (tag folder, fsync)"].wall
    print(
        f"\ninput {size / (1 << 30):.2f} GiB in {WORLD} ranks, largest tensor "
        f"{largest / MiB:.0f} MiB; median of {args.repeat}; peak RSS from {rss_source()}\n"
    )
    print("| command | wall | vs cp -r | peak RSS |")
    print("|---|---|---|---|")
    for label, m in results.items():
        print(f"| {label} | {m.wall:.2f} s | {m.wall / floor:.2f}x | {m.rss_mib:.0f} MiB |")
    convert = results["ckpttool convert --to safetensors"]
    ok = convert.wall <= 2 * floor and convert.rss_mib <= 512 + largest / MiB
    print(
        f"\ntarget (convert <= 2x cp -r, RSS <= {512 + largest // MiB} MiB): "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
