"""Where each parameter lies in the flat partitions of a DeepSpeed ZeRO tag folder.

ZeRO-1/2 flatten each param group (each parameter followed by its alignment padding,
the group padded to a multiple of 2 * world size) and give each rank an equal slice;
ZeRO-3 pads each parameter to a multiple of the world size and gives each rank an equal
part of every parameter. The optimizer's moments share the layout of the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...errors import CkptError
from ...tree import Opaque, TensorRef
from .flat import Piece, rebuild, split_run

# keys of a rank's optimizer_state_dict (see deepspeed/checkpoint/constants.py)
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FLAT_GROUPS = {3: "fp32_flat_groups"}  # ZeRO-1/2 and the bf16 optimizer:
PARTITIONED_GROUPS = "single_partition_of_fp32_groups"
BASE_STATE = {3: "optimizer_state_dict"}  # ZeRO-1/2:
BASE_OPTIMIZER_STATE = "base_optimizer_state"
# per-rank layout bookkeeping: meaningless once the partitions are rebuilt
RANK_LAYOUT_KEYS = frozenset({"param_slice_mappings", "ds_zero_partition_groups"})


def int_value(value: Any) -> int | None:
    """An int, or the int an enum member stands for (``ZeroStageEnum(3)``, read inert)."""
    if isinstance(value, Opaque) and len(getattr(value, "args", ())) == 1:
        value = value.args[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
        params: dict[str, Any] = {}
        state: dict[str, Any] = {}
        members: list[list[str]] = [[] for _ in self.flats[0]]  # parameter names per group
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
