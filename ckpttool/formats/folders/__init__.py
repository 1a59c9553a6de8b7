"""Which checkpoint a folder is, by the documented rules: its one checkpoint file, a
Hugging Face folder's weights (as ``from_pretrained`` takes them), DeepSpeed's ``latest``
tag, Megatron-LM's iteration tracker, a torchtune epoch's merged model."""

from __future__ import annotations

import re
from collections.abc import Callable

from ... import sources
from ...errors import CkptError
from . import catalog

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".tar")


# DeepSpeed: a run's folder names its newest tag folder in this file (global_step20,
# or "checkpoint" inside a Lightning DeepSpeed .ckpt folder), as zero_to_fp32.py reads it
DEEPSPEED_LATEST = "latest"


MAX_LATEST_BYTES = 4096


# A tag folder's model states, one per model-parallel rank (ZeRO-3: per data-parallel
# rank too), beside zero_pp_rank_*_optim_states.pt
DEEPSPEED_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt$")


# Megatron-LM: a save folder names its newest iteration in this file ("release" for a
# released checkpoint), whose folder is iter_0000100/ (or release/), as
# megatron.training.checkpointing reads it; an iteration saved in the legacy format
# holds one folder per model-parallel rank (mp_rank_TT, mp_rank_TT_PPP, + _EEE)
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"


MEGATRON_RANK_FOLDER = re.compile(r"^mp_rank_\d{2}(?:_\d{3}){0,2}$")


MEGATRON_RANK_FILES = ("model_optim_rng.pt", "model_rng.pt")


# The weights of a Hugging Face folder, in the order from_pretrained takes them.
HF_WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


# torchtune's epoch_N/ of a LoRA run (its Meta and torchtune checkpointers): the merged
# model, one file named by torchtune's SHARD_FNAME, beside the adapter that torchtune
# saves as it is (adapter_model.pt), which its resume reads
TORCHTUNE_MODEL_FILE = re.compile(r"^model-00001-of-00001\.(?:bin|pt|safetensors)$")


TORCHTUNE_ADAPTER_FILE = "adapter_model.pt"


def single_checkpoint_file(folder: str, folder_format: Callable[[str], str | None]) -> str | None:
    """The file that stands for a folder's one checkpoint, if it holds exactly one.

    That is its only checkpoint file (no checkpoint sub-folder beside it); or, in a
    Hugging Face model folder holding the same weights twice (``model.safetensors`` and
    ``pytorch_model.bin``), the safetensors file, as ``from_pretrained`` takes; or the
    weights file of a Trainer's output beside ``training_args.bin`` & co., and no other
    checkpoint file (a ``checkpoint-N/`` with its
    ``trainer_state.json`` is a run folder: :mod:`.run_folders`); or torchtune's merged
    model ``model-00001-of-00001.bin`` beside its LoRA adapter ``adapter_model.pt``
    (``epoch_N/``); or the lowest rank's file when every file is one rank of the same
    checkpoint (``ep0-ba4-rank0.pt``, ``ep0-ba4-rank1.pt``: the caller finds the
    siblings; a symlink to one of them, such as Composer's ``latest-rank0.pt``, is that
    file). A folder with no checkpoint file of its own may point at one: a DeepSpeed
    run's ``latest`` names its tag folder (then ``mp_rank_00_model_states.pt`` in it),
    a Megatron-LM save folder's ``latest_checkpointed_iteration.txt`` its iteration
    folder, and a legacy Megatron iteration holds its one rank's
    ``mp_rank_00/model_optim_rng.pt``.

    Raises:
        SeveralCheckpointsError: Several checkpoints (the rank files of several steps,
            sub-folders ``ep3/``, unrelated files), or one in a sub-folder: named, newest
            last, never picked (:mod:`.catalog`; ``ckpttool inspect`` lists them).
        CkptError: DeepSpeed model states split over model-parallel ranks.
    """
    entries = sources.listdir(folder)
    names = sorted(n for n in entries if n.endswith(CHECKPOINT_SUFFIXES))
    hf_weights = hf_weights_file(names)
    if hf_weights is not None:  # a Hugging Face folder: its weights, as from_pretrained takes
        return sources.join(folder, hf_weights)
    if not names:  # (a pytorch_model.bin that zero_to_fp32.py wrote beside it came first)
        pointed = (
            deepspeed_latest_tag(folder)
            or megatron_latest_iteration(folder)
            or _megatron_rank_file(folder, entries)
        )
        if pointed is not None:
            return pointed
    model_states = [m for n in names if (m := DEEPSPEED_MODEL_STATES.match(n))]
    if model_states:
        if len({m.group(1) for m in model_states}) > 1:
            raise CkptError(
                "DeepSpeed model states of several model-parallel ranks: each holds its "
                "own slices of the tensors, and nothing in them says how they fit",
                path=folder,
                hint="pass one mp_rank_XX_model_states.pt to read it alone",
            )
        return sources.join(folder, model_states[0].string)  # the lowest data-parallel rank
    models = [n for n in names if n != TORCHTUNE_ADAPTER_FILE]
    if len(names) == 2 and len(models) == 1 and TORCHTUNE_MODEL_FILE.match(models[0]):
        return sources.join(folder, models[0])  # torchtune's LoRA epoch_N/: the merged model
    # Otherwise the folder is one checkpoint only if it holds exactly one: one file, or
    # the rank files of one checkpoint (its lowest rank's file: the caller finds the
    # siblings). Several, or one in a sub-folder, are named, never picked (catalog).
    from ..per_rank import RANK_RE  # (the pickle readers: imported where a folder needs them)

    candidates = catalog.find_candidates(folder, hf_one_candidate(names), RANK_RE, folder_format)
    if not candidates:
        return None
    if len(candidates) > 1 or (
        candidates[0].kind == "folder" and not catalog.linked_from(folder, names, candidates[0])
    ):
        raise catalog.several_checkpoints(folder, candidates)
    return candidates[0].paths[0]


def hf_weights_file(names: list[str]) -> str | None:
    """The weights of a Hugging Face folder: one of :data:`HF_WEIGHT_FILES` (the first, as
    ``from_pretrained`` takes them), where every other checkpoint file beside it is
    another of them or a Trainer's companion (``training_args.bin``, ``optimizer.pt``,
    ``scheduler.pt``, ``rng_state.pth``). Beside an unrelated checkpoint file it is none."""
    weights = [n for n in HF_WEIGHT_FILES if n in names]
    if not weights:
        return None
    others = [n for n in names if n not in HF_WEIGHT_FILES and not catalog.is_hf_companion(n)]
    return None if others else weights[0]


def hf_one_candidate(names: list[str]) -> list[str]:
    """``names`` with a Hugging Face folder's weights as one candidate: the file
    ``from_pretrained`` takes, its other serializations and Trainer companions left out."""
    weights = [n for n in HF_WEIGHT_FILES if n in names]
    if not weights:
        return names
    others = [n for n in names if n not in HF_WEIGHT_FILES and not catalog.is_hf_companion(n)]
    return sorted([weights[0], *others])


def deepspeed_latest_tag(folder: str) -> str | None:
    """The tag folder a DeepSpeed run's ``latest`` file names, if it names one here."""
    pointer = sources.join(folder, DEEPSPEED_LATEST)
    raw = sources.read_small(pointer, MAX_LATEST_BYTES)
    if raw is None:
        return None
    tag = raw.decode("utf-8", "replace").strip()
    # a tag is one folder name beside it: "../other_run" or "s3://..." is not followed
    # (the folder then holds no checkpoint, and the error says so)
    if not sources.is_file_name(tag):
        return None
    target = sources.join(folder, tag)
    return target if sources.isdir(target) else None


def megatron_latest_iteration(folder: str) -> str | None:
    """The iteration folder a Megatron save folder's tracker file names, if it is here."""
    raw = sources.read_small(sources.join(folder, MEGATRON_TRACKER), MAX_LATEST_BYTES)
    if raw is None:
        return None
    text = raw.decode("ascii", "replace").strip()
    if text == "release":
        name = "release"
    elif text.isdigit() and len(text) <= 18:
        name = f"iter_{int(text):07d}"
    else:
        return None
    target = sources.join(folder, name)
    return target if sources.isdir(target) else None


def _megatron_rank_file(folder: str, entries: list[str]) -> str | None:
    """The one rank's file of a legacy Megatron iteration folder (``mp_rank_00/``); one
    of several ranks is the ``megatron`` reader's, which merges them."""
    ranks = sorted(n for n in entries if MEGATRON_RANK_FOLDER.match(n))
    if len(ranks) != 1:
        return None
    for name in MEGATRON_RANK_FILES:
        path = sources.join(folder, ranks[0], name)
        if sources.isfile(path):
            return path
    return None
