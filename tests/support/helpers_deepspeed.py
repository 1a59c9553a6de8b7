"""Tiny DeepSpeed ZeRO tag folders in DeepSpeed's layout, written with plain torch.save.

The real thing is in fixtures/deepspeed/ (written by DeepSpeed itself); these are for
what a test must vary: ranks, stages, missing files, int buffers, model-parallel ranks.
"""

from __future__ import annotations

import math

import torch


def write_zero_tag(folder, sd, *, stage=2, world=2, buffers=(), mp_ranks=1, seed=0):
    """Write ``sd`` as a ZeRO tag folder: fp32 masters (and Adam-like moments, the masters
    times 2 and 3) partitioned over ``world`` ranks, bf16 model states. Names in
    ``buffers`` are buffers; the rest are trainable parameters, in one group.

    Returns:
        {name: {"exp_avg": ..., "exp_avg_sq": ...}}: the moments each rank's files hold.
    """
    folder.mkdir(parents=True, exist_ok=True)
    params = {k: v.float() for k, v in sd.items() if k not in buffers}
    moments = {k: {"exp_avg": v * 2, "exp_avg_sq": v * 3} for k, v in params.items()}
    shapes = [{k: v.shape for k, v in params.items()}]

    def flats(values):
        if stage == 3:  # every parameter padded to a multiple of world, cut per rank
            per_rank = [[] for _ in range(world)]
            for v in values:
                flat = v.reshape(-1)
                part = math.ceil(flat.numel() / world)
                flat = torch.cat([flat, flat.new_zeros(part * world - flat.numel())])
                for r in range(world):
                    per_rank[r].append(flat[r * part : (r + 1) * part])
            return [torch.cat(p) for p in per_rank]
        flat = torch.cat([v.reshape(-1) for v in values])
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % (2 * world))])
        return [p.clone() for p in flat.chunk(world)]

    masters = flats(params.values())
    avg = flats([m["exp_avg"] for m in moments.values()])
    avg_sq = flats([m["exp_avg_sq"] for m in moments.values()])
    module = {
        k: (v.to(torch.bfloat16) if k not in buffers and stage != 3 else v) for k, v in sd.items()
    }
    if stage == 3:
        module = {k: (torch.empty(0) if k not in buffers else v) for k, v in module.items()}
    for mp in range(mp_ranks):
        states = {
            "module": module,
            "buffer_names": list(buffers),
            "param_shapes": shapes,
            "shared_params": {},
            "global_steps": 10,
            "ds_version": "0.19.8",
        }
        for rank in range(world if stage == 3 else 1):
            name = f"mp_rank_{mp:02d}_model_states.pt"
            torch.save(states, folder / (f"zero_pp_rank_{rank}_{name}" if stage == 3 else name))
        for rank in range(world):
            key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
            base = {
                "state": {
                    0: {
                        "step": torch.tensor(5.0),
                        "exp_avg": avg[rank].clone(),
                        "exp_avg_sq": avg_sq[rank].clone(),
                    }
                },
                "param_groups": [{"lr": 0.01, "weight_decay": 0.1, "params": [0]}],
            }
            osd = {
                "zero_stage": stage,
                "partition_count": world if stage == 3 else [world],
                key: [masters[rank].clone()],
                "optimizer_state_dict" if stage == 3 else "base_optimizer_state": base,
            }
            name = f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"
            torch.save({"optimizer_state_dict": osd, "ds_version": "0.19.8"}, folder / name)
    return moments
