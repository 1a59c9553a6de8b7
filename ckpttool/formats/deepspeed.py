"""``deepspeed``: a DeepSpeed ZeRO checkpoint folder, rebuilt as ``zero_to_fp32`` does.

A tag folder (``global_stepN/``) holds the model states (``mp_rank_00_model_states.pt``;
ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank, holding empty
placeholders) beside each data-parallel rank's ``zero_pp_rank_R_mp_rank_00_optim_states.pt``
(``bf16_``-prefixed from the bf16 optimizer), whose flat fp32 partitions are the master
weights and whose base optimizer state holds the moments in the same flat layout.

The tree read here::

    {"module": the fp32 state dict zero_to_fp32 gives (buffers, frozen and tied params),
     "optimizer": {"state": {name: {"step", "exp_avg", "exp_avg_sq"}},
                   "param_groups": [... "params": [names]], "zero_stage", ...},
     "model_states": rank 0's model states as stored}

Nothing is imported from deepspeed: every file goes through the restricted unpickler,
and every rebuilt tensor is a lazy view of the partitions (see :mod:`.deepspeed_flat`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from .. import sources
from ..errors import CkptError, UnsafeError
from ..torch_values import check_shape
from ..tree import Checkpoint, ShardedRef, TensorRef, is_tensor
from . import torch_zip
from .deepspeed_flat import Piece, as_float32, rebuild
from .deepspeed_zero import OPTIMIZER_STATE_DICT, PARTITIONED_GROUPS, ZeroLayout, int_value

FORMAT = "deepspeed"
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
UNIVERSAL_DIR = "zero"  # ds_to_universal's zero/<param name>/fp32.pt, exp_avg.pt, ...


def detect(path: str, head: bytes) -> bool:
    """A tag folder (ZeRO optimizer states, or stage 0's model states alone), or a
    universal checkpoint folder."""
    if not sources.isdir(path):
        return False
    return any(OPTIM_STATES.match(n) or MODEL_STATES.match(n) for n in sources.listdir(path))


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    """Read a ZeRO tag folder or a universal checkpoint folder lazily.

    Raises:
        CkptError: Model-parallel ranks, a missing rank's file, or partitions that do not
            hold the parameters the model states record.
    """
    try:
        return _read(path, permissive)
    except UnsafeError:
        raise
    except CkptError as exc:  # name the folder whose files do not fit together
        if exc.path is not None:
            raise
        raise CkptError(exc.message, path=path, hint=exc.hint) from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        # the checks above cover what DeepSpeed writes; a hostile file that slips past
        # them still gets one line, never a traceback
        raise CkptError(f"corrupt DeepSpeed checkpoint ({type(exc).__name__})", path=path) from None


def _read(path: str, permissive: bool) -> Checkpoint:
    names = sources.listdir(path)
    model_files = {}
    for name in names:
        if m := MODEL_STATES.match(name):
            model_files[(int(m.group(1) or 0), int(m.group(2)))] = name
    optim_files = {}
    for name in names:
        if m := OPTIM_STATES.match(name):
            optim_files[(int(m.group(2)), int(m.group(3)))] = name
    if any(mp for _, mp in (*model_files, *optim_files)):
        raise CkptError(
            "DeepSpeed model states of several model-parallel ranks: each holds its "
            "own slices of the tensors, and nothing in them says how they fit",
            path=path,
            hint="pass one mp_rank_XX_model_states.pt to read it alone",
        )
    reader = Reader(path, permissive)
    if optim_files:
        return reader.read_zero(model_files, optim_files)
    if sources.isdir(sources.join(path, UNIVERSAL_DIR)):
        from .deepspeed_universal import read_universal

        return read_universal(reader, model_files)
    # ZeRO stage 0: the model states hold the weights and the optimizer whole
    _, states = reader.model_states(model_files, 0, None)
    return reader.checkpoint(states, None)


class Reader:
    """One folder's files read through the restricted unpickler, their globals pooled."""

    def __init__(self, folder: str, permissive: bool):
        self.folder = folder
        self.permissive = permissive
        self.seen: set[str] = set()
        self.files: list[str] = []

    def load(self, name: str, what: str) -> Any:
        """The unpickled root of ``name`` in the folder; a missing one is named."""
        from .torch_legacy import read as read_legacy
        from .zip_pickle import ZIP_MAGIC, ZipPickle

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
        return torch_zip.checkpoint(FORMAT, files, root, self.seen, world_size)

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
        zero = ZeroLayout(stage, world, dicts, _param_shapes(states))
        module, optimizer = zero.rebuild()
        frozen = self.frozen(states, model_files, stage, world)
        if stage != 3:  # ZeRO-1 records no frozen_param_shapes: its module holds them whole
            frozen = {**_untracked(states, module), **frozen}
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
            shape = _shape(name, shape)
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


def mapping(value: Any) -> Mapping:
    """``value`` if it is a mapping, else an empty one (a field a file left out or garbled)."""
    return value if isinstance(value, Mapping) else {}


def _shape(name: Any, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, int) and d >= 0 for d in shape
    ):
        raise CkptError(f"corrupt shape recorded for {name!r}: {shape!r:.80}")
    check_shape(tuple(shape))  # (its element count feeds the partition arithmetic)
    return tuple(shape)


def _param_shapes(states: Mapping) -> list[dict[str, tuple]]:
    """The trainable parameters per group, in flat order (``param_shapes``)."""
    groups = states.get("param_shapes")
    groups = [groups] if isinstance(groups, Mapping) else groups
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CkptError("the model states hold no param_shapes (not a ZeRO checkpoint?)")
    out = []
    for group in groups:
        out.append({str(name): _shape(name, shape) for name, shape in group.items()})
    return out


def _untracked(states: Mapping, params: Mapping) -> dict[str, Any]:
    """Stored tensors of the model that are neither buffers, trained nor tied parameters:
    frozen ones where the model states record none (zero_to_fp32 drops them there)."""
    stored = states.get("module")
    if not isinstance(stored, Mapping):
        return {}
    skip = {*_names(states.get("buffer_names")), *params, *mapping(states.get("shared_params"))}
    return {
        k: v
        for k, v in stored.items()
        if k not in skip and isinstance(v, TensorRef) and v.storage is not None and v.numel
    }


def _names(value: Any) -> list[str]:
    return [n for n in value if isinstance(n, str)] if isinstance(value, (list, tuple)) else []


def assemble(states: Mapping, params: Mapping, frozen: Mapping) -> dict[str, Any]:
    """The state dict zero_to_fp32 gives: buffers (floating ones as fp32), frozen and
    trainable parameters, and tied names pointing at the same tensor; in the order of
    the stored model's state dict."""
    stored = mapping(states.get("module"))
    found: dict[str, Any] = {}
    for name in _names(states.get("buffer_names")):
        if is_tensor(stored.get(name)):
            found[name] = as_float32(stored[name])
    found.update(frozen)
    found.update(params)
    for alias, source in mapping(states.get("shared_params")).items():
        if isinstance(source, str) and source in found:
            found[alias] = found[source]
    order = [k for k in stored if k in found] + [k for k in found if k not in stored]
    return {k: found[k] for k in order}
