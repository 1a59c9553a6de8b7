"""The restricted unpickler on hand-made pickles: what it rebuilds, what it refuses."""

from __future__ import annotations

import collections
import pickle
from pathlib import Path

import pytest
from helpers import check_error, fixture_path, rewrite_zip, run_cli
from payloads import lazy_tensor, torch_pickle_bytes

import ckpttool
from ckpttool.dtypes import DTYPES
from ckpttool.errors import CkptError, UnsafeError
from ckpttool.sources.spans import ByteSpan
from ckpttool.tree.leaves import StorageRef, TensorRef
from ckpttool.tree.opaque import Opaque
from ckpttool.unpickler import allowing, parse_allow
from ckpttool.unpickler.policy import is_dangerous
from ckpttool.unpickler.restricted import load_pickle

PLAIN = {
    "int": 3,
    "big": 2**70,
    "float": -1.5,
    "nan_free": [0.0, 1e-300],
    "str": "héllo",
    "none": None,
    "bools": (True, False),
    "bytes": b"\x00\xff",
    "bytearray": bytearray(b"ab"),
    "set": {1, 2},
    "frozenset": frozenset({"a"}),
    "complex": 1 + 2j,
    "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
    "nested": {"list": [1, [2, [3]]], "tuple": (1, (2,))},
    "slice": slice(1, None, 2),
}


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_round_trips(protocol):
    seen: set[str] = set()
    out = load_pickle(pickle.dumps(PLAIN, protocol=protocol), seen=seen)
    assert out == PLAIN
    assert type(out["ordered"]) is collections.OrderedDict
    assert list(out["ordered"]) == ["b", "a"]
    assert not any(g.startswith("!") for g in seen)


def test_defaultdict_becomes_plain_dict_without_factory():
    d = collections.defaultdict(list, {"a": [1]})
    out = load_pickle(pickle.dumps(d, protocol=2))
    assert out == {"a": [1]} and type(out) is dict


def _storage_loader(numel=12):
    storages = {}

    def persistent_load(pid):
        assert pid[0] == "storage"
        key = pid[2]
        if key not in storages:
            storages[key] = StorageRef(key, DTYPES["float32"], pid[4], pid[3], ByteSpan(data=b""))
        return storages[key]

    return persistent_load, storages


def test_tensor_becomes_lazy_ref_with_exact_metadata():
    data = torch_pickle_bytes({"w": lazy_tensor("0", (3, 4), 12), "v": lazy_tensor("0", (12,), 12)})
    persistent_load, storages = _storage_loader()
    out = load_pickle(data, persistent_load)
    w = out["w"]
    assert isinstance(w, TensorRef)
    assert (w.dtype.name, w.shape, w.stride, w.offset, w.device) == (
        "float32",
        (3, 4),
        (4, 1),
        0,
        "cpu",
    )
    assert w.storage is out["v"].storage is storages["0"]  # shared storage stays shared
    assert (w.numel, w.nbytes) == (12, 48)


def test_tensor_that_does_not_fit_its_storage_is_corrupt():
    data = torch_pickle_bytes({"w": lazy_tensor("0", (4, 4), 12)})  # 16 elements, storage of 12
    persistent_load, _ = _storage_loader()
    with pytest.raises(CkptError, match="does not fit its storage"):
        load_pickle(data, persistent_load)


class Unknown:
    def __init__(self):
        self.lr = 0.5
        self.name = "x"


def test_unknown_class_is_an_inert_opaque_with_its_attributes():
    data = pickle.dumps({"cfg": Unknown()}, protocol=2)
    with pytest.raises(UnsafeError) as refused:  # constructed (NEWOBJ): refused
        load_pickle(data)
    assert refused.value.dangerous == refused.value.allowable == [f"{__name__}.Unknown"]
    assert refused.value.reasons[f"{__name__}.Unknown"].startswith("constructed")
    seen: set[str] = set()
    with allowing(parse_allow([f"{__name__}.Unknown"])):  # allowed: read inert
        out = load_pickle(data, seen=seen)
    cfg = out["cfg"]
    assert isinstance(cfg, Opaque)
    assert cfg.class_name() == f"{__name__}.Unknown"
    assert repr(cfg) == f"<opaque {__name__}.Unknown>"
    assert cfg.attrs() == {"lr": 0.5, "name": "x"}
    assert not cfg.dangerous
    assert f"{__name__}.Unknown" in seen


# getattr(__import__("os"), "system")("id")
GETATTR_OS_SYSTEM = (
    b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'id'\ntR."
)
# Raw protocol-0 pickles, so every global is spelled exactly as an attacker would.
DANGEROUS_RAW = [
    (b"cos\nsystem\n(S'touch /tmp/x'\ntR.", ["os.system"]),
    (b"cposix\nsystem\n(S'touch /tmp/x'\ntR.", ["posix.system"]),
    (b"cnt\nsystem\n(S'x'\ntR.", ["nt.system"]),
    (b"c__builtin__\neval\n(S'1+1'\ntR.", ["builtins.eval"]),
    (b"cbuiltins\nexec\n(S'1'\ntR.", ["builtins.exec"]),
    (b"cbuiltins\ncompile\n(S'1'\nS'f'\nS'exec'\ntR.", ["builtins.compile"]),
    (b"cbuiltins\nopen\n(S'/etc/passwd'\ntR.", ["builtins.open"]),
    (b"cbuiltins\n__import__\n(S'os'\ntR.", ["builtins.__import__"]),
    (b"csubprocess\ncheck_output\n(S'id'\ntR.", ["subprocess.check_output"]),
    (b"cimportlib\nimport_module\n(S'os'\ntR.", ["importlib.import_module"]),
    (b"crunpy\n_run_code\n(S'1'\n(dtR.", ["runpy._run_code"]),
    (b"csocket\ncreate_connection\n((S'h'\nI1\nttR.", ["socket.create_connection"]),
    (b"cshutil\nrmtree\n(S'/'\ntR.", ["shutil.rmtree"]),
    (b"cpickle\nloads\n(S'x'\ntR.", ["pickle.loads"]),
    (b"c_pickle\nloads\n(S'x'\ntR.", ["_pickle.loads"]),
    (b"ctorch\nload\n(S'x.pt'\ntR.", ["torch.load"]),
    (b"ctorch.serialization\nload\n(S'x.pt'\ntR.", ["torch.serialization.load"]),
    (b"ctorch.jit\nload\n(S'x.pt'\ntR.", ["torch.jit.load"]),
    (b"ctorch.hub\nload\n(S'x'\nS'y'\ntR.", ["torch.hub.load"]),
    (b"cnumpy\nload\n(S'x.npy'\ntR.", ["numpy.load"]),
    (b"coperator\nattrgetter\n(S'system'\ntR.", ["operator.attrgetter"]),
    (b"c_operator\nmethodcaller\n(S'system'\ntR.", ["_operator.methodcaller"]),
    (b"cctypes\nCDLL\n(S'libc.so.6'\ntR.", ["ctypes.CDLL"]),
    (b"cpydoc\npipepager\n(S''\nS'id'\ntR.", ["pydoc.pipepager"]),
    (b"c_posixsubprocess\nfork_exec\n(tR.", ["_posixsubprocess.fork_exec"]),
    (b"cwebbrowser\nopen\n(S'http://x'\ntR.", ["webbrowser.open"]),
    (b"ccodecs\nopen\n(S'/etc/passwd'\ntR.", ["codecs.open"]),
    (b"ctorch\nos\n.", ["torch.os"]),  # torch re-exports os: reaching it is reaching os
    (
        b"ctorch.fx.graph_module\nreduce_graph_module\n(dS'x'\ntR.",
        ["torch.fx.graph_module.reduce_graph_module"],
    ),
    # getattr on anything but a torch class: every global named, not just the first
    (GETATTR_OS_SYSTEM, ["builtins.__import__", "builtins.getattr"]),
    (b"cbuiltins\ngetattr\n(cargparse\nNamespace\nS'__init__'\ntR.", ["builtins.getattr"]),
    # Python 2 names that the real unpickler maps to Python 3 modules (protocol <= 2)
    (b"cthread\nstart_new_thread\n(tR.", ["_thread.start_new_thread"]),
    (b"ccommands\ngetoutput\n(S'id'\ntR.", ["subprocess.getoutput"]),
    (b"chttplib\nHTTPConnection\n(S'evil.invalid'\ntR.", ["http.client.HTTPConnection"]),
    (b"cSimpleHTTPServer\ntest\n(tR.", ["http.server.test"]),
    (b"ccPickle\nloads\n(S'x'\ntR.", ["pickle.loads"]),
]


@pytest.mark.parametrize(
    "data,expected", DANGEROUS_RAW, ids=[",".join(e) for _, e in DANGEROUS_RAW]
)
def test_dangerous_globals_are_refused_and_named(data, expected):
    with pytest.raises(UnsafeError) as info:
        load_pickle(data, path="evil.pkl")
    assert info.value.dangerous == expected
    assert info.value.exit_code == 3
    message = str(info.value)
    assert message.startswith("evil.pkl: ") and "\n" not in message
    for name in expected:
        assert name in message


@pytest.mark.parametrize("data,expected", DANGEROUS_RAW[:6])
def test_permissive_keeps_dangerous_globals_inert(data, expected):
    seen: set[str] = set()
    out = load_pickle(data, permissive=True, seen=seen)
    assert isinstance(out, Opaque) and out.dangerous
    assert {"!" + g for g in expected} <= seen


def test_calling_a_stand_in_gives_another_stand_in():
    # getattr(__import__("os"), "system")("id") under --unsafe: all inert, no error
    out = load_pickle(GETATTR_OS_SYSTEM, permissive=True)
    assert isinstance(out, Opaque) and out.dangerous
    assert out.args == ("id",)


def test_getattr_reaches_nested_torch_classes_only():
    seen: set[str] = set()
    data = (
        b"cbuiltins\ngetattr\n(ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n"
        b"S'ProcessGroupState'\ntR."
    )
    cls = load_pickle(data, seen=seen)
    assert issubclass(cls, Opaque) and not cls.dangerous
    assert cls.class_name() == (
        "torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState"
    )
    private = data.replace(b"ProcessGroupState", b"__reduce__")
    with pytest.raises(UnsafeError, match="builtins.getattr"):
        load_pickle(private)
    # judged as the same name spelled as a global would be (a store opens files, sockets)
    store = data.replace(b"ProcessGroupState", b"TCPStore")
    with pytest.raises(UnsafeError, match="builtins.getattr"):
        load_pickle(store)


def test_python2_names_of_safe_builtins_load():
    assert load_pickle(b"c__builtin__\nunicode\n(Vabc\ntR.") == "abc"
    made = b"ccopy_reg\n_reconstructor\n(c__main__\nC\nc__builtin__\nobject\nNtR."
    with pytest.raises(UnsafeError, match="--allow __main__.C"):  # constructed: refused
        load_pickle(made)
    with allowing(parse_allow(["__main__.C"])):
        assert load_pickle(made).class_name() == "__main__.C"


def test_range_is_an_inert_placeholder_that_cannot_be_iterated():
    # set(range(10**12)) is a few bytes of pickle that would never finish; xrange is its
    # Python 2 name. range is harmless to name, and its placeholder iterates nothing.
    for data in (b"c__builtin__\nrange\n(I3\ntR.", b"c__builtin__\nxrange\n(I3\ntR."):
        value = load_pickle(data)
        assert isinstance(value, Opaque) and value.class_name() == "builtins.range"
        assert value.args == (3,)
    with pytest.raises(CkptError, match="not iterable"):
        load_pickle(b"c__builtin__\nset\n(c__builtin__\nrange\n(I1000000000000\ntRtR.")


@pytest.mark.parametrize(
    "module,name,dangerous",
    [
        ("os", "system", True),
        ("os.path", "join", True),
        ("posix", "system", True),
        ("builtins", "eval", True),
        ("builtins", "getattr", True),
        ("builtins", "dict", False),
        ("builtins", "ValueError", False),
        ("collections", "OrderedDict", False),
        ("torch._utils", "_rebuild_tensor_v2", False),
        ("torch", "load", True),
        ("torch.serialization", "load", True),
        ("torch.storage", "_load_from_bytes", True),
        ("numpy.core.multiarray", "_reconstruct", False),
        ("argparse", "Namespace", False),
        ("mylib.utils", "system", True),  # a `system` anywhere is refused
        ("mylib", "subprocess", True),  # so is reaching a dangerous module by attribute
        ("io", "BytesIO", False),  # in-memory buffers are harmless (DCP keeps them)...
        ("_io", "StringIO", False),
        ("io", "FileIO", True),  # ...files are not
        ("_io", "open", True),
        ("builtins", "range", False),
        ("torch.jit._pickle", "build_intlist", True),  # (read as an identity function)
        ("torch.jit", "load", True),
    ],
)
def test_is_dangerous_table(module, name, dangerous):
    assert is_dangerous(module, name) is dangerous


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "truncated pickle"),
        (b"\x80\x02}q\x00(X\x01\x00\x00\x00a", "truncated pickle"),
        (b"\xff\xfe garbage", "corrupt pickle"),
        (b"c__builtin__\nbytes\n(I1000000000\ntR.", "absurd buffer size"),
        (b"c__builtin__\nbytearray\n(I1000000000\ntR.", "absurd buffer size"),
        (b"ctorch\nFloatStorage\n(tR.", "corrupt pickle"),  # a storage class is not callable
    ],
)
def test_corrupt_pickles_raise_ckpt_error(data, message):
    with pytest.raises(CkptError, match=message) as info:
        load_pickle(data, path="f.pkl")
    assert not isinstance(info.value, UnsafeError)
    assert info.value.path == "f.pkl"


def test_persistent_id_without_a_loader_is_corrupt():
    data = torch_pickle_bytes({"w": lazy_tensor("0", (2,), 2)})
    with pytest.raises(CkptError, match="unexpected persistent id"):
        load_pickle(data)


# A pickle may BUILD (set attributes) on any object it names. The objects find_class
# hands out for safe globals are shared by every later read in the process, so a file
# that is not refused must not be able to change how the NEXT file is read.
POISON = [
    # torch.float32.__dict__.update(itemsize=1)
    b"\x80\x02ctorch\nfloat32\n}X\x08\x00\x00\x00itemsizeK\x01sb.",
    # setattr(_rebuild_tensor_v2, "__kwdefaults__", {"dtype": torch.int8})
    b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}X\x0e\x00\x00\x00__kwdefaults__"
    b"}X\x05\x00\x00\x00dtypectorch\nint8\nss\x86b.",
    # setattr(_rebuild_tensor_v2, "__defaults__", (True,))
    b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}X\x0c\x00\x00\x00__defaults__K\x01\x85s\x86b.",
    # setattr(<stand-in class for builtins.object>, "qualname", "hacked")
    b"\x80\x02cbuiltins\nobject\nN}X\x08\x00\x00\x00qualnameX\x06\x00\x00\x00hackeds\x86b.",
]


@pytest.mark.parametrize("data", POISON, ids=["dtype", "kwdefaults", "defaults", "opaque-class"])
def test_a_pickle_cannot_change_how_later_files_are_read(data, tmp_path):
    import torch

    good = tmp_path / "good.pt"
    original = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "o": object()}
    torch.save({"w": original["w"]}, good)
    try:
        load_pickle(data, path="poison.pkl")
    except CkptError:
        pass  # refusing the pickle is fine; changing shared state is not
    sd = ckpttool.load(good)
    assert sd["w"].dtype == torch.float32
    assert torch.equal(sd["w"], original["w"])
    assert DTYPES["float32"].itemsize == 4
    out = load_pickle(b"\x80\x02cbuiltins\nobject\n)\x81.")
    assert out.class_name() == "builtins.object"


def _corpus_pickles() -> list:
    from attack_corpus import CASES

    return [pytest.param(case, id=case.name) for case in CASES if case.exit == 3]


@pytest.mark.parametrize("case", _corpus_pickles())
def test_a_globals_scan_refuses_what_a_full_read_refuses(case):
    """The scan that judges the other rank files (GlobalsScanner) names the same globals:
    a stand-in that calls its argument (copyreg's reconstructor, torch's subclass
    rebuilder, numpy's RNG constructors) is judged there too."""
    data = case.build("marker")
    with pytest.raises(UnsafeError) as info:
        load_pickle(data, lambda pid: None, scan_only=True)
    for name in case.names:  # (a scan names an object it calls or converts "<an object>")
        assert name in str(info.value) or "(" in name, (name, str(info.value))


class _Call:
    """Pickles as ``function(*args)``: a torch.device made as a file may make it."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


@pytest.mark.parametrize("text", ["cuda:01", "cuda:00", "cuda:", "cuda:-1", "cuda:1x"])
def test_device_string_torch_refuses_is_corrupt(tmp_path, text):
    # a torch.device is written back into merged outputs: one torch cannot parse made
    # an output torch.load could not read
    import torch

    with pytest.raises(CkptError, match="corrupt torch.device"):
        load_pickle(pickle.dumps(_Call(torch.device, text), protocol=2))
    path = tmp_path / "device.pt"
    data = pickle.dumps({"model": {}, "device": _Call(torch.device, text)}, protocol=2)
    source = fixture_path("ddp/ep0-rank0.pt")
    rewrite_zip(source, path, lambda name, old: data if name.endswith("/data.pkl") else None)
    out = tmp_path / "out"
    out.mkdir()
    check_error(run_cli("merge", path, "-o", out / "m.pt"), 2, "corrupt torch.device")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("text", ["cuda:0", "cuda:10", "cpu", "meta"])
def test_device_string_torch_reads_is_kept(text):
    import torch

    assert load_pickle(pickle.dumps(_Call(torch.device, text), protocol=2)) == text


class _Holder:
    """An object of a class on no allow-list, pickled as NEWOBJ + BUILD of its __dict__."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class _SwappedPartial:
    """Pickles as ``partial(first)`` whose BUILD state makes it call ``then`` instead
    (``partial.__setstate__`` takes the function from its state)."""

    def __init__(self, first, then, *args):
        self.first, self.then, self.args = first, then, args

    def __reduce__(self):
        import functools

        return functools.partial, (self.first,), (self.then, self.args, {}, None)


def _judged_both_ways(obj, allow: tuple[str, ...] = ()) -> list[str]:
    """What a full read and a globals scan each refuse in the pickle of ``obj``."""
    data = pickle.dumps(obj, protocol=2)
    refused = []
    for scan_only in (False, True):
        try:
            with allowing(parse_allow(allow)):
                load_pickle(data, lambda pid: None, scan_only=scan_only)
        except UnsafeError as exc:
            refused.append(str(exc))
    return refused


_HOLDER = f"{__name__}._Holder"


def test_an_objects_partial_of_a_torch_class_is_no_call_of_note():
    import functools

    import torch.nn as nn

    # torchvision's VisionTransformer keeps norm_layer = partial(nn.LayerNorm, eps=1e-6)
    held = _Holder(norm_layer=functools.partial(nn.LayerNorm, eps=1e-6))
    assert _judged_both_ways(held, (_HOLDER,)) == []  # the holder's class allowed
    refused = _judged_both_ways(held)  # else the holder is refused, as constructed
    assert len(refused) == 2 and all(f"{_HOLDER} (constructed)" in r for r in refused), refused


def test_an_objects_partial_that_calls_something_of_note_is_refused_both_ways():
    import functools
    import logging

    import torch.nn as nn

    for held in (
        functools.partial(logging.FileHandler, "marker"),  # a class on no allow-list
        functools.partial(nn.LayerNorm, _Holder()),  # an unknown object given to a known class
        _SwappedPartial(nn.LayerNorm, logging.FileHandler, "marker"),  # BUILD swaps the function
    ):
        # (the holder on no list is refused as constructed, the partial as called)
        refused = _judged_both_ways(_Holder(hook=held))
        assert len(refused) == 2 and all("functools.partial()" in r for r in refused), refused
        assert all(_HOLDER in r for r in refused), refused


def test_a_partial_built_again_and_again_keeps_only_its_last_state():
    """BUILD replaces a partial's state (partial.__setstate__ does): 20,000 BUILDs of one
    memoized 5,000-item state are 60 KB of pickle, never 10**8 items held."""
    state = (
        b"(" + b"ctorch.nn\nLayerNorm\n"  # (func, args, keywords, __dict__)
        + b"(" + b"K\x01" * 5000 + b"t"
        + b"}N" + b"t" + b"q\x01"  # BINPUT 1
    )  # fmt: skip
    partial = b"cfunctools\npartial\n(ctorch.nn\nLayerNorm\ntR" + state + b"b"
    again = b"h\x01b" * 20_000  # BINGET 1, BUILD
    data = b"\x80\x02" + partial + again + b"."
    assert len(data) < 80_000  # (a small file)
    for scan_only in (False, True):
        load_pickle(data, lambda pid: None, scan_only=scan_only)  # reads, refuses nothing


def test_partials_given_the_same_partial_twice_are_judged_once_each():
    """40 levels of partial(LayerNorm, p, p): 2 KB of pickle, 2**40 paths. Each partial
    is judged once per judgment (the budget for what constructors build was spent on
    judging them again and again), and the tree is then refused for its shared paths."""
    part, layer_norm = b"cfunctools\npartial\n", b"ctorch.nn\nLayerNorm\n"
    body = part + b"(" + layer_norm + b"tRq\x00"
    for i in range(1, 40):
        get = b"h" + bytes([i - 1])
        body += part + b"(" + layer_norm + get + get + b"tRq" + bytes([i])
    data = b"\x80\x02" + body + b"0ccollections\ndeque\n(]h" + bytes([39]) + b"atR."
    load_pickle(data, lambda pid: None, scan_only=True)  # judged, nothing of note
    with pytest.raises(CkptError, match="containers shared by many paths"):
        load_pickle(data, lambda pid: None)


def _verdict(path: Path, scan_only: bool) -> tuple[str, list[str]]:
    """("unsafe", the globals named) or ("read", []) for one way of reading the torch
    zip ``path``; a corrupt file counts as read: it was not refused."""
    from ckpttool.formats.torch_save.zip_pickle import ZipPickle

    try:
        with ZipPickle(str(path)) as archive:
            archive.scan() if scan_only else archive.load()
    except UnsafeError as exc:
        # (what a stand-in's words name, "list(<an object>)", differs between the two)
        return "unsafe", sorted({g for g in exc.dangerous if "(" not in g})
    except CkptError:
        pass
    return "read", []


def _whole_corpus() -> list:
    from attack_corpus import CASES

    return [pytest.param(case, id=case.name) for case in CASES]


@pytest.mark.parametrize("case", _whole_corpus())
def test_a_globals_scan_and_a_full_read_agree_on_the_whole_corpus(tmp_path, case):
    """Every case of the attack corpus, refused or not: the globals scan that judges the
    other rank files refuses exactly what a full read refuses, naming the same globals
    (the call rules are written once, in tree/call_rules.py, and both apply them)."""
    from attack_corpus import write_case

    path = write_case(case, tmp_path)
    full, scan = _verdict(path, scan_only=False), _verdict(path, scan_only=True)
    assert scan == full, (full, scan)
    assert full[0] == ("unsafe" if case.exit == 3 else "read")


@pytest.mark.parametrize("scan_only", [False, True], ids=["read", "scan"])
def test_a_read_keeps_nothing_it_built_once_its_result_is_dropped(scan_only):
    """A memoized ``getattr`` is the unpickler's own bound method: left in the memo it
    tied every object the pickle built to the unpickler in a cycle, which only the
    collector frees, and the collector is paused while a checkpoint is read (256
    ShardedTensor rank files scanned kept 4.5 GiB). Dropped, all of it goes at once."""
    import gc
    import sys

    data = pickle.dumps([getattr, [(i, str(i)) for i in range(100_000)]], protocol=2)
    gc.collect()
    gc.disable()
    try:
        before = sys.getallocatedblocks()
        result = load_pickle(data, permissive=True, scan_only=scan_only, check=False)
        del result
        kept = sys.getallocatedblocks() - before
    finally:
        gc.enable()
    assert kept < 10_000, kept  # the 100,000 tuples (300,000 blocks) are gone


def test_a_stopped_read_whose_rest_the_walk_cannot_reach_is_refused(monkeypatch):
    """One of ckpttool's limits stops the read; the rest of the pickle goes past what the
    static walk reads: its verdict cannot be reached, so it is refused, never exit 2."""
    import ckpttool.unpickler.restricted as restricted

    monkeypatch.setattr(restricted, "MAX_STATIC_SCAN_BYTES", 1 << 20)
    monkeypatch.setattr(restricted, "STATIC_SCAN_CHUNK", 1 << 18)
    limit = b"\x80\x02cbuiltins\nbytearray\n(J\x00\x2d\x31\x01tR0"  # bytearray(20_000_000)
    text = b"X" + (3 << 20).to_bytes(4, "little") + b"a" * (3 << 20) + b"0"
    with pytest.raises(UnsafeError, match="cannot be vouched for"):
        load_pickle(limit + text + b"N.")
    with pytest.raises(CkptError, match="absurd buffer size") as short:  # walked to STOP
        load_pickle(limit + b"N.")
    assert not isinstance(short.value, UnsafeError)
