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
and every rebuilt tensor is a lazy view of the partitions (see :mod:`.flat`).
"""

from __future__ import annotations

from ... import sources
from ...errors import CkptError, UnsafeError
from ...tree import Checkpoint
from . import pipe
from .tag_folder import MODEL_STATES, OPTIM_STATES, TagFolder
from .universal import UNIVERSAL_DIR, read_universal


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
    if pipe.is_pipeline(names):  # a stage's model states beside each layer's own file
        return pipe.read(path, names, permissive)
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
    reader = TagFolder(path, permissive)
    if optim_files:
        return reader.read_zero(model_files, optim_files)
    if sources.isdir(sources.join(path, UNIVERSAL_DIR)):
        return read_universal(reader, model_files)
    # ZeRO stage 0: the model states hold the weights and the optimizer whole
    _, states = reader.model_states(model_files, 0, None)
    return reader.checkpoint(states, None)
