"""A legacy Megatron-LM iteration folder split over tensor x pipeline (x virtual) ranks,
merged as the run's own layout places each slice.

``--ckpt-format torch`` (megatron/training/checkpointing.py: ``get_checkpoint_name``,
``generate_state_dict``) saves one ``torch.save`` a model-parallel rank:
``iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt``, ``mp_rank_TT_PPP/`` where the pipeline
has more than one stage. Each holds the run's ``args``, ``checkpoint_version``,
``iteration`` and that rank's ``model.state_dict_for_save_checkpoint()`` (``model0``,
``model1``, ... for its virtual pipeline stages), whose layers a stage numbers from 0.

The merged model is what the same run at one rank would save: each layer under its
global number, the layers of chunk ``(stage p, virtual stage v)`` following those of
every chunk before it in the order the pipeline runs them (v, then p: what
megatron-core's ``get_transformer_layer_offset`` gives, even or not), and each tensor
assembled from the tensor-parallel ranks by :data:`SPLITS`. Every slice stays a range
of its rank file's bytes (a sharded tensor of their blocks): nothing is read here.

Nothing is guessed: a name no rule of :data:`SPLITS` knows, a missing rank, a rank of
another iteration, shapes that differ where the rule says equal, or args the folders
contradict are refused, naming them. What is not model state (each rank's RNG state,
an optimizer's) is kept by rank as stored, under ``ranks``, never merged.
"""

from __future__ import annotations

import re
from typing import Any

from ... import sources
from ...errors import CkptError
from ...tree import (
    Checkpoint,
    Shard,
    ShardedRef,
    TensorRef,
    check_coverage,
    strided_rows,
    verdicts,
)
from ..torch_save import torch_zip
from .namespaces import namespaces_as_dicts

FORMAT = "megatron"
# mp_rank_TT, mp_rank_TT_PPP (pipeline), + _EEE (expert parallel)
RANK_FOLDER = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
RANK_FILES = ("model_optim_rng.pt", "model_rng.pt")
MODEL_KEY = "model"
CHUNK_KEY = re.compile(r"^model(\d+)$")  # a virtual pipeline stage's model
LAYER = re.compile(r"^(decoder\.layers\.|language_model\.encoder\.layers\.)(\d{1,9})\.(.*)$")
# checkpoint_version 2.0 and later keep QKV rows per query group, as they are merged here
QKV_VERSION = 2.0

# How each tensor lies across the tensor-parallel ranks (megatron-core's
# ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding; the pre-mcore legacy
# model's names beside them), matched against the end of the name, first match wins:
# "rows": concatenated along dim 0 (column-parallel weights and biases, the vocabulary);
# "glu": the same, each rank's rows [gate_r; up_r] under SwiGLU, made [all gate; all up];
# "columns": concatenated along dim 1 (row-parallel weights);
# "same": the same on every rank (norms, row-parallel biases, position embeddings): rank 0's.
SPLITS: tuple[tuple[str, str], ...] = (
    (r"\w*norm(_weight|_bias|\.weight|\.bias)", "same"),
    (r"_extra_state", "same"),
    (r"(linear_qkv|query_key_value)\.(weight|bias)", "rows"),
    (r"(linear_fc1|dense_h_to_4h)\.(weight|bias)", "glu"),
    (r"(linear_proj|dense|linear_fc2|dense_4h_to_h)\.weight", "columns"),
    (r"(linear_proj|dense|linear_fc2|dense_4h_to_h)\.bias", "same"),
    (r"word_embeddings(_for_head)?\.weight", "rows"),
    (r"output_layer\.weight", "rows"),
    (r"position_embeddings\.weight", "same"),
)
_SPLITS = [(re.compile(f"(^|.*\\.){pattern}$"), how) for pattern, how in SPLITS]
MAX_RANKS = 1 << 16
# what each rank saves of its own (the rest, the run's: rank 0's)
RANK_OWN = ("rng_state", "optimizer")
DISTRIBUTED_OPTIMIZER = "distrib_optim.pt"  # (get_distributed_optimizer_checkpoint_name)


def rank_folders(folder: str) -> list[str]:
    """The model-parallel rank folders of an iteration folder, sorted."""
    try:
        entries = sources.listdir(folder)
    except (OSError, CkptError):
        return []
    return sorted(n for n in entries if RANK_FOLDER.match(n))


def is_iteration(folder: str) -> bool:
    """An iteration folder of several model-parallel ranks (one rank is one torch.save)."""
    return len(rank_folders(folder)) > 1


def read(folder: str, *, permissive: bool = False) -> Checkpoint:
    """The merged checkpoint of an iteration folder (see the module).

    Raises:
        CkptError: A rank missing or of another iteration, expert-parallel ranks, a
            tensor no rule places, shapes or args that contradict the folders.
        UnsafeError: A rank file's pickle references dangerous globals.
    """
    grid = _grid(folder)
    tp = 1 + max(t for t, _ in grid)
    pp = 1 + max(p for _, p in grid)
    ckpts: dict[tuple, Checkpoint] = {}
    for (t, p), path in sorted(grid.items()):
        ckpts[t, p] = torch_zip.read(path, permissive=permissive)
    roots = {}
    for key, ckpt in ckpts.items():
        if not isinstance(ckpt.root, dict):
            raise CkptError("corrupt Megatron rank file: not a dict", path=grid[key])
        roots[key] = namespaces_as_dicts(ckpt.root, 0)
    first = roots[0, 0]
    args = first.get("args") if isinstance(first.get("args"), dict) else {}
    _check_run(roots, grid, args, tp, pp)
    version = first.get("checkpoint_version", 0)
    # (not ">=": a NaN is no version)
    if (
        not isinstance(version, (int, float))
        or isinstance(version, bool)
        or not version >= QKV_VERSION
    ):
        raise CkptError(
            f"Megatron checkpoint_version {_said(version)}: its QKV rows are ordered otherwise "
            f"than version {QKV_VERSION}'s and later, which ckpttool merges",
            path=grid[0, 0],
        )
    chunks = _chunk_keys(roots, grid)
    model = _merge(roots, grid, chunks, tp, pp, args)
    root: dict[str, Any] = {
        k: v for k, v in first.items() if k != MODEL_KEY and not CHUNK_KEY.match(str(k))
    }
    root[MODEL_KEY] = model
    # each rank's own state (RNG, optimizer: not merged), as stored, by rank folder
    per_rank = {
        sources.basename(sources.dirname(grid[key])): {k: r[k] for k in RANK_OWN if k in r}
        for key, r in sorted(roots.items())
    }
    # the distributed optimizer's own file beside a rank's (its flat buffers' layout is
    # the model code's bucketing, not recorded): kept as stored, never dropped unsaid
    for key in sorted(grid):
        beside = sources.join(sources.dirname(grid[key]), DISTRIBUTED_OPTIMIZER)
        if sources.isfile(beside):
            ckpts[key, DISTRIBUTED_OPTIMIZER] = torch_zip.read(beside, permissive=permissive)
            name = sources.basename(sources.dirname(grid[key]))
            per_rank[name]["distrib_optim"] = ckpts[key, DISTRIBUTED_OPTIMIZER].root
    for name in RANK_OWN:
        root.pop(name, None)
    if any(per_rank.values()):
        root["ranks"] = per_rank
    layout = {"tensor_parallel": tp, "pipeline_parallel": pp, "virtual_pipeline": len(chunks)}
    return Checkpoint(
        format=FORMAT,
        files=[grid[key] for key in sorted(grid, key=lambda k: (k[1], k[0]))]
        + [c.files[0] for k, c in ckpts.items() if k[-1] == DISTRIBUTED_OPTIMIZER],
        root=root,
        world_size=tp * pp,
        **verdicts(*ckpts.values()),
        metadata={"megatron_legacy": {**layout, "checkpoint_version": version}},
        model_path=(MODEL_KEY,),
    )


def _grid(folder: str) -> dict[tuple[int, int], str]:
    """(tensor rank, pipeline rank) -> its file, every one of the grid there."""
    grid: dict[tuple[int, int], str] = {}
    staged = set()
    for name in rank_folders(folder):
        m = RANK_FOLDER.match(name)
        assert m is not None
        if m.group(3) is not None:
            raise CkptError(
                f"Megatron expert-parallel rank folders ({name}): their experts are not merged yet",
                path=folder,
            )
        staged.add(m.group(2) is not None)
        file = next(
            (c for f in RANK_FILES if sources.isfile(c := sources.join(folder, name, f))), None
        )
        if file is None:
            raise CkptError(
                f"Megatron rank folder {name} holds no {RANK_FILES[0]} (incomplete checkpoint)",
                path=sources.join(folder, name),
            )
        grid[int(m.group(1)), int(m.group(2) or 0)] = file
    if len(staged) > 1:
        raise CkptError(
            "Megatron rank folders with and without a pipeline stage (mp_rank_TT and "
            "mp_rank_TT_PPP): two saves in one folder",
            path=folder,
        )
    tp = 1 + max(t for t, _ in grid)
    pp = 1 + max(p for _, p in grid)
    if tp * pp > MAX_RANKS:
        raise CkptError(f"Megatron rank folders of {tp} x {pp} ranks", path=folder)
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in grid]
    if missing:
        t, p = missing[0]
        absent = f"mp_rank_{t:02d}" + (f"_{p:03d}" if staged == {True} else "")
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CkptError(
            f"Megatron checkpoint of {tp} x {pp} model-parallel ranks without {absent}{more}",
            path=folder,
        )
    return grid


def _check_run(roots: dict, grid: dict, args: dict, tp: int, pp: int) -> None:
    """Every rank of one iteration, and the args' parallel sizes the folders'."""
    iteration = roots[0, 0].get("iteration")
    for key, r in roots.items():
        if r.get("iteration") != iteration:
            raise CkptError(
                f"Megatron rank of iteration {_said(r.get('iteration'))} beside iteration "
                f"{_said(iteration)}",
                path=grid[key],
            )
    for arg, found in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        said = args.get(arg)
        if said is not None and said != found:
            raise CkptError(
                f"the run's args say {arg}={_said(said)}, the folder holds {found}",
                path=grid[0, 0],
            )


def _chunk_keys(roots: dict, grid: dict) -> list[str]:
    """``["model"]``, or the virtual stages' ``model0``, ``model1``, ... every rank holds."""
    want = None
    for key, r in sorted(roots.items()):
        found = sorted(
            (k for k in r if isinstance(k, str) and (k == MODEL_KEY or CHUNK_KEY.match(k))),
            key=lambda k: -1 if k == MODEL_KEY else int(k[len(MODEL_KEY) :]),
        )
        if want is None:
            want = found
        if found != want or not found or (MODEL_KEY in found and len(found) > 1):
            raise CkptError(
                f"Megatron rank file with model keys {found[:4]}, beside {(want or [])[:4]}",
                path=grid[key],
            )
    numbered = [k for k in want or [] if k != MODEL_KEY]
    if numbered and numbered != [f"{MODEL_KEY}{i}" for i in range(len(numbered))]:
        raise CkptError(
            f"Megatron virtual stages {numbered}: not model0 to model{len(numbered) - 1}"
        )
    return want or []


def _merge(
    roots: dict, grid: dict, chunks: list[str], tp: int, pp: int, args: dict
) -> dict[str, Any]:
    """The one-rank model: every chunk's tensors in pipeline order, layers renumbered."""
    merged: dict[str, Any] = {}
    offset = 0
    tied = args.get("untie_embeddings_and_output_weights") is False
    swiglu = args.get("swiglu")  # (None: the run does not say; its fc1 is not merged)
    for v, chunk in enumerate(chunks):
        for p in range(pp):
            states = [_state(roots[t, p], chunk, grid[t, p]) for t in range(tp)]
            names = list(states[0])
            for t in range(1, tp):
                if list(states[t]) != names:
                    extra = sorted(set(states[t]) ^ set(names))[:3]
                    raise CkptError(
                        f"Megatron tensor-parallel ranks hold different tensors ({extra})",
                        path=grid[t, p],
                    )
            layers = {int(m.group(2)) for n in names if (m := LAYER.match(n))}
            if layers and layers != set(range(len(layers))):
                raise CkptError(
                    f"Megatron stage with layers {sorted(layers)[:8]}: not numbered from 0",
                    path=grid[0, p],
                )
            last_stage = p == pp - 1 and v == len(chunks) - 1
            for name in names:
                m = LAYER.match(name)
                out = f"{m.group(1)}{offset + int(m.group(2))}.{m.group(3)}" if m else name
                if tied and last_stage and (v, p) != (0, 0) and _is_head(name):
                    continue  # megatron's copy of the word embeddings, kept in step by it
                if out in merged:
                    raise CkptError(f"Megatron stages both hold {out!r}", path=grid[0, p])
                values = [s[name] for s in states]
                merged[out] = _assemble(values, name, swiglu, [grid[t, p] for t in range(tp)])
            offset += len(layers)
    layers_said = args.get("num_layers")
    if isinstance(layers_said, int) and layers_said != offset:
        raise CkptError(
            f"the run's args say num_layers={layers_said}, the stages hold {offset} layers",
            path=grid[0, 0],
        )
    return merged


def _is_head(name: str) -> bool:
    """The output layer (pre-mcore: ``word_embeddings_for_head``) and its extra state."""
    return name.split(".")[0] in ("output_layer", "word_embeddings_for_head")


def _state(root: dict, chunk: str, path: str) -> dict[str, Any]:
    state = root.get(chunk)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CkptError(f"corrupt Megatron rank file: its {chunk!r} is not a state dict", path=path)
    return _flat(state, "", path, 0)


def _flat(state: dict, prefix: str, path: str, depth: int) -> dict[str, Any]:
    """The pre-mcore model's nested state dicts (``language_model`` -> ``encoder`` -> ...)
    as dotted names, as its ``load_state_dict`` takes them; megatron-core's are flat."""
    if depth > 8:
        raise CkptError("corrupt Megatron rank file: its model nests too deep", path=path)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise CkptError(
                f"corrupt Megatron rank file: a model key {type(key).__name__}", path=path
            )
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not name.endswith("_extra_state"):
            out.update(_flat(value, f"{name}.", path, depth + 1))
        else:
            out[name] = value
    return out


def _assemble(values: list[Any], name: str, swiglu: bool | None, paths: list[str]) -> Any:
    """One tensor of the merged model from its tensor-parallel slices (see SPLITS), each
    from the file of ``paths`` of its rank."""
    how = next((h for pattern, h in _SPLITS if pattern.match(name)), None)
    path = paths[0]
    if how is None:
        raise CkptError(
            f"no rule says how Megatron splits {name!r} over the tensor-parallel ranks",
            path=path,
            hint="a layout ckpttool does not merge yet; pass one rank file to read it alone",
        )
    first = values[0]
    if how == "same" or len(values) == 1:
        if isinstance(first, TensorRef):
            for other, at in zip(values[1:], paths[1:], strict=True):
                _same_shape(first, other, name, at)
        return first
    if not all(isinstance(v, TensorRef) for v in values):
        raise CkptError(f"Megatron tensor {name!r} is not a tensor on every rank", path=path)
    for other, at in zip(values[1:], paths[1:], strict=True):
        _same_shape(first, other, name, at)
    if how == "glu" and swiglu is None:
        raise CkptError(
            f"the run's args do not say whether {name!r} is SwiGLU's (each rank's gate and "
            "up halves) or one projection: its tensor-parallel slices are not merged",
            path=path,
        )
    if how == "glu" and not swiglu:
        how = "rows"
    dim = 1 if how == "columns" else 0
    if len(first.shape) <= dim:
        raise CkptError(f"Megatron tensor {name!r} {list(first.shape)} has no dim {dim}", path=path)
    size = first.shape[dim]
    shape = list(first.shape)
    shape[dim] = size * len(values)
    rest = list(first.shape)
    shards = []
    if how == "glu":
        if size % 2:
            raise CkptError(
                f"Megatron tensor {name!r}: {size} rows a rank are not a gate and an up half",
                path=path,
            )
        half = size // 2
        for t, ref in enumerate(values):
            for part, start in ((0, 0), (1, half)):  # [gate_r; up_r] -> [gates; ups]
                at = part * half * len(values) + t * half
                rows = strided_rows(ref, start, 1, half)
                shards.append(Shard((at, *[0] * (len(rest) - 1)), (half, *rest[1:]), rows, t))
    else:
        for t, ref in enumerate(values):
            offsets = [0] * len(rest)
            offsets[dim] = t * size
            shards.append(Shard(tuple(offsets), tuple(rest), ref, t))
    check_coverage(name, tuple(shape), shards)  # (they tile it by construction: the one rule)
    return ShardedRef(first.dtype, tuple(shape), shards, device=first.device, kind="megatron-tp")


def _same_shape(a: TensorRef, b: Any, name: str, path: str) -> None:
    if not isinstance(b, TensorRef) or tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        shown = list(b.shape) if hasattr(b, "shape") else type(b).__name__
        raise CkptError(
            f"Megatron tensor {name!r}: {shown} here, {list(a.shape)} {a.dtype.name} on "
            "tensor-parallel rank 0",
            path=path,
        )


def _said(value: Any) -> str:
    """A value a file gave, as an error line shows it (cut: a line never holds all of it)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"
