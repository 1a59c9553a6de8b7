"""Framework run folders: where the model is in a folder that a trainer saved, by rule.

A run folder holds the model beside the optimizer, scheduler and RNG state, each in
files of its own. Each framework names them its own way; :data:`RULES` lists the
rules, tried in order, and the first whose marker the folder has decides. Nothing is
guessed: a rule names the model's entries, and a folder whose model is not exactly
one of them is refused, naming what it holds.

=====================  ============================  ================================
rule                   marker                        model
=====================  ============================  ================================
accelerate             ``random_states_N.pkl``       ``pytorch_model_fsdp_0/`` (DCP),
(``save_state``)                                     ``pytorch_model_fsdp.bin``,
                                                     ``model.safetensors``,
                                                     ``pytorch_model.bin`` or, under
                                                     DeepSpeed, ``pytorch_model/``
HF Trainer FSDP        ``trainer_state.json`` +      the ``pytorch_model_fsdp_N/``
``checkpoint-N/``      ``pytorch_model_fsdp_N/``     folder (DCP)
HF Trainer             ``trainer_state.json`` +      the first of
``checkpoint-N/``      a weights file                ``model.safetensors``,
                                                     ``pytorch_model.bin``,
                                                     ``adapter_model.*``, a
                                                     ``*.index.json``
HF Trainer DeepSpeed   ``trainer_state.json`` +      the tag folder ``latest`` names
``checkpoint-N/``      ``latest``, no weights file   (``global_stepN/``: ZeRO-3
                                                     without gathered weights)
Lightning sharded      ``meta.pt`` + ``.metadata``   the DCP folder itself
``.ckpt/`` (FSDP)
verl / SkyRL           ``model_world_size_N_``       those N rank files
                       ``rank_R.pt``
torchtune output       ``recipe_state/`` or          the one ``epoch_N/`` folder
                       ``epoch_N/`` folders          (its model files, not its
                                                     ``adapter_model.pt``)
Hugging Face model     the weights of                those weights
with Trainer files     ``from_pretrained`` and a
                       Trainer file beside them
                       (``training_args.bin``...)
=====================  ============================  ================================

The checkpoint's tree holds each part under its name (the file name without its
suffix): ``ckpttool inspect`` and ``--select auto`` see the model, ``--select all``
every part. A Lightning sharded folder is read as Lightning's own consolidation
(``consolidate_checkpoint``) gives it: the DCP contents with ``meta.pt`` folded in,
``model`` renamed ``state_dict`` and ``optimizer_N`` gathered into ``optimizer_states``.
torchtune's output folder brings ``recipe_state/recipe_state.pt`` as ``recipe_state``
and a LoRA epoch's ``adapter_model.pt`` as ``adapter_model``: what its resume reads.
The checkpoint is reported with its model part's format id.

Every other pickle of the folder is judged too, though no resume reads it
(``training_args.bin``, a second copy of the weights, a ``.pkl`` of one's own): anyone
may ``torch.load`` it. Each file of the folder itself that is not a part and starts as
a zip, a tar or a pickle has its globals scanned (a zip's ``data.pkl`` and TorchScript
code, a legacy stream or raw pickle as :mod:`..torch_save.legacy` judges it, nothing
rebuilt), before the read's own errors: one that would run code refuses the folder,
naming each such file and what it calls.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ... import sources
from ...errors import CkptError, UnsafeError
from ...tree import Checkpoint, model_key, verdicts
from ...unpickler import check_structure
from ...zip_records import ZIP_MAGIC
from .. import dcp
from . import catalog, deepspeed_latest_tag, hf_weights_file

ReadPart = Callable[[Any], Checkpoint]  # one path or a list of rank files -> Checkpoint

# accelerate.utils.constants: FSDP_MODEL_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME, ...; under
# DeepSpeed, the engine's own checkpoint with the tag MODEL_NAME (pytorch_model/)
ACCELERATE_MARKER = re.compile(r"^random_states_\d+\.pkl$")
ACCELERATE_MODELS = re.compile(
    r"^(?:pytorch_model_fsdp_\d+|pytorch_model_fsdp(?:_\d+)?\.bin|model(?:_\d+)?\.safetensors"
    r"|pytorch_model(?:_\d+)?\.bin|pytorch_model(?:_\d+)?)$"
)
ACCELERATE_PARTS = re.compile(
    r"^(?:optimizer(?:_\d+)?(?:\.bin)?|scheduler(?:_\d+)?\.bin|sampler(?:_\d+)?\.bin"
    r"|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)
# transformers.Trainer's checkpoint-N/: with FSDP SHARDED_STATE_DICT (it saves through
# accelerate's save_fsdp_model / save_fsdp_optimizer) the model is a DCP folder;
# otherwise save_pretrained's weights file, taken in the order Trainer._load_from_checkpoint
# takes them (transformers.utils: SAFE_WEIGHTS_NAME, WEIGHTS_NAME, a PEFT model's
# ADAPTER_SAFE_WEIGHTS_NAME and ADAPTER_WEIGHTS_NAME, then load_sharded_checkpoint's
# indexes, safetensors first)
TRAINER_STATE = "trainer_state.json"
TRAINER_FSDP_MODEL = re.compile(r"^pytorch_model_fsdp_\d+$")
TRAINER_MODELS = (
    "model.safetensors",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
# What its resume reads beside the model. Not training_args.bin: the run's configuration,
# which resuming never loads, and a custom class in it (TRL's enums) would make the whole
# folder refused; it reads on its own.
TRAINER_PARTS = re.compile(
    r"^(?:optimizer_\d+|optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(?:_\d+)?\.pth)$"
)
# Lightning: lightning.fabric.strategies.fsdp._METADATA_FILENAME
LIGHTNING_META = "meta.pt"
LIGHTNING_OPTIMIZER = re.compile(r"^optimizer_(\d+)$")
# verl's FSDPCheckpointManager (SkyRL keeps its names)
VERL_RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
# torchtune: <output_dir>/epoch_N/ (the model), <output_dir>/recipe_state/recipe_state.pt;
# a LoRA run's epoch_N/adapter_model.pt is the adapter its resume reads
TORCHTUNE_EPOCH = re.compile(r"^epoch_(\d+)$")
TORCHTUNE_RECIPE_STATE = "recipe_state"
TORCHTUNE_ADAPTER = "adapter_model.pt"


@dataclass(frozen=True)
class Rule:
    """How one framework lays out a run folder."""

    name: str
    marker: Callable[[str, list[str]], bool]  # (folder, its entries) -> it follows this rule
    read: Callable[[str, list[str], ReadPart, bool], Checkpoint]


def find_rule(folder: str) -> Rule | None:
    """The rule whose marker ``folder`` has, or None for a folder of no known framework."""
    names = sources.listdir(folder)
    return next((rule for rule in RULES if rule.marker(folder, names)), None)


def read(folder: str, rule: Rule, read_part: ReadPart, *, unsafe: bool = False) -> Checkpoint:
    """Read a run folder by its rule.

    Args:
        folder: The run folder.
        rule: What :func:`find_rule` found for it.
        read_part: Reads one part (a path, or a list of rank files) lazily.
        unsafe: Keep dangerous globals as inert stand-ins instead of refusing.

    Raises:
        CkptError: The model is not exactly one of the rule's candidates.
        UnsafeError: A part's pickle references dangerous globals.
    """
    names = sources.listdir(folder)
    try:
        ckpt = rule.read(folder, names, _read_once(read_part), unsafe)
    except UnsafeError:
        raise
    except CkptError:
        if not unsafe:
            judge_other_pickles(folder, names, [])  # the verdict comes first
        raise
    if not unsafe:
        judge_other_pickles(folder, names, ckpt.files)
    # Parts that are one file are one read, yet the tree holds it under each name: a
    # thousand symlinks (or hard links) to one 500 KB file were a thousand reads (65 s)
    # and a tree of a thousand copies. Bounded as one pickle's shared containers are.
    check_structure(ckpt.root, folder)
    return ckpt


def _read_once(read_part: ReadPart) -> ReadPart:
    """``read_part``, reading a local file or folder once however many names it has."""
    read: dict[Any, Checkpoint] = {}

    def read_one(part: Any) -> Checkpoint:
        local = sources.local_path(part) if isinstance(part, str) else None
        if local is None:
            return read_part(part)
        try:
            info = os.stat(local)
        except OSError:
            return read_part(part)  # (its reader says what is wrong with it)
        key = (info.st_dev, info.st_ino)
        if key not in read:
            read[key] = read_part(part)
        return read[key]

    return read_one


def judge_other_pickles(folder: str, names: list[str], read: list[str]) -> None:
    """Judge every file of ``folder`` (its entries ``names``) that the read (its files
    ``read``) did not: a zip's, a tar's or a pickle's globals scanned, nothing rebuilt.

    Raises:
        UnsafeError: One or more would run code under ``torch.load``: the first named as
            the path, each in the message with what it calls.
    """
    done = {_file_key(path) for path in read}
    refused: list[UnsafeError] = []
    for name in sorted(names):
        path = sources.join(folder, name)
        try:
            if _file_key(path) in done or not sources.isfile(path):
                continue
            judge_file(path)
        except UnsafeError as exc:
            refused.append(exc)
        except (CkptError, OSError):
            pass  # no pickle, or one that runs nothing before its damage stops torch too
    if refused:
        raise _refusal(refused)


def judge_file(path: str) -> None:
    """Judge one file as ``torch.load(weights_only=False)`` would meet it, cheaply: a
    zip's ``data.pkl`` (and TorchScript code) scanned; a tar, legacy stream or other
    pickle as :mod:`..torch_save.legacy` reads it (its pickles are small beside a zip's data).

    Raises:
        UnsafeError: It would run code.
        CkptError: It is no pickle torch reads, or damaged (no verdict of refusal).
    """
    head = sources.read_head(path)
    if head.startswith(ZIP_MAGIC):
        from ..torch_save import torchscript
        from ..torch_save.zip_pickle import ZipPickle

        with ZipPickle(path) as archive:
            if any(torchscript.is_code_entry(n) for n in archive.names()):
                torchscript.read_code(archive, path)
            archive.scan(seen=set())
        return
    from ..torch_save import legacy

    if head and legacy.detect(path, head):
        legacy.read(path)


def _file_key(path: str) -> Any:
    """One key per local file, however many names it has; a remote path is its own."""
    local = sources.local_path(path)
    return os.path.realpath(local) if local is not None else path


def _refusal(refused: list[UnsafeError]) -> UnsafeError:
    """The refusals of several files of a folder as one: the first file as its path,
    every file named with what it calls."""
    if len(refused) == 1:
        return refused[0]
    exc = UnsafeError(
        [name for r in refused for name in r.dangerous],
        path=refused[0].path,
        reasons={name: reason for r in refused for name, reason in r.reasons.items()},
        globals=[name for r in refused for name in r.globals],
        unverified=[name for r in refused for name in r.unverified],
        allowable=[name for r in refused for name in r.allowable],
    )
    shown = "; ".join(f"{sources.basename(str(r.path))}: {', '.join(r.dangerous)}" for r in refused)
    exc.message = (
        f"pickles of the folder reference dangerous globals ({shown}); nothing was executed"
    )
    exc.args = (exc.one_line(),)
    return exc


def _part_name(entry: str) -> str:
    return entry if "." not in entry else entry.rsplit(".", 1)[0]


def _pick_model(folder: str, rule: str, models: list[str], expected: str) -> str:
    if len(models) == 1:
        return models[0]
    if not models:
        raise CkptError(f"{rule} folder without a model (expected one of {expected})", path=folder)
    raise CkptError(
        f"{rule} folder holds several models ({', '.join(models)}): which one is meant "
        "is not written down",
        path=folder,
        hint="pass one of them",
    )


def _combine(
    folder: str, model_name: str, parts: dict[str, Checkpoint], model_path: tuple | None = None
) -> Checkpoint:
    """One checkpoint of the parts, each under its name, reported as the model part."""
    model = parts[model_name]
    inner = model_key(model) if model_path is None else model_path
    files = list(model.files)
    for name, part in parts.items():
        if name != model_name:
            files.extend(part.files)
    return Checkpoint(
        format=model.format,
        files=files,
        root={name: part.root for name, part in parts.items()},
        world_size=model.world_size,
        **verdicts(*parts.values()),
        metadata=model.metadata,
        model_path=None if inner is None else (model_name, *inner),
    )


# --- accelerate ----------------------------------------------------------------------


def _is_accelerate(folder: str, names: list[str]) -> bool:
    return any(ACCELERATE_MARKER.match(n) for n in names)


def _read_accelerate(
    folder: str, names: list[str], read_part: ReadPart, unsafe: bool
) -> Checkpoint:
    models = [n for n in names if ACCELERATE_MODELS.match(n)]
    model = _pick_model(
        folder,
        "accelerate save_state",
        models,
        "pytorch_model_fsdp_0/, pytorch_model_fsdp.bin, model.safetensors, pytorch_model.bin",
    )
    parts = {_part_name(model): read_part(sources.join(folder, model))}
    for name in names:
        if ACCELERATE_PARTS.match(name):
            parts[_part_name(name)] = read_part(sources.join(folder, name))
    return _combine(folder, _part_name(model), parts)


# --- Hugging Face Trainer (FSDP) ----------------------------------------------------


def _is_trainer_fsdp(folder: str, names: list[str]) -> bool:
    return TRAINER_STATE in names and any(TRAINER_FSDP_MODEL.match(n) for n in names)


def _read_trainer_fsdp(
    folder: str, names: list[str], read_part: ReadPart, unsafe: bool
) -> Checkpoint:
    models = [n for n in names if TRAINER_FSDP_MODEL.match(n)]
    model = _pick_model(folder, "Trainer checkpoint", models, "pytorch_model_fsdp_0/")
    return _combine(folder, model, _trainer_parts(folder, names, model, model, read_part))


# --- Hugging Face Trainer ------------------------------------------------------------


def _is_trainer(folder: str, names: list[str]) -> bool:
    return TRAINER_STATE in names and any(n in names for n in TRAINER_MODELS)


def _read_trainer(folder: str, names: list[str], read_part: ReadPart, unsafe: bool) -> Checkpoint:
    # The first, not the only one: a folder holding the weights both ways is read as
    # Trainer._load_from_checkpoint reads it. The part is named by the weights' stem
    # ("model" for model.safetensors and its index), as accelerate's are.
    model = next(n for n in TRAINER_MODELS if n in names)
    name = model.split(".", 1)[0]
    return _combine(folder, name, _trainer_parts(folder, names, model, name, read_part))


def _trainer_parts(
    folder: str, names: list[str], model: str, name: str, read_part: ReadPart
) -> dict[str, Checkpoint]:
    """The model entry under ``name``, then the optimizer, scheduler, scaler and RNG
    states beside it, each under its file name without its suffix."""
    parts = {name: read_part(sources.join(folder, model))}
    for entry in names:
        if TRAINER_PARTS.match(entry):
            parts[_part_name(entry)] = read_part(sources.join(folder, entry))
    return parts


def _is_trainer_deepspeed(folder: str, names: list[str]) -> bool:
    return TRAINER_STATE in names and deepspeed_latest_tag(folder) is not None


def _read_trainer_deepspeed(
    folder: str, names: list[str], read_part: ReadPart, unsafe: bool
) -> Checkpoint:
    # Trainer saves no weights file under ZeRO-3 unless its config gathers them: the
    # model is DeepSpeed's own checkpoint, what Trainer resumes from (and zero_to_fp32
    # rebuilds); its optimizer is in there too
    tag = deepspeed_latest_tag(folder)
    assert tag is not None  # (the marker found it)
    name = sources.basename(tag)
    return _combine(folder, name, _trainer_parts(folder, names, name, name, read_part))


# --- Lightning -----------------------------------------------------------------------


def _is_lightning_sharded(folder: str, names: list[str]) -> bool:
    return LIGHTNING_META in names and dcp.METADATA_FILE in names


def _read_lightning_sharded(
    folder: str, names: list[str], read_part: ReadPart, unsafe: bool
) -> Checkpoint:
    sharded = dcp.read(folder, permissive=unsafe)  # (read_part would find this rule again)
    meta = read_part(sources.join(folder, LIGHTNING_META))
    if not isinstance(sharded.root, dict) or not isinstance(meta.root, dict):
        raise CkptError("Lightning sharded checkpoint: not a dict", path=folder)
    # lightning.fabric.utilities.load._load_distributed_checkpoint, then
    # lightning.pytorch.utilities.consolidate_checkpoint._format_checkpoint
    root = {**sharded.root, **meta.root}
    if "model" in root:
        root["state_dict"] = root.pop("model")
    optimizers = sorted(
        (int(m.group(1)), key) for key in root if (m := LIGHTNING_OPTIMIZER.match(str(key)))
    )
    if optimizers:
        if [i for i, _ in optimizers] != list(range(len(optimizers))):
            raise CkptError("Lightning sharded checkpoint: optimizer_N keys with gaps", path=folder)
        root["optimizer_states"] = [root.pop(key) for _, key in optimizers]
    return Checkpoint(
        format=sharded.format,
        files=[*sharded.files, *meta.files],
        root=root,
        world_size=sharded.world_size,
        **verdicts(sharded, meta),
        model_path=("state_dict",) if "state_dict" in root else None,
    )


# --- verl / SkyRL --------------------------------------------------------------------


def _is_verl(folder: str, names: list[str]) -> bool:
    return any((m := VERL_RANK_FILE.match(n)) and m.group(1) == "model" for n in names)


def _read_verl(folder: str, names: list[str], read_part: ReadPart, unsafe: bool) -> Checkpoint:
    sets: dict[tuple[str, int], dict[int, str]] = {}
    for name in names:
        m = VERL_RANK_FILE.match(name)
        if m:
            sets.setdefault((m.group(1), int(m.group(2))), {})[int(m.group(3))] = name
    sizes = sorted(size for kind, size in sets if kind == "model")
    if len(sizes) > 1:
        shown = ", ".join(f"model_world_size_{n}_rank_*.pt" for n in sizes)
        raise CkptError(
            f"folder holds the model rank files of several world sizes ({shown})",
            path=folder,
            hint="pass one set as a quoted glob",
        )
    world_size = sizes[0]
    if world_size < 1:
        raise CkptError(f"rank files of world size {world_size}", path=folder)
    parts: dict[str, Checkpoint] = {}
    for kind in ("model", "optim", "extra_state"):
        by_rank = sets.get((kind, world_size))
        if by_rank is None:
            continue
        # the world size is a file name's number: count the ranks, never list them all
        if sum(1 for r in by_rank if r < world_size) < world_size:
            first = next(r for r in range(world_size) if r not in by_rank)
            name = f"{kind}_world_size_{world_size}_rank_{first}.pt"
            raise CkptError(f"rank file missing: {name}", path=folder)
        files = [sources.join(folder, by_rank[r]) for r in range(world_size)]
        if kind == "extra_state":  # each rank's own scheduler and RNG state, no shards
            for r, path in enumerate(files):
                parts[f"extra_state_rank_{r}"] = read_part(path)
        else:
            # world size 1 saves plain tensors; FSDP2's replicated buffers (0-dim ones
            # too) are plain tensors in every rank's file: the lowest rank's stand for all
            parts[kind] = read_part(files[0] if world_size == 1 else files)
    return _combine(folder, "model", parts)


# --- torchtune -----------------------------------------------------------------------


def _is_torchtune(folder: str, names: list[str]) -> bool:
    epochs = [
        n for n in names if TORCHTUNE_EPOCH.match(n) and sources.isdir(sources.join(folder, n))
    ]
    return bool(epochs) or sources.isdir(sources.join(folder, TORCHTUNE_RECIPE_STATE))


def _read_torchtune(folder: str, names: list[str], read_part: ReadPart, unsafe: bool) -> Checkpoint:
    epochs = [
        n for n in names if TORCHTUNE_EPOCH.match(n) and sources.isdir(sources.join(folder, n))
    ]
    epoch = _pick_model(folder, "torchtune output", epochs, "epoch_N/")
    parts = {epoch: read_part(sources.join(folder, epoch))}
    adapter = sources.join(folder, epoch, TORCHTUNE_ADAPTER)
    if sources.isfile(adapter) and adapter not in parts[epoch].files:
        parts[_part_name(TORCHTUNE_ADAPTER)] = read_part(adapter)
    recipe = sources.join(folder, TORCHTUNE_RECIPE_STATE, "recipe_state.pt")
    if sources.isfile(recipe):
        parts[TORCHTUNE_RECIPE_STATE] = read_part(recipe)
    return _combine(folder, epoch, parts)


# --- a Hugging Face model folder with a Trainer's files ---------------------------------


def _is_hf_trainer(folder: str, names: list[str]) -> bool:
    # Trainer.save_model's output_dir, or a checkpoint-N/ without its trainer_state.json:
    # the folder is its weights, and training_args.bin & co. are pickles beside them
    return hf_weights_file(names) is not None and any(catalog.is_hf_companion(n) for n in names)


def _read_hf_trainer(
    folder: str, names: list[str], read_part: ReadPart, unsafe: bool
) -> Checkpoint:
    weights = hf_weights_file(names)
    assert weights is not None  # (the marker found them)
    return read_part(sources.join(folder, weights))  # the folder as from_pretrained reads it


RULES: list[Rule] = [
    Rule("accelerate save_state", _is_accelerate, _read_accelerate),
    Rule("Hugging Face Trainer FSDP", _is_trainer_fsdp, _read_trainer_fsdp),
    Rule("Hugging Face Trainer", _is_trainer, _read_trainer),
    Rule("Hugging Face Trainer DeepSpeed", _is_trainer_deepspeed, _read_trainer_deepspeed),
    Rule("Lightning sharded .ckpt", _is_lightning_sharded, _read_lightning_sharded),
    Rule("verl / SkyRL", _is_verl, _read_verl),
    Rule("torchtune output", _is_torchtune, _read_torchtune),
    Rule(
        "Hugging Face model with Trainer files",
        _is_hf_trainer,
        _read_hf_trainer,
    ),
]
