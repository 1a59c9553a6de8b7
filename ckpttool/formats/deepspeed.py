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
import os
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CkptError
from ..tree import Checkpoint, Opaque, TensorRef, is_tensor
from ..unpickler import split_seen
from .deepspeed_flat import Piece, as_float32, rebuild, split_run

FORMAT = "deepspeed"
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
UNIVERSAL_DIR = "zero"  # ds_to_universal's zero/<param name>/fp32.pt, exp_avg.pt, ...
# keys of a rank's optimizer_state_dict (see deepspeed/checkpoint/constants.py)
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FLAT_GROUPS = {3: "fp32_flat_groups"}  # ZeRO-1/2 and the bf16 optimizer:
PARTITIONED_GROUPS = "single_partition_of_fp32_groups"
BASE_STATE = {3: "optimizer_state_dict"}  # ZeRO-1/2:
BASE_OPTIMIZER_STATE = "base_optimizer_state"
# per-rank layout bookkeeping: meaningless once the partitions are rebuilt
RANK_LAYOUT_KEYS = frozenset({"param_slice_mappings", "ds_zero_partition_groups"})


def detect(path: str, head: bytes) -> bool:
    """A tag folder with ZeRO optimizer states, or a universal checkpoint folder."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if any(OPTIM_STATES.match(n) for n in names):
        return True
    return os.path.isdir(os.path.join(path, UNIVERSAL_DIR)) and any(
        MODEL_STATES.match(n) for n in names
    )


def read(path: str, *, permissive: bool = False) -> Checkpoint:
    """Read a ZeRO tag folder or a universal checkpoint folder lazily.

    Raises:
        CkptError: Model-parallel ranks, a missing rank's file, or partitions that do not
            hold the parameters the model states record.
    """
    names = os.listdir(path)
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
    if not optim_files:
        from .deepspeed_universal import read_universal

        return read_universal(reader, model_files)
    return reader.read_zero(model_files, optim_files)


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

        path = os.path.join(self.folder, name)
        if not os.path.isfile(path):
            raise CkptError(f"missing: {what} (incomplete checkpoint?)", path=path)
        self.files.append(path)
        with open(path, "rb") as f:
            is_zip = f.read(4) == ZIP_MAGIC
        if not is_zip:
            ckpt = read_legacy(path, permissive=self.permissive)
            self.seen.update(ckpt.globals)
            return ckpt.root
        with ZipPickle(path) as archive:
            return archive.load(permissive=self.permissive, seen=self.seen)

    def checkpoint(self, root: Any, world_size: int | None) -> Checkpoint:
        globals_, dangerous = split_seen(self.seen)
        # the model states first: what a reader of one file would be pointed at
        files = sorted(self.files, key=lambda p: not MODEL_STATES.match(os.path.basename(p)))
        return Checkpoint(
            format=FORMAT,
            files=files,
            root=root,
            world_size=world_size,
            globals=globals_,
            dangerous=dangerous,
        )

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
                path=os.path.join(self.folder, optim_files[(extra[0], 0)]),
            )
        dicts = [_optimizer_dict(o, f"rank {r}") for r, o in enumerate(optim)]
        _, states = self.model_states(model_files, 0, stage)
        if not isinstance(states, Mapping):
            raise CkptError("model states are not a dict", path=self.files[1])
        try:
            zero = ZeroLayout(stage, world, dicts, _param_shapes(states))
            module, optimizer = zero.rebuild()
        except CkptError as exc:  # name the folder whose files do not fit together
            if exc.path is not None:
                raise
            raise CkptError(exc.message, path=self.folder, hint=exc.hint) from None
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
        shapes = states.get("frozen_param_shapes") or {}
        fragments = [states.get("frozen_param_fragments") or {}]
        if stage == 3 and shapes:
            fragments += [self.model_states(model_files, r, 3)[1] for r in range(1, world)]
            fragments[1:] = [s.get("frozen_param_fragments") or {} for s in fragments[1:]]
        out = {}
        for name, shape in shapes.items():
            shape = tuple(shape)
            frags = [f.get(name) for f in fragments]
            if not all(isinstance(f, TensorRef) for f in frags):
                raise CkptError(f"frozen parameter {name!r}: no fragment in the model states")
            if stage != 3:
                if tuple(frags[0].shape) != shape:
                    raise CkptError(f"frozen parameter {name!r}: shape {list(frags[0].shape)}")
                out[name] = frags[0]
                continue
            numel, part = math.prod(shape), math.ceil(math.prod(shape) / world)
            pieces = [
                Piece(r, f, 0, max(0, min(part, numel - r * part))) for r, f in enumerate(frags)
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


def int_value(value: Any) -> int | None:
    """An int, or the int an enum member stands for (``ZeroStageEnum(3)``, read inert)."""
    if isinstance(value, Opaque) and len(getattr(value, "args", ())) == 1:
        value = value.args[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
    counts = [int_value(c) for c in (count if isinstance(count, (list, tuple)) else [count])]
    if not counts or any(c is None or c < 1 for c in counts) or max(counts) > 1 << 20:
        raise CkptError(f"{where}: corrupt partition_count {count!r}")
    return max(counts)  # type: ignore[type-var]


def _param_shapes(states: Mapping) -> list[dict[str, tuple]]:
    """The trainable parameters per group, in flat order (``param_shapes``)."""
    groups = states.get("param_shapes")
    groups = [groups] if isinstance(groups, Mapping) else groups
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CkptError("the model states hold no param_shapes (not a ZeRO checkpoint?)")
    out = []
    for group in groups:
        shapes = {}
        for name, shape in group.items():
            if not isinstance(shape, (tuple, list)) or not all(
                isinstance(d, int) and d >= 0 for d in shape
            ):
                raise CkptError(f"corrupt param_shapes entry for {name!r}: {shape!r}")
            shapes[str(name)] = tuple(shape)
        out.append(shapes)
    return out


def _untracked(states: Mapping, params: Mapping) -> dict[str, Any]:
    """Stored tensors of the model that are neither buffers, trained nor tied parameters:
    frozen ones where the model states record none (zero_to_fp32 drops them there)."""
    stored = states.get("module")
    if not isinstance(stored, Mapping):
        return {}
    skip = {*(states.get("buffer_names") or ()), *params}
    shared = states.get("shared_params")
    skip.update(shared if isinstance(shared, Mapping) else ())
    return {
        k: v
        for k, v in stored.items()
        if k not in skip and isinstance(v, TensorRef) and v.storage is not None and v.numel
    }


def assemble(states: Mapping, params: Mapping, frozen: Mapping) -> dict[str, Any]:
    """The state dict zero_to_fp32 gives: buffers (floating ones as fp32), frozen and
    trainable parameters, and tied names pointing at the same tensor; in the order of
    the stored model's state dict."""
    stored = states.get("module") if isinstance(states.get("module"), Mapping) else {}
    buffer_names = states.get("buffer_names") or []
    found: dict[str, Any] = {}
    for name in buffer_names:
        if is_tensor(stored.get(name)):
            found[name] = as_float32(stored[name])
    found.update(frozen)
    found.update(params)
    shared = states.get("shared_params") or {}
    for alias, source in shared.items() if isinstance(shared, Mapping) else ():
        if source in found:
            found[alias] = found[source]
    order = [k for k in stored if k in found] + [k for k in found if k not in stored]
    return {k: found[k] for k in order}


class ZeroLayout:
    """Where each parameter's elements lie in the ranks' flat partitions."""

    def __init__(self, stage: int, world: int, dicts: list[Mapping], shapes: list[dict]):
        self.stage, self.world, self.dicts, self.shapes = stage, world, dicts, shapes
        key = FLAT_GROUPS.get(stage, PARTITIONED_GROUPS)
        self.flats = []
        for rank, osd in enumerate(dicts):
            groups = osd.get(key)
            if not isinstance(groups, list) or not all(isinstance(g, TensorRef) for g in groups):
                raise CkptError(f"ZeRO optimizer states of rank {rank} hold no {key}")
            self.flats.append(groups)
        if len({len(g) for g in self.flats}) != 1:
            raise CkptError("the ranks' optimizer states hold different numbers of groups")
        self.bases = [_base_state(osd, stage) for osd in dicts]

    def rebuild(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(fp32 parameters by name, the optimizer state by parameter name)."""
        places = self._places_z3() if self.stage == 3 else self._places_z12()
        params, state, members = {}, {}, [[] for _ in self.flats[0]]
        for name, (shape, group, pieces) in places.items():
            params[name] = rebuild(name, shape, pieces(self.flats), self.world)
            members[group].append(name)
            state[name] = self._moments(name, shape, group, pieces)
        groups = self._param_groups(members)
        extra = {
            k: (int_value(v) if k == "zero_stage" else v)
            for k, v in self.dicts[0].items()
            if k not in RANK_LAYOUT_KEYS
            and k not in (FLAT_GROUPS.get(self.stage, PARTITIONED_GROUPS))
            and k not in (BASE_STATE.get(self.stage, BASE_OPTIMIZER_STATE),)
        }
        return params, {"state": state, "param_groups": groups, **extra}

    def _places_z12(self) -> dict:
        """ZeRO-1/2: each group is one flat buffer, params one after another (each followed
        by its alignment padding), cut into equal partitions, one per rank."""
        paddings = self.dicts[0].get("param_alignment_paddings")
        places = {}
        for g, shapes in enumerate(self.shapes):
            if g >= len(self.flats[0]):
                raise CkptError(f"param_shapes has group {g}, the optimizer states do not")
            lengths = [flats[g].numel for flats in self.flats]
            pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
            if pads is not None and len(pads) != len(shapes):
                raise CkptError(f"group {g}: {len(pads)} alignment paddings for {len(shapes)}")
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                places[name] = (shape, g, _z12_pieces(g, lengths, offset, numel, name))
                offset += numel + (int_value(pads[i]) or 0 if pads is not None else 0)
            align = 2 * self.world  # zero_to_fp32's check: all but the tail padding used
            if math.ceil(offset / align) != math.ceil(sum(lengths) / align):
                raise CkptError(
                    f"group {g}: the parameters take {offset} elements, the partitions hold "
                    f"{sum(lengths)} (param_shapes and optimizer states do not match)"
                )
        return places

    def _places_z3(self) -> dict:
        """ZeRO-3: each parameter is padded to a multiple of the world size and cut into
        equal parts, one per rank; a rank's part of every parameter, one after another,
        makes its flat groups."""
        lengths = [flat.numel for flat in self.flats[0]]
        for rank, flats in enumerate(self.flats):
            if [f.numel for f in flats] != lengths:
                raise CkptError(f"rank {rank}'s flat groups differ in size from rank 0's")
        starts = [sum(lengths[:k]) for k in range(len(lengths))]
        places, offset = {}, 0
        for shapes in self.shapes:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / self.world)
                group = max([k for k, s in enumerate(starts) if s <= offset] or [0])
                places[name] = (shape, group, _z3_pieces(lengths, offset, numel, part, name))
                offset += part
        if offset != sum(lengths):
            raise CkptError(
                f"the parameters take {offset} elements of each rank's partitions, which "
                f"hold {sum(lengths)} (param_shapes and optimizer states do not match)"
            )
        return places

    def _moments(self, name: str, shape: tuple, group: int, pieces: Any) -> dict[str, Any]:
        """The optimizer's state of one parameter: its flat per-group tensors (exp_avg,
        exp_avg_sq) rebuilt like the weights; the rest (step) as rank 0 holds it."""
        first = self.bases[0][1](group)
        out = {}
        for key, value in first.items():
            if not (isinstance(value, TensorRef) and len(value.shape) == 1 and value.numel > 1):
                out[key] = value
                continue
            moment = []
            for rank, (_, state_of) in enumerate(self.bases):
                groups = list(self.flats[rank])
                for k in range(len(groups)):
                    tensor = state_of(k).get(key)
                    if not isinstance(tensor, TensorRef):
                        raise CkptError(f"rank {rank}: optimizer state {key!r} of group {k}")
                    groups[k] = tensor
                moment.append(groups)
            out[key] = rebuild(f"{name}.{key}", shape, pieces(moment), self.world)
        return out

    def _param_groups(self, members: list[list[str]]) -> list[Any]:
        groups = self.bases[0][0]
        if not isinstance(groups, list):
            return [{"params": names} for names in members]
        out = []
        for k, group in enumerate(groups):
            group = dict(group) if isinstance(group, Mapping) else {"group": group}
            group["params"] = members[k] if k < len(members) else []
            out.append(group)
        return out


def _base_state(osd: Mapping, stage: int) -> tuple[Any, Any]:
    """(param_groups or None, function: flat group index -> its optimizer state dict).

    ZeRO-1/2 save the base optimizer's ``state_dict()`` (one flat parameter per group),
    or, with elastic checkpoints, a list of per-group states."""
    base = osd.get(BASE_STATE.get(stage, BASE_OPTIMIZER_STATE))
    if isinstance(base, list):
        return None, lambda k: base[k] if k < len(base) and isinstance(base[k], Mapping) else {}
    if not isinstance(base, Mapping) or not isinstance(base.get("state"), Mapping):
        raise CkptError("ZeRO optimizer states hold no base optimizer state")
    groups = base.get("param_groups")
    state = base["state"]

    def state_of(k: int) -> Mapping:
        index = k
        if isinstance(groups, list) and k < len(groups) and isinstance(groups[k], Mapping):
            params = groups[k].get("params")
            if isinstance(params, list) and len(params) == 1:
                index = params[0]
        found = state.get(index)
        return found if isinstance(found, Mapping) else {}

    return groups, state_of


def _z12_pieces(group: int, lengths: list[int], start: int, numel: int, name: str) -> Any:
    def pieces(flats: list[list[TensorRef]]) -> list[Piece]:
        stream = [(r, flats[r][group], n) for r, n in enumerate(lengths)]
        return split_run(stream, start, numel, name)

    return pieces


def _z3_pieces(lengths: list[int], offset: int, numel: int, part: int, name: str) -> Any:
    def pieces(flats: list[list[TensorRef]]) -> list[Piece]:
        out: list[Piece] = []
        for rank, groups in enumerate(flats):
            count = max(0, min(part, numel - rank * part))
            stream = [(rank, flat, n) for flat, n in zip(groups, lengths, strict=True)]
            out += split_run(stream, offset, count, name)
        return out

    return pieces
