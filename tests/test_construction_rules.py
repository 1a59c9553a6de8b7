"""Construction is a call (issue 46): what a pickle makes torch construct, change or
call is refused unless ckpttool vouches for it or the user allows it, in a full read
and in the globals scan alike, naming the global and how it is used."""

from __future__ import annotations

import struct

import pytest

from ckpttool.errors import CkptError, UnsafeError
from ckpttool.unpickler import allowing, load_pickle, parse_allow

P2 = b"\x80\x02"


def g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def t(value: str) -> bytes:
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


# bytearray(20_000_000): one of ckpttool's own limits stops the full read here
LIMIT = P2 + g("builtins", "bytearray") + b"(J\x00\x2d\x31\x01tR0"

REFUSED = {
    # name: (pickle, the global named, how)
    "newobj-of-a-class-on-no-list": (
        P2 + g("mylib.cfg", "Thing") + b")\x81.", "mylib.cfg.Thing", "constructed"),
    "newobj-ex": (P2 + g("mylib.cfg", "Thing") + b")}\x92.", "mylib.cfg.Thing", "constructed"),
    "copyreg-newobj": (
        P2 + g("copyreg", "__newobj__") + b"(" + g("mylib.cfg", "Thing") + b"tR.",
        "mylib.cfg.Thing", "constructed",
    ),
    "copyreg-reconstructor": (
        P2 + g("copyreg", "_reconstructor") + b"(" + g("mylib.cfg", "Thing")
        + g("builtins", "object") + b"NtR.",
        "mylib.cfg.Thing", "constructed",
    ),
    "sympy-sympifies": (
        P2 + g("sympy.core.containers", "Tuple") + b"(" + t("open('m','w').close()") + b"t\x81.",
        "sympy.core.containers.Tuple", "",
    ),
    "a-metaclass-by-name": (
        P2 + g("abc", "ABCMeta") + b"(" + t("X") + b"(" + g("torch.nn", "Module") + b"t}tR.",
        "abc.ABCMeta", "",
    ),
    "a-class-made-by-any-class": (
        P2 + g("transformers", "Foo") + b"(" + t("X") + b"(" + g("torch.nn", "Module")
        + b"t}t\x81.",
        "transformers.Foo", "made a class",
    ),
    "setitem-on-a-module-level-object": (
        P2 + g("mylib.cfg", "REGISTRY") + t("k") + t("v") + b"s0N.",
        "mylib.cfg.REGISTRY", "changed by SETITEM/APPEND",
    ),
    "setitems-on-a-module-level-object": (
        P2 + g("mylib.cfg", "REGISTRY") + b"(" + t("k") + t("v") + t("j") + t("w") + b"u0N.",
        "mylib.cfg.REGISTRY", "changed by SETITEM/APPEND",
    ),
    "append-to-a-module-level-object": (
        P2 + g("mylib.cfg", "HOOKS") + t("k") + b"a0N.",
        "mylib.cfg.HOOKS", "changed by SETITEM/APPEND",
    ),
    "a-class-swap-by-build": (
        P2 + g("argparse", "Namespace") + b")\x81" + b"N}" + t("__class__")
        + g("argparse", "Namespace") + b"s\x86b.",
        "argparse.Namespace", "given a __class__ or __dict__",
    ),
    "a-framework-config-called": (
        P2 + g("transformers.training_args", "TrainingArguments") + b")R.",
        "transformers.training_args.TrainingArguments", "called",
    ),
    "a-datapipe-wrapper-under-a-re-export": (
        P2 + g("torch.utils.data.dataloader", "_IterDataPipeSerializationWrapper") + b")\x81.",
        "torch.utils.data.dataloader._IterDataPipeSerializationWrapper", "",
    ),
    # after a limit stops the read, the static walk applies the same rules
    "limit-then-newobj": (LIMIT + g("mylib.cfg", "Thing") + b")\x81.", "mylib.cfg.Thing", ""),
    "limit-then-mutation": (
        LIMIT + g("mylib.cfg", "REGISTRY") + t("k") + t("v") + b"s0N.",
        "mylib.cfg.REGISTRY", "changed by SETITEM/APPEND",
    ),
    "limit-then-an-object-called": (
        LIMIT + g("functools", "partial") + b"(" + g("pathlib", "Path.touch")
        + g("pathlib", "Path") + b"(" + t("m") + b"tRtR)R.",
        "<an object>()", "called",
    ),
}  # fmt: skip

READ = {
    "a-vouched-class-made-and-restored": P2 + g("argparse", "Namespace") + b")\x81}"
    + t("lr") + b"K\x01sb.",
    "a-framework-config-made-and-restored": P2
    + g("transformers.training_args", "TrainingArguments") + b")\x81}" + t("a") + b"K\x01sb.",
    "a-framework-enum-called-by-value": P2 + g("transformers.trainer_utils", "IntervalStrategy")
    + b"(" + t("steps") + b"tR.",
    "a-class-on-no-list-only-named": P2 + g("mylib.cfg", "Thing") + b".",
    "an-ordered-dict-with-items": P2 + g("collections", "OrderedDict") + b")R("
    + t("k") + b"K\x01u.",
}  # fmt: skip


@pytest.mark.parametrize("scan_only", [False, True], ids=["read", "scan"])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_ckpttool_cannot_vouch_for_is_refused(name, scan_only):
    data, culprit, how = REFUSED[name]
    with pytest.raises(UnsafeError) as caught:
        load_pickle(data, scan_only=scan_only)
    assert culprit in caught.value.dangerous, caught.value.reasons
    assert caught.value.reasons[culprit].startswith(how), caught.value.reasons


@pytest.mark.parametrize("scan_only", [False, True], ids=["read", "scan"])
@pytest.mark.parametrize("name", sorted(READ))
def test_what_ckpttool_vouches_for_reads(name, scan_only):
    load_pickle(READ[name], scan_only=scan_only)


def test_allowed_a_constructed_class_reads_inert_and_dangerous_ones_stay_refused():
    data = REFUSED["newobj-of-a-class-on-no-list"][0]
    with pytest.raises(UnsafeError) as caught:
        load_pickle(data)
    assert caught.value.allowable == ["mylib.cfg.Thing"]
    assert "--allow mylib.cfg.Thing" in str(caught.value)
    with allowing(parse_allow(["mylib.cfg.Thing"])):
        assert repr(load_pickle(data)) == "<opaque mylib.cfg.Thing>"
    for dangerous in ("sympy.core.containers.Tuple", "abc.ABCMeta", "_compat_pickle.NAME_MAPPING"):
        with pytest.raises(CkptError, match="no allow-list opens it"):
            parse_allow([dangerous])
    # a swap or a mutation is refused whatever is allowed
    with allowing(parse_allow(["argparse.*", "mylib.cfg.*"])):
        for name in ("a-class-swap-by-build", "setitem-on-a-module-level-object"):
            with pytest.raises(UnsafeError):
                load_pickle(REFUSED[name][0])
