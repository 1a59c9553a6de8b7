"""One DeepSpeed tag folder (``global_stepN/``): its model and optimizer states files
read through the restricted unpickler (their globals pooled), and the ZeRO partitions
rebuilt into the fp32 master weights and per-parameter optimizer state."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ... import sources
from ...errors import CkptError
from ...tree import Checkpoint, ShardedRef, TensorRef
from ..made import checkpoint
from .flat import Piece, rebuild
from .model_states import assemble, mapping, param_shape, param_shapes, untracked_params
from .zero import OPTIMIZER_STATE_DICT, PARTITIONED_GROUPS, ZeroLayout, int_value

FORMAT = "deepspeed"


OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


class TagFolder:
    """One folder's files read through the restricted unpickler, their globals pooled."""

    def __init__(self, folder: str, permissive: bool):
        self.folder = folder
        self.permissive = permissive
        self.seen: set[str] = set()
        self.files: list[str] = []

    def load(self, name: str, what: str) -> Any:
        """The unpickled root of ``name`` in the folder; a missing one is named."""
        from ..torch_save.legacy import read as read_legacy
        from ..torch_save.zip_pickle import ZIP_MAGIC, ZipPickle

        path = sources.child(self.folder, name, path=self.folder)
        if not sources.isfile(path):
            raise CkptError(f"missing: {what} (incomplete checkpoint?)", path=path)
        self.files.append(path)
        if sources.read_head(path, len(ZIP_MAGIC)) != ZIP_MAGIC:
            ckpt = read_legacy(path, permissive=self.permissive)
            self.seen.update(ckpt.globals)  # in split_seen's notation:
            self.seen.update("!" + g for g in ckpt.dangerous)
            self.seen.update("?" + g for g in ckpt.unverified)
            return ckpt.root
        with ZipPickle(path) as archive:
            return archive.load(permissive=self.permissive, seen=self.seen)

    def checkpoint(self, root: Any, world_size: int | None) -> Checkpoint:
        # the model states first: what a reader of one file would be pointed at
        files = sorted(self.files, key=lambda p: not MODEL_STATES.match(sources.basename(p)))
        return checkpoint(FORMAT, files, root, self.seen, world_size)

    def model_states(self, model_files: dict, rank: int, stage: int | None) -> tuple[str, Any]:
        """(file name, root) of a rank's model states: ZeRO-3 writes one per rank."""
        name = model_files.get((rank, 0))
        if name is None or (stage == 3 and not name.startswith("zero_pp_rank_")):
            plain = rank == 0 and stage != 3
            name = "mp_rank_00_model_states.pt" if plain else model_states_name(rank)
        return name, self.load(name, f"the model states of rank {rank}")

    def read_zero(self, model_files: dict, optim_files: dict) -> Checkpoint:
        first = optim_files.get((0, 0)) or optim_name(0, next(iter(optim_files.values())))
        optim = [self.load(first, "the optimizer states of rank 0")]
        head = _optimizer_dict(optim[0], first)
        stage = _stage(head)
        world = _world_size(head.get("partition_count"), first)
        for rank in range(1, world):
            name = optim_files.get((rank, 0), optim_name(rank, first))
            optim.append(self.load(name, f"the optimizer states of rank {rank} of {world}"))
        extra = sorted(r for r, _ in optim_files if r >= world)
        if extra:
            raise CkptError(
                f"optimizer states of rank {extra[0]}, but partition_count says {world} ranks "
                "(files of another run mixed in?)",
                path=sources.join(self.folder, optim_files[(extra[0], 0)]),
            )
        dicts = [_optimizer_dict(o, f"rank {r}") for r, o in enumerate(optim)]
        name, states = self.model_states(model_files, 0, stage)
        if not isinstance(states, Mapping):
            raise CkptError("model states are not a dict", path=sources.join(self.folder, name))
        zero = ZeroLayout(stage, world, dicts, param_shapes(states))
        module, optimizer = zero.rebuild()
        frozen = self.frozen(states, model_files, stage, world)
        if stage != 3:  # ZeRO-1 records no frozen_param_shapes: its module holds them whole
            frozen = {**untracked_params(states, module), **frozen}
        root = {
            "module": assemble(states, module, frozen),
            "optimizer": optimizer,
            "model_states": states,
        }
        return self.checkpoint(root, world)

    def frozen(self, states: Mapping, model_files: dict, stage: int, world: int) -> dict:
        """Frozen parameters, kept whole in the model states (ZeRO-3: one fragment per
        rank's model states, padded to the same length), in their stored dtype."""
        shapes = mapping(states.get("frozen_param_shapes"))
        fragments = [mapping(states.get("frozen_param_fragments"))]
        if stage == 3 and shapes:
            others = [self.model_states(model_files, r, 3)[1] for r in range(1, world)]
            fragments += [mapping(mapping(s).get("frozen_param_fragments")) for s in others]
        out: dict[str, TensorRef | ShardedRef] = {}
        for name, shape in shapes.items():
            shape = param_shape(name, shape)
            frags = [f.get(name) for f in fragments]
            refs = [f for f in frags if isinstance(f, TensorRef)]
            if len(refs) != len(frags):
                raise CkptError(f"frozen parameter {name!r}: no fragment in the model states")
            if stage != 3:
                if tuple(refs[0].shape) != shape:
                    raise CkptError(f"frozen parameter {name!r}: shape {list(refs[0].shape)}")
                out[name] = refs[0]
                continue
            numel, part = math.prod(shape), math.ceil(math.prod(shape) / world)
            pieces = [
                Piece(r, f, 0, max(0, min(part, numel - r * part))) for r, f in enumerate(refs)
            ]
            out[name] = rebuild(name, shape, pieces, world)
        return out


def optim_name(rank: int, like: str) -> str:
    """Rank ``rank``'s optimizer states file, named like another rank's (``bf16_`` or not)."""
    prefix = "bf16_" if like.startswith("bf16_") else ""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_states_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _optimizer_dict(root: Any, where: str) -> Mapping:
    osd = root.get(OPTIMIZER_STATE_DICT) if isinstance(root, Mapping) else None
    if not isinstance(osd, Mapping):
        raise CkptError(f"ZeRO optimizer states of {where} hold no optimizer_state_dict")
    return osd


def _stage(osd: Mapping) -> int:
    """ZeRO stage 1-3; the bf16 optimizer (no ``zero_stage``) lays its groups out as ZeRO-1."""
    if "zero_stage" not in osd and PARTITIONED_GROUPS in osd:
        return 1
    stage = int_value(osd.get("zero_stage"))
    if stage not in (1, 2, 3):
        raise CkptError(f"unsupported ZeRO stage {osd.get('zero_stage')!r}")
    return stage


def _world_size(count: Any, where: str) -> int:
    # ZeRO-2 records a count per group (expert groups may differ): the largest is the world
    values = [int_value(c) for c in (count if isinstance(count, (list, tuple)) else [count])]
    counts = [c for c in values if c is not None and c >= 1]
    if not counts or len(counts) != len(values) or max(counts) > 1 << 20:
        raise CkptError(f"{where}: corrupt partition_count {count!r}")
    return max(counts)
