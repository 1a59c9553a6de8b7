"""What an entry of a folder is, cheaply: a sub-folder's or a file's format id from its
listing and first bytes (for :mod:`.folders.catalog`, which lists folders of checkpoints)."""

from __future__ import annotations

from .. import sources
from ..errors import CkptError
from . import FILE_FORMATS, FOLDER_FORMATS, megatron
from .folders import (
    CHECKPOINT_SUFFIXES,
    HF_WEIGHT_FILES,
    deepspeed_latest_tag,
    megatron_latest_iteration,
    run_folders,
)
from .folders.catalog import DCP_DATA_FILE


def folder_format(path: str) -> str | None:
    """The format id of a sub-folder that is a checkpoint by its contents, else None.

    Cheap: its listing, and the first bytes of one file at most.
    """
    try:
        names = sources.listdir(path)
    except (OSError, CkptError):
        return None
    rule = run_folders.find_rule(path)
    if rule is not None:
        return _rule_format(path, rule.name, names)
    if any(DCP_DATA_FILE.match(n) or n.endswith(".distcp") for n in names):
        return "megatron" if "metadata.json" in names else "dcp"  # (.metadata or not)
    for fmt in FOLDER_FORMATS:
        if fmt.detect(path, b""):
            return str(fmt.FORMAT)
    for name in HF_WEIGHT_FILES:
        if name in names:
            return file_format(sources.join(path, name))
    if deepspeed_latest_tag(path) is not None:  # a DeepSpeed run folder, by its `latest`
        return "deepspeed"
    iteration = megatron_latest_iteration(path)  # a Megatron save folder, by its tracker
    if iteration is not None:
        return "megatron" if megatron.detect(iteration, b"") else "torch-zip"
    if any(n.startswith("mp_rank_") for n in names):  # a legacy Megatron iteration
        return "torch-zip"
    files = [n for n in names if n.endswith(CHECKPOINT_SUFFIXES)]
    # one checkpoint file, and no sub-folder that could be another (a folder of those
    # is a folder of checkpoints, not one)
    folders = [n for n in names if "." not in n and sources.isdir(sources.join(path, n))]
    if len(files) == 1 and not folders and sources.isfile(sources.join(path, files[0])):
        return file_format(sources.join(path, files[0]))
    return None


def _rule_format(path: str, rule: str, names: list[str]) -> str:
    if "FSDP" in rule or "Lightning" in rule:
        return "dcp"
    if "DeepSpeed" in rule:
        return "deepspeed"
    if "verl" in rule:
        return "per-rank"
    if "torchtune" in rule:  # its one epoch_N/ is the model
        epochs = [n for n in names if run_folders.TORCHTUNE_EPOCH.match(n)]
        found = folder_format(sources.join(path, epochs[0])) if len(epochs) == 1 else None
        return found or "unknown"
    if "accelerate" in rule:
        models = [n for n in names if run_folders.ACCELERATE_MODELS.match(n)]
        if len(models) == 1:
            model = sources.join(path, models[0])
            found = folder_format(model) if sources.isdir(model) else file_format(model)
            return found or "unknown"
    for name in run_folders.TRAINER_MODELS:
        if name in names:
            if name.endswith(".json"):
                return "safetensors-sharded"
            return file_format(sources.join(path, name)) or "unknown"
    return "unknown"


def file_format(path: str) -> str | None:
    """A file's format id from its first bytes (and a zip's directory), or None."""
    try:
        head = sources.read_head(path)
        if not head:
            return None
        for fmt in FILE_FORMATS:
            if fmt.detect(path, head):
                return str(fmt.FORMAT)
    except (OSError, CkptError):
        return None
    return None
