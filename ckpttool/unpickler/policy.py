"""What the restricted unpickler refuses or cannot vouch for, and pickle shapes no
checkpoint has.

Every global a pickle names is judged by its name, resolved as pickle resolves it
(each part of a dotted name counts), and never imported: :func:`judge` says KNOWN
(vouched for: a plain value class on the reviewed list below, whose construction runs
nothing of note), RESTORABLE (a class of a framework family whose objects checkpoints
hold: it may be made and restored, NEWOBJ and BUILD, but not called), UNVERIFIED (on no
list: read inert where it is only referenced; constructing or calling it is refused)
or DANGEROUS (a module family or name that reaches the OS, processes, files, the
network, the interpreter, a debugger, another deserializer or an evaluator: refused
whatever the pickle does with it). The rule is an allow-list's: what torch would
construct or call is refused unless ckpttool vouches for it or the user allows it.
The globals ckpttool rebuilds itself (tensors, containers) are decided before, in
:mod:`ckpttool.unpickler`.
"""

from __future__ import annotations

import _compat_pickle
import re
import sys
from collections.abc import Iterable
from typing import Any

from ..errors import CkptError, UsageError
from ..tree import Opaque, TensorRef
from .allow_list import ALLOWED, AllowList
from .pickle_scan import BUILD_TARGET, CALLED, HANDED, INSTANTIATED, MUTATED
from .sharded import LocalShards

# Modules whose every global is refused: they reach the OS, the network, files, the
# interpreter, a debugger or profiler, or another deserializer.
DANGEROUS_MODULES = frozenset(
    """os posix nt posixpath ntpath subprocess sys runpy importlib imp socket shutil pickle
    _pickle cPickle dill cloudpickle joblib marshal ctypes _ctypes pty code codeop commands
    webbrowser multiprocessing asyncio http urllib urllib2 urllib3 ftplib smtplib telnetlib
    poplib imaplib requests httpx aiohttp pdb bdb timeit platform signal threading _thread
    tempfile io _io fcntl resource cProfile profile pstats trace tracemalloc faulthandler
    types inspect gc pip setuptools distutils pkg_resources zipimport pkgutil sqlite3 ssl
    select selectors mmap operator _operator xmlrpc socketserver pydoc _posixsubprocess
    _socket _winapi venv ensurepip doctest idlelib lib2to3 tkinter turtle turtledemo
    concurrent _xxsubinterpreters _xxinterpchannels _interpreters _interpqueues
    sympy numexpr asteval simpleeval jinja2 mako _compat_pickle abc _py_abc
    interpreters zipfile tarfile gzip bz2 lzma zlib shelve dbm glob fileinput linecache
    tokenize netrc mailbox codecs _codecs site sysconfig atexit sched cmd copy
    copyreg ctypeslib cffi antigravity unittest fsspec s3fs gcsfs boto3 botocore
    huggingface_hub dataclasses_json yaml ruamel jsonpickle""".split()
)
# Module paths whose every global is refused, though their package is benign.
DANGEROUS_PREFIXES = (
    "logging.config",
    "logging.handlers",
    "numpy.testing",
    "numpy.f2py",
    "numpy.distutils",
    "numpy.ctypeslib",
    "numpy.lib.npyio",
    "numpy.lib._datasource",  # DataSource opens files and URLs (and makes a temp folder)
    "numpy.lib.format",
    "numpy.lib._npyio_impl",
    "numpy.lib._format_impl",
    "numpy.compat",
    "torch.fx",
    "torch.package",
    "torch._dynamo",
    "torch._inductor",
    "torch._export",
    "torch.export",
    "torch.compiler",
    "torch.onnx",
    "torch.distributed.rpc",
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.distributed.checkpoint.format_utils",
    # classes whose constructors start processes, threads, servers or write files:
    # calling a class of torch.distributed is otherwise allowed (its metadata classes)
    "torch.distributed.checkpoint._async_process_executor",
    "torch.distributed.checkpoint._async_thread_executor",
    "torch.distributed.checkpoint._experimental",
    "torch.distributed.checkpoint.staging",
    "torch.distributed.debug",  # FrontendServer(port) serves HTTP on every interface
    "torch.distributed.flight_recorder",
    "torch.distributed._tools",
    "torch.distributed.launch",
    "torch.multiprocessing",
    "torch.utils.cpp_extension",
    "torch.utils.collect_env",
    "torch.utils.benchmark",
    "torch.utils.tensorboard",
    "torch.utils.model_zoo",
    "torch.utils.data.datapipes",
    # sympify (that is, evaluate) the strings they are made with: FloorDiv("...")
    "torch.utils._sympy",
    "torch.fx.experimental",
    "torch._functorch",
    "pandas.core.computation",  # pandas.eval
    "pandas.io",
    "torch.profiler",
    "torch.autograd.profiler",
    "torch.testing",
    "torch.hub",
    "torch._C._jit",
    "torch.jit",
    "torch.ops",
    "torch._ops",
    "torch.serialization",
    "torch.storage",
    "torch._utils_internal",
    "torch._C",
)
# Single globals refused outside those modules.
DANGEROUS_NAMES = frozenset(
    """torch.load torch.save torch.from_file torch.storage._load_from_bytes
    torch._C._load_for_lite_interpreter numpy.load numpy.save numpy.savez
    numpy.savez_compressed numpy.loadtxt numpy.savetxt numpy.genfromtxt numpy.fromfile
    numpy.memmap numpy.fromregex numpy.core.memmap numpy._core.memmap typing.ForwardRef
    typing._eval_type typing.get_type_hints typing._type_check typing.evaluate_forward_ref
    uuid._get_command_stdout functools.reduce""".split()
)
# Names refused as any part of an attribute chain: reaching ``torch.os`` or
# ``numpy.sys`` is reaching os, and these reach code, files or the interpreter.
DANGEROUS_ATTRS = frozenset(
    """eval exec compile __import__ __builtins__ system popen open execv execve execl
    execlp execvp spawnv spawnl spawnve spawnlp fork forkpty attrgetter methodcaller getattr
    setattr delattr globals locals vars breakpoint input"""
    # torch.distributed's stores open files and sockets (a TCPStore listens or connects
    # when made), and modules of benign packages re-export them
    # (torch.distributed.checkpoint._async_process_executor.TCPStore): refused by name
    # under any module
    """ FileStore TCPStore HashStore PrefixStore"""
    # datapipes' wrappers unpickle (or dill-load) the bytes their BUILD state holds, and
    # torch.utils.data re-exports them (dataloader._IterDataPipeSerializationWrapper)
    """ _IterDataPipeSerializationWrapper _MapDataPipeSerializationWrapper
    _DataPipeSerializationWrapper IterDataPipe MapDataPipe""".split()
)
# Metaclasses: making one makes a class (``abc.ABCMeta(name, bases, namespace)``),
# whose attributes torch then trusts (a legacy ``module`` record's ``dump_patches``
# writes a patch file). No checkpoint makes a class: the standard library's are refused
# by name here, and any construction with a class's arguments (a name, bases that are
# globals, a namespace) by the call rules (``call_rules.makes_a_class``).
METACLASSES = frozenset(
    """builtins.type abc.ABCMeta _py_abc.ABCMeta typing._ProtocolMeta typing.NamedTupleMeta
    typing._TypedDictMeta typing._AnyMeta typing.GenericMeta enum.EnumMeta enum.EnumType
    types.new_class types.prepare_class""".split()
)
# Words in a function's name that say it loads, saves, runs or reaches files and
# processes (``torch_save_to_dcp``, ``run_string``, ``from_file``): a function named
# so is refused wherever it lives. Classes are judged by what the pickle does with them.
DANGEROUS_WORDS = frozenset(
    """load loads save saves dump dumps exec eval run runs system popen spawn fork call
    compile import open read write remove unlink rmtree rmdir rename mkdir makedirs chmod
    chown kill file fromfile tofile memmap command shell subprocess process thread
    runstring interpreter subinterpreter""".split()
)
# Modules where only a few names are harmless (their internals build functions from
# strings: ``dataclasses._create_fn``; ``typing`` evaluates forward references).
PARTLY_DANGEROUS = {
    "dataclasses": frozenset({"_MISSING_TYPE", "MISSING", "_HAS_DEFAULT_FACTORY_CLASS", "Field"}),
    "uuid": frozenset({"UUID", "SafeUUID"}),
    "typing": None,  # every CapWords special form (Any, Union, Dict...): see _judge_typing
}
# builtins that are plain data constructors; every other builtin is refused
# (eval, exec, compile, open, __import__, getattr on non-torch objects, ...).
SAFE_BUILTINS = frozenset(
    # no `range`: set(range(10**12)) would be a tiny pickle that never finishes
    "dict list tuple set frozenset str int float complex bool slice object".split()
)


# Harmless classes inside refused modules (or unlisted builtins): they become inert
# stand-ins like any other class. In-memory buffers, not files: DCP checkpoints keep
# io.BytesIO values, torchtitan's train state among them.
HARMLESS_NAMES = frozenset(
    """io.BytesIO _io.BytesIO io.StringIO _io.StringIO builtins.range builtins.NotImplemented
    torch._dynamo.decorators._DimRange copyreg._reconstructor copyreg.__newobj__
    copyreg.__newobj_ex__
    torch.serialization._get_layout torch.storage.UntypedStorage torch.storage.TypedStorage
    types.SimpleNamespace""".split()
)

# Vouched for, one by one: classes whose construction by a pickle (NEWOBJ, REDUCE with
# its arguments, BUILD) runs nothing of note. Each group says why.
KNOWN_CLASSES = frozenset(
    # the standard library's value types: their constructors parse or store the
    # arguments (a path, a date, a number), nothing else; deque and Counter copy an
    # iterable (an object among the arguments is judged: call_rules.judge_objects_handed)
    """argparse.Namespace pathlib.Path pathlib.PosixPath pathlib.WindowsPath
    pathlib.PurePath pathlib.PurePosixPath pathlib.PureWindowsPath pathlib._local.Path
    pathlib._local.PosixPath pathlib._local.WindowsPath pathlib._local.PurePosixPath
    pathlib._local.PureWindowsPath datetime.datetime datetime.date datetime.time
    datetime.timedelta datetime.timezone decimal.Decimal fractions.Fraction uuid.UUID
    uuid.SafeUUID collections.deque collections.Counter collections.ChainMap
    functools.partial enum.Enum enum.IntEnum enum.Flag enum.IntFlag enum.StrEnum"""
    # numpy's dtypes and RNG states: the dtype parses a type code; the bit generators
    # are made by name and restored from their state dict
    """ numpy.dtype numpy.ndarray numpy.generic numpy.random._pickle.__randomstate_ctor
    numpy.random._pickle.__bit_generator_ctor numpy.random._pickle.__generator_ctor
    numpy.random.mtrand.RandomState numpy.random._generator.Generator
    numpy.random._mt19937.MT19937 numpy.random._pcg64.PCG64 numpy.random._pcg64.PCG64DXP
    numpy.random._philox.Philox numpy.random._sfc64.SFC64 numpy.random.bit_generator.SeedSequence"""
    # torch's own values: a version string, a tensor class, quantization schemes
    """ torch.torch_version.TorchVersion torch.nn.parameter.Parameter torch.Tensor
    torch._tensor.Tensor torch.per_tensor_affine torch.per_tensor_symmetric
    torch.per_channel_affine torch.per_channel_symmetric torch.per_channel_affine_float_qparams
    torch.distributed.remote_device._remote_device"""
    # dataclasses of ints, a path: DeepSpeed ZeRO's parameter places, OLMo-core's _StorageInfo
    """ deepspeed.utils.tensor_fragment.fragment_address
    olmo_core.distributed.checkpoint.filesystem._StorageInfo"""
    # frameworks' enums, pickled as a call of the class with the member's value
    # (Enum.__reduce_ex__): the call looks the member up, nothing else
    """ transformers.trainer_utils.IntervalStrategy transformers.trainer_utils.SaveStrategy
    transformers.trainer_utils.HubStrategy transformers.trainer_utils.SchedulerType
    transformers.trainer_utils.EvaluationStrategy transformers.trainer_utils.FSDPOption
    transformers.trainer_utils.ShardedDDPOption transformers.training_args.OptimizerNames
    transformers.debug_utils.DebugOption transformers.utils.generic.ExplicitEnum
    transformers.utils.generic.PaddingStrategy transformers.utils.generic.TensorType
    accelerate.utils.dataclasses.DistributedType accelerate.utils.dataclasses.PrecisionType
    accelerate.utils.dataclasses.DynamoBackend accelerate.utils.dataclasses.RNGType
    accelerate.utils.dataclasses.ComputeEnvironment accelerate.utils.dataclasses.LoggerType
    accelerate.utils.dataclasses.SageMakerDistributedType
    megatron.core.enums.ModelType megatron.core.transformer.enums.AttnMaskType
    megatron.core.transformer.enums.AttnType megatron.core.transformer.enums.AttnBackend
    megatron.core.transformer.enums.ModelType deepspeed.runtime.zero.config.ZeroStageEnum
    deepspeed.runtime.zero.offload_config.OffloadDeviceEnum
    lightning.pytorch.trainer.states.TrainerFn lightning.pytorch.trainer.states.TrainerStatus
    lightning.pytorch.trainer.states.RunningStage
    pytorch_lightning.trainer.states.TrainerFn pytorch_lightning.trainer.states.TrainerStatus
    pytorch_lightning.trainer.states.RunningStage composer.core.time.TimeUnit
    peft.utils.peft_types.PeftType peft.utils.peft_types.TaskType"""
    # a types.SimpleNamespace with __iter__ and get(): the model's `args` in every
    # checkpoint Ultralytics writes during training; SimpleNamespace pickles itself
    # as a call of its class with no arguments, then BUILD
    """ ultralytics.utils.IterableSimpleNamespace""".split()
)
# torch's own families whose classes (CapWords names) may be made, restored and called:
# nn.Module's and Optimizer's __setstate__ restore attributes; torch.distributed's are
# the metadata dataclasses and enums of ShardedTensor, DTensor and DCP (the families of
# torch.distributed that start processes, threads or servers are dangerous, above).
# Their constructors take tensors, sizes and flags; none evaluates or loads anything.
KNOWN_CLASS_PACKAGES = ("torch.distributed.", "torch.optim.", "torch.nn.")
# Frameworks whose classes (CapWords names: configs, dataclasses, the modules of a
# pickled model) checkpoints hold: vouched for as objects to make and restore (NEWOBJ,
# BUILD, SETITEMS: how a dataclass or a dict subclass is pickled), not as callables
# (REDUCE runs ``__init__``, which for a trainer or a logger does real work): their
# enums, which are called, are listed one by one above. A function there is judged
# like any other global.
RESTORABLE_CLASS_PACKAGES = (
    "transformers.",  # TrainingArguments, AcceleratorConfig (training_args.bin)
    "accelerate.",  # PartialState and dataclasses beside them
    "lightning.",  # AttributeDict (hyper_parameters), callbacks' states
    "lightning_fabric.",
    "pytorch_lightning.",
    "omegaconf.",  # DictConfig, ListConfig and their metadata (NeMo, Lightning)
    "megatron.",  # its configs beside argparse.Namespace args
    "nemo.",
    "deepspeed.",  # LossScaler in ZeRO's optimizer states
    "peft.",  # LoraConfig
    "torchtune.",
    "composer.",  # Time, State's dataclasses
    "mmengine.",  # ConfigDict, HistoryBuffer
    "timm.",
    "ultralytics.nn.",  # a pickled model's modules (nn.Module subclasses)
    "numpy.",  # arrays of other kinds (numpy.ma) restored inert
)

# What a pickle's global is to ckpttool:
SAFE = "safe"  # rebuilt by ckpttool itself (SAFE_GLOBALS, dtypes, storages): never listed
KNOWN = "known"  # vouched for (a reviewed list, or --allow): read inert, may be constructed
RESTORABLE = "restorable"  # of a framework family: may be made and restored, not called
UNVERIFIED = "unverified"  # on no list: read inert if only referenced, else refused
DANGEROUS = "dangerous"  # refused without --unsafe


def refused_use(verdict: str, use: str) -> bool:
    """Whether a global of ``verdict`` that a pickle uses so (a use named by
    :mod:`ckpttool.unpickler.pickle_scan`, the walk of a pickle whose full read stopped early) is
    refused: the full read's rules where the walk can tell, and where it cannot, the
    stricter reading (a global on no list handed to any call may be called by it, as
    copyreg's ``_reconstructor`` calls its base).

    A dangerous global whatever the use; a module or class given BUILD state or
    changed by SETITEM/APPEND (it would be changed for the whole process); one on no
    list that the pickle calls, constructs, or hands to a call;
    a framework class vouched for as an object only, where the pickle calls it."""
    if verdict == DANGEROUS:
        return True
    if use in (BUILD_TARGET, MUTATED):  # the global itself would be changed
        return verdict in (KNOWN, RESTORABLE, UNVERIFIED)  # (ckpttool's values: corrupt)
    if verdict == UNVERIFIED:
        return use in (CALLED, INSTANTIATED, HANDED)
    return verdict == RESTORABLE and use == CALLED


def nested_class_getattr(module: str, qualname: str, attr: object, verdict: str) -> bool:
    """Whether ``getattr(module.qualname, attr)``, on a global of ``verdict``, is the one
    ``getattr`` a checkpoint needs: reaching a nested class of a torch class
    (ShardedTensor pickles ``getattr(ShardedTensor, "ProcessGroupState")``)."""
    return (
        module.startswith("torch.")
        and verdict in (KNOWN, RESTORABLE, UNVERIFIED)  # read inert (not rebuilt, not refused)
        and isinstance(attr, str)
        and attr.isidentifier()
        and attr[:1].isupper()  # a nested class (CapWords), never a method
        and judge(module, f"{qualname}.{attr}") != DANGEROUS  # (FileStore)
    )


def judge(module: str, name: str) -> str:
    """:data:`KNOWN`, :data:`UNVERIFIED` or :data:`DANGEROUS` for the global ``module.name``.

    ``name`` may be dotted: protocol 4 resolves ``torch`` + ``os.system`` by walking
    attributes, so every part of the chain is judged, not the whole string.
    """
    full = f"{module}.{name}"
    if full in HARMLESS_NAMES:
        return KNOWN
    if is_dangerous(module, name):
        return DANGEROUS  # (whatever the user allows)
    if ALLOWED.get().matches(full):
        return KNOWN  # trusted by the user (--allow, add_safe_globals): read inert
    return _judge_unlisted(module, name)


def _judge_unlisted(module: str, name: str) -> str:
    """:func:`judge` of a global that is neither dangerous nor allowed by the user."""
    full = f"{module}.{name}"
    if full in KNOWN_CLASSES or module == "builtins":
        return KNOWN  # (builtins left here are data types and exceptions)
    root = module.split(".", 1)[0]
    if root == "__torch__":
        return KNOWN  # TorchScript's own type names: nothing Python can import
    # The rules by family name a global itself, never an attribute of one: a dotted
    # name reaches a method (``pathlib.Path.touch``, ``symlink_to``), which the
    # family's rule does not vouch for.
    chain = name.split(".")
    if len(chain) == 1 and (
        (module == "torch._utils" and name.startswith("_rebuild_"))  # torch's tensor rebuilders
        # Cython's unpicklers of numpy's RNG classes (a Generator's seed)
        or (module.startswith("numpy.random") and name.startswith("__pyx_unpickle_"))
        or (root == "pathlib" and _is_class_name(name))
    ):
        return KNOWN
    # a class, or a class nested in one (ShardedTensor.ProcessGroupState)
    classes = all(_is_class_name(part) for part in chain)
    if classes and full.startswith(KNOWN_CLASS_PACKAGES):
        return KNOWN
    # typing's special forms are referenced, never made: calling one (NamedTuple,
    # TypedDict) makes a class
    if module == "typing" or (classes and full.startswith(RESTORABLE_CLASS_PACKAGES)):
        return RESTORABLE
    return UNVERIFIED


def is_dangerous(module: str, name: str) -> bool:
    """Whether the global ``module.name`` is refused without ``--unsafe``."""
    full = f"{module}.{name}"
    if full in HARMLESS_NAMES:
        return False
    root = module.split(".", 1)[0]
    chain = name.split(".")
    if module == "builtins":
        is_value = chain[0] in SAFE_BUILTINS or _is_exception_name(chain[0])
        return not is_value or len(chain) > 1
    if any(not part.isidentifier() for part in [*module.split("."), *chain]):
        return True  # nothing importable is spelled so: a trick, not a checkpoint
    if full in METACLASSES:
        return True
    if root in PARTLY_DANGEROUS:
        allowed = PARTLY_DANGEROUS[root]
        if allowed is None:  # typing: its special forms are values; its functions evaluate
            return not (len(chain) == 1 and _is_class_name(name) and full not in DANGEROUS_NAMES)
        return module != root or name not in allowed
    return (
        root in DANGEROUS_MODULES
        or any(part in DANGEROUS_MODULES or part in DANGEROUS_ATTRS for part in chain)
        or any(part.startswith("__") and part.endswith("__") for part in chain)
        or full in DANGEROUS_NAMES
        or any(f"{full}.".startswith(p + ".") for p in DANGEROUS_PREFIXES)
        or (not _is_class_name(chain[-1]) and bool(_words(chain[-1]) & DANGEROUS_WORDS))
    )


def allowable(full: str) -> bool:
    """Whether the refused global ``full`` (``module.name``, as a refusal names it) is
    one ``--allow`` reads: a class or function refused only because ckpttool cannot
    vouch for what the pickle does with it, not a dangerous family, and no object
    (``x.Class()``) or walk's marker (``<an object>()``)."""
    module, _, name = full.rpartition(".")
    return (
        bool(module)
        and not full.startswith("<")
        and not full.endswith(")")
        and _ALLOW_NAME.fullmatch(full) is not None
        and not is_dangerous(*python3_name(module, name))
    )


def _is_class_name(name: str) -> bool:
    """CapWords (``LossScaler``, ``_StridedShard``): a class, by Python's naming rule."""
    stripped = name.lstrip("_")
    return stripped[:1].isupper()


def _words(name: str) -> set[str]:
    """``torch_save_to_dcp`` -> {torch, save, to, dcp}; ``dictConfig`` -> {dict, config}."""
    spaced = "".join(f"_{c.lower()}" if c.isupper() else c for c in name)
    return {w for w in spaced.split("_") if w} | {name.lower().strip("_")}


def python3_name(module: str, name: str) -> tuple[str, str]:
    """The global the real unpickler would import for ``module.name``.

    Protocols 0-2 (torch.save writes 2) store Python 2 names: ``subprocess.Popen`` is
    written ``commands.Popen``, ``http.server`` ``BaseHTTPServer``, ``_thread`` ``thread``.
    """
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _is_exception_name(name: str) -> bool:
    return name.endswith(("Error", "Exception", "Warning"))


# Far beyond any real checkpoint (Composer snapshots nest ~8 levels), and within what the
# recursive consumers (layout, materialize, JSON) handle.
MAX_NESTING = 200
# Entries seen again through containers that are shared (reachable by several paths).
MAX_SHARED_ENTRIES = 1_000_000
# The tensors of a pickle, each counted at every path that reaches it (each is written
# in full), may span this many times the bytes of the storages they view, plus
# MAX_TENSOR_BYTES_BASE: tied weights name one storage twice, a snapshot may keep its
# model under "model" and "ema" too; a few bytes of memo naming one stored megabyte a
# thousand times would make a small file a gigabyte of output.
TENSOR_BYTES_PER_STORED_BYTE = 16
MAX_TENSOR_BYTES_BASE = 64 << 20


def check_structure(
    root: Any, path: object = None, checked: tuple[set[int], set[int]] | None = None
) -> None:
    """Refuse shapes that a few bytes of pickle can build and no checkpoint has.

    The memo lets a pickle share one container many times: a list holding the same
    list twice, 30 levels deep, is 300 bytes but 2**30 paths for every walk over the
    tree; a dict that holds itself never ends a walk over plain containers. (One long
    string held a million times costs nothing until printed: reports shorten long
    text.) Children are found with the types' own methods (``dict.values(node)``):
    a BUILD may have given an OrderedDict an attribute ``values`` of its own.

    ``checked``: (containers, their contents), by id, that the caller has checked
    already in bulk (a DCP ``.metadata``'s chunk lists: flat records of numbers, none
    shared; see :mod:`ckpttool.formats.dcp.metadata`). Such a container is not walked
    on its first visit; its contents count as visited, so a second path to any of them
    counts as the walk would count it.

    Raises:
        CkptError: nesting deeper than MAX_NESTING, shared containers that expand to
            more than MAX_SHARED_ENTRIES entries, a dict/list/tuple that holds itself,
            a dict whose attributes hide its methods, or tensors that name the same
            stored bytes over and over (see TENSOR_BYTES_PER_STORED_BYTE).
    """
    tensor_bytes = 0
    stored: dict[int, int] = {}  # id(storage) -> its bytes
    flat, expanded = (set(), set()) if checked is None else (set(checked[0]), set(checked[1]))
    ancestors: set[int] = set()
    shared_entries = 0
    containers = (dict, list, tuple, Opaque)
    stack: list[tuple[Any, int, bool]] = [(root, 0, False)] if isinstance(root, containers) else []
    while stack:
        node, depth, leaving = stack.pop()
        if leaving:
            ancestors.discard(id(node))
            continue
        if id(node) in ancestors:
            if isinstance(node, Opaque):  # objects may point back at a parent; walks cut that
                continue
            raise CkptError("corrupt pickle: a container holds itself", path=path)
        if depth > MAX_NESTING:
            raise CkptError(f"corrupt pickle: nests deeper than {MAX_NESTING} levels", path=path)
        if isinstance(node, dict):
            if type(node) is not dict:
                _check_dict_attributes(node, path)
            kids: Any = dict.values(node)
        elif isinstance(node, Opaque):
            kids = [child for _, child in Opaque.parts(node)]  # all it holds, not a view
        else:
            kids = node
        if id(node) in flat:  # checked by the caller: walked from its second path on
            flat.discard(id(node))
            expanded.add(id(node))
            continue
        if id(node) in expanded:  # every entry counts: a walk visits leaves too
            shared_entries += len(kids)
            if shared_entries > MAX_SHARED_ENTRIES:
                raise CkptError(
                    "corrupt pickle: containers shared by many paths would expand to more "
                    f"than {MAX_SHARED_ENTRIES} entries",
                    path=path,
                )
        if not _TENSOR_TYPES.isdisjoint(map(type, kids)):  # (a scan in C: hot, as below)
            for child in kids:
                for ref in _stored_tensors(child):
                    if ref.storage is not None:  # (a meta tensor stores nothing)
                        tensor_bytes += ref.nbytes
                        stored[id(ref.storage)] = ref.storage.nbytes
        expanded.add(id(node))
        ancestors.add(id(node))
        stack.append((node, depth, True))
        # only containers go on the stack (hot: a large DCP .metadata has millions of
        # numbers); tensors and other leaves end a walk
        stack.extend((child, depth + 1, False) for child in kids if isinstance(child, containers))
    allowed = MAX_TENSOR_BYTES_BASE + TENSOR_BYTES_PER_STORED_BYTE * sum(stored.values())
    if tensor_bytes > allowed:
        raise CkptError(
            f"corrupt pickle: its tensors name the same stored bytes over and over "
            f"({tensor_bytes} bytes of tensors from {sum(stored.values())} stored)",
            path=path,
        )


_TENSOR_TYPES = frozenset({TensorRef, LocalShards})


def _stored_tensors(value: Any) -> list[TensorRef]:
    """The stored tensors a leaf is written from: a tensor, a rank's blocks of a sharded one."""
    if type(value) is LocalShards:
        value = [getattr(block, "tensor", None) for block in value.shards]
    else:
        value = [value]
    return [t for t in value if type(t) is TensorRef and t.numel]


def _check_dict_attributes(node: dict, path: object) -> None:
    """A dict subclass's instance attributes may not hide the type's own methods.

    ``OrderedDict`` objects have a ``__dict__`` that BUILD fills (torch keeps a state
    dict's ``_metadata`` there); ``{"values": list}`` in it would make ``node.values()``
    lie to every consumer.
    """
    attrs = getattr(node, "__dict__", None)
    if attrs and any(hasattr(type(node), name) for name in attrs):
        hidden = sorted(name for name in attrs if hasattr(type(node), name))
        raise CkptError(
            f"corrupt pickle: the attributes of a {type(node).__name__} hide its methods "
            f"({', '.join(map(str, hidden))[:80]})",
            path=path,
        )


# ------------------------------------------------------ the user's allow-list
#
# ``--allow NAME`` and ``allow=[...]`` trust globals as torch's ``add_safe_globals``
# does: the pickle may call them (REDUCE, NEWOBJ), and they still come back as inert
# stand-ins, since nothing from a file ever runs. Whatever is dangerous stays refused:
# :func:`judge` asks :func:`is_dangerous` first, and naming a dangerous family is an
# error of its own.

_ALLOW_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\.\*)?")


def parse_allow(names: Iterable[str], *, source: str = "--allow") -> AllowList:
    """An :class:`AllowList` from names as a user writes them.

    Raises:
        UsageError: A name that is no dotted global or ``pkg.mod.*`` prefix, or one
            in a family ckpttool always refuses (an allow-list cannot open it).
    """
    exact: set[str] = set()
    prefixes: list[str] = []
    for raw in names:
        name = str(raw).strip()
        if not _ALLOW_NAME.fullmatch(name) or "." not in name:
            raise UsageError(
                f"{source} {name!r}: not a global (module.Name) or a module prefix (module.*)"
            )
        if name.endswith(".*"):
            module = name[:-2]
            # every global of a module that is dangerous as a whole is: a class-like
            # name stands for them all
            refused = is_dangerous(*python3_name(module, "AnyClass"))
        else:
            module, _, qual = name.rpartition(".")
            refused = is_dangerous(*python3_name(module, qual))
        if refused:
            raise UsageError(
                f"{source} {name}: a dangerous family (it reaches the OS, files, processes, "
                "the network, the interpreter or another deserializer); no allow-list "
                "opens it",
                hint="only if you trust the file, pass --unsafe",
            )
        if name.endswith(".*"):
            prefixes.append(name[:-1])
        else:
            exact.add(name)
    return AllowList(frozenset(exact), tuple(dict.fromkeys(prefixes)))


def allow_names(allow: Iterable[Any] | None) -> list[str]:
    """Names from what the Python API takes: strings, the objects themselves, or
    ``(object, "name")`` pairs, as ``torch.serialization.add_safe_globals`` takes them."""
    names: list[str] = []
    for item in allow or ():
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str):
            names.append(item[1])
        else:
            module = getattr(item, "__module__", None)
            qualname = getattr(item, "__qualname__", None)
            if not (isinstance(module, str) and isinstance(qualname, str)):
                raise UsageError(f"allow: {item!r:.80} is no class or function (or name)")
            names.append(f"{module}.{qualname}")
    return names


def torch_safe_globals() -> AllowList:
    """What the program registered with ``torch.serialization.add_safe_globals`` or
    ``safe_globals(...)``, where torch is already imported (never imported for this).
    A dangerous one among them stays refused (it is left out)."""
    serialization = sys.modules.get("torch.serialization")
    get = getattr(serialization, "get_safe_globals", None)
    if get is None:
        return AllowList()
    try:
        names = allow_names(get())
    except (UsageError, TypeError):
        return AllowList()
    kept = []
    for name in names:
        try:
            parse_allow([name])
        except UsageError:
            continue
        kept.append(name)
    return parse_allow(kept)


def api_allow_list(allow: Iterable[Any] | None) -> AllowList:
    """The allow-list of a Python API call: ``allow`` plus torch's registered globals.

    Raises:
        UsageError: As :func:`parse_allow`.
    """
    if isinstance(allow, str):
        allow = [allow]
    return parse_allow(allow_names(allow), source="allow") | torch_safe_globals()


def allowed_globals(names: Iterable[str]) -> list[str]:
    """Those of ``names`` (``module.name``) read only because the user allowed them:
    trusted now, and on no list of ckpttool's own."""
    allow = ALLOWED.get()
    if not allow:
        return []
    found = []
    for full in names:
        module, _, name = full.rpartition(".")
        if allow.matches(full) and not is_dangerous(module, name):
            if _judge_unlisted(module, name) == UNVERIFIED:
                found.append(full)
    return sorted(found)
