"""Every pickle protocol, opcode by opcode, wherever ``torch.load`` would unpickle it.

Hostile pickles of protocols 0 to 5 (text GLOBAL / INST / OBJ, STACK_GLOBAL, REDUCE,
NEWOBJ, NEWOBJ_EX, BUILD on a module) are written byte by byte and placed where
``torch.load(weights_only=False)`` runs them: a raw file (no PROTO header for 0 and 1),
a zip's ``data.pkl``, a legacy stream, after a torch magic number (concatenated
pickles), the tar container of PyTorch < 0.4. A plain ``torch.load`` proves each live
(its marker file appears); ckpttool refuses each with exit 3 naming the global, and
``--json`` says how the pickle uses it. ``torch.save`` with every ``pickle_protocol``
reads bitwise in every command and in ``ckpttool.load``.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from attack_corpus import write_torch_zip
from helpers import check_error, completed, run_child, run_many, write_dcp

import ckpttool
from ckpttool.errors import UnsafeError
from ckpttool.unpickler.pickle_scan import is_pickle_start, scan_pickle
from ckpttool.unpickler.policy import python3_name
from ckpttool.unpickler.restricted import load_pickle

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
SYS_INFO = {"protocol_version": 1001, "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 4}}  # fmt: skip


# ------------------------------------------------------------ opcodes, by hand


def text0(value: str) -> bytes:
    """Protocol 0 STRING: a quoted line."""
    return b"S" + repr(value).encode() + b"\n"


def text1(value: str) -> bytes:
    """BINUNICODE (protocol 1)."""
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def short4(value: str) -> bytes:
    """SHORT_BINUNICODE + MEMOIZE (protocol 4)."""
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data + b"\x94"


def framed(proto: int, body: bytes) -> bytes:
    """PROTO, one FRAME around the body (protocols 4 and 5 frame their opcodes)."""
    return b"\x80" + bytes([proto]) + b"\x95" + struct.pack("<Q", len(body)) + body


def touch(marker: str) -> str:
    return f"open({marker!r}, 'w').close()"


def p0_global_reduce(m: str) -> bytes:
    """Protocol 0, text only: ``posix.system('touch m')`` (GLOBAL, MARK, STRING, TUPLE, REDUCE)."""
    return b"cposix\nsystem\n(" + text0(f"touch {m}") + b"tR."


def p0_hex_int(m: str) -> bytes:
    """Protocol 0 INT in hex (C's unpickler takes ``0x1``), popped, then the call."""
    return b"I0x1\n0" + p0_global_reduce(m)


def p0_mark_pop(m: str) -> bytes:
    """MARK then POP: C's POP takes the MARK off (a walk that calls it an underflow
    stops before the call)."""
    return b"(0" + p0_global_reduce(m)


def p0_inst(m: str) -> bytes:
    """Protocol 0 INST: the class (here a function) called with the marked arguments."""
    return b"(" + text0(f"touch {m}") + b"iposix\nsystem\n."


def p0_persid_then_eval(m: str) -> bytes:
    """Protocol 0 PERSID (a text persistent id torch's own loader refuses) after an eval."""
    return b"(c__builtin__\neval\n(" + text0(touch(m)) + b"tRPsome id\nt."


def p1_obj(m: str) -> bytes:
    """Protocol 1 (binary opcodes, no PROTO header): OBJ calls the class on the marked items."""
    return b"(cbuiltins\nexec\n" + text1(touch(m)) + b"o."


def p1_global_reduce(m: str) -> bytes:
    """Protocol 1: GLOBAL + MARK ... TUPLE + REDUCE."""
    return b"cposix\nsystem\n(" + text1(f"touch {m}") + b"tR."


def p2_newobj(m: str) -> bytes:
    """Protocol 2: ``list(starmap(FileHandler, [(m,)]))`` (NEWOBJ makes the starmap;
    iterating it makes the file)."""
    starmap_args = b"(clogging\nFileHandler\n]((" + text1(m) + b"tet"
    return b"\x80\x02cbuiltins\nlist\n(citertools\nstarmap\n" + starmap_args + b"\x81tR."


def p2_module_override(m: str) -> bytes:
    """Protocol 2, picklescan's module override: BUILD gives a module new attributes,
    then ``builtins.eval`` runs."""
    build = b"ctorch\nnn\n}" + text1("ckpttool_was_here") + b"K\x01sb"
    return b"\x80\x02(" + build + b"cbuiltins\neval\n(" + text1(touch(m)) + b"tRt."


def p4_stack_global(m: str) -> bytes:
    """Protocol 4: STACK_GLOBAL of two memoized strings, TUPLE1, REDUCE, in a FRAME."""
    call = short4("posix") + short4("system") + b"\x93\x94" + short4(f"touch {m}") + b"\x85\x94R"
    return framed(4, call + b"\x94.")


def p4_newobj_ex(m: str) -> bytes:
    """Protocol 4 NEWOBJ_EX (class, args, kwargs): the starmap again, iterated by list."""
    starmap_args = (
        b"(" + short4("logging") + short4("FileHandler") + b"\x93]((" + short4(m) + b"tet"
    )
    starmap = short4("itertools") + short4("starmap") + b"\x93" + starmap_args + b"}\x92"
    body = short4("builtins") + short4("list") + b"\x93" + starmap + b"\x85R."
    return framed(4, body)


def p5_stack_global_memo(m: str) -> bytes:
    """Protocol 5: the function reached again through the memo (BINGET), called twice."""
    body = short4("builtins") + short4("exec") + b"\x93\x94" + b"h\x02" + short4(touch(m))
    return framed(5, body + b"\x85R\x85R.")


# name -> (builder, a global the refusal must name)
PAYLOADS: dict[str, tuple[Callable[[str], bytes], str]] = {
    "p0-global-reduce": (p0_global_reduce, "posix.system"),
    "p0-hex-int": (p0_hex_int, "posix.system"),
    "p0-mark-pop": (p0_mark_pop, "posix.system"),
    "p0-inst": (p0_inst, "posix.system"),
    "p0-persid": (p0_persid_then_eval, "builtins.eval"),
    "p1-obj": (p1_obj, "builtins.exec"),
    "p1-global-reduce": (p1_global_reduce, "posix.system"),
    "p2-newobj": (p2_newobj, "logging.FileHandler"),
    "p2-module-override": (p2_module_override, "builtins.eval"),
    "p4-stack-global": (p4_stack_global, "posix.system"),
    "p4-newobj-ex": (p4_newobj_ex, "logging.FileHandler"),
    "p5-memo": (p5_stack_global_memo, "builtins.exec"),
}


def legacy_stream(main: bytes) -> bytes:
    """A pre-1.6 torch.save stream whose main pickle is ``main`` (no storages)."""
    head = b"".join(pickle.dumps(v, protocol=2) for v in (MAGIC_NUMBER, 1001, SYS_INFO))
    return head + main + pickle.dumps([], protocol=2)


def tar_container(storages: bytes, tensors: bytes | None = None, main: bytes | None = None):
    """The tar container of torch < 0.4: members ``storages``, ``tensors``, ``pickle``."""
    buf = io.BytesIO()
    members = {"storages": storages, "tensors": tensors, "pickle": main}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            if data is not None:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_container(kind: str, path: Path, payload: bytes) -> Path:
    if kind == "raw":
        path.write_bytes(payload)
    elif kind == "zip":
        write_torch_zip(path, payload)
    elif kind == "legacy":
        path.write_bytes(legacy_stream(payload))
    elif kind == "after-magic":  # torch.load reads it as the protocol version
        path.write_bytes(pickle.dumps(MAGIC_NUMBER, protocol=2) + payload)
    elif kind == "tar":
        path.write_bytes(tar_container(payload))
    return path


CONTAINERS = ("raw", "zip", "legacy", "after-magic", "tar")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict:
    """Every payload in every container, proved live by a plain torch.load, then run
    through ckpttool's commands once (one interpreter): {(payload, container): {...}}."""
    base = tmp_path_factory.mktemp("protocols")
    files = {}
    for name, (build, _) in PAYLOADS.items():
        for kind in CONTAINERS:
            folder = base / f"{name}-{kind}"
            folder.mkdir()
            marker = folder / "marker"
            files[(name, kind)] = (
                write_container(kind, folder / "f.pt", build(str(marker))),
                marker,
            )
    run_child("run-payloads", items=[str(p) for p, _ in files.values()], cwd=base)
    live = {key: marker.exists() for key, (_, marker) in files.items()}
    for _, marker in files.values():
        marker.unlink(missing_ok=True)
    argvs = []
    for path, _ in files.values():
        argvs += [["inspect", "--json", path], ["convert", path, "--to", "safetensors",
                  "-o", path.with_name("out.safetensors")]]  # fmt: skip
    results = iter(run_many(argvs))
    return {
        key: {
            "path": path,
            "marker": marker,
            "live": live[key],
            "inspect": next(results),
            "convert": next(results),
        }  # fmt: skip
        for key, (path, marker) in files.items()
    }


@pytest.mark.parametrize("kind", CONTAINERS)
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_live_payload_of_any_protocol_is_refused_naming_its_global(hostile, name, kind):
    run = hostile[(name, kind)]
    assert run["live"], "a plain torch.load must run it, else the test proves nothing"
    expected = PAYLOADS[name][1]
    for command in ("inspect", "convert"):
        line = check_error_json_ok(run[command], command)
        assert expected in line, (command, line)
    report = json.loads(run["inspect"]["stdout"])
    assert report["refused"] is True
    assert expected in report["dangerous"] and expected in report["globals"]
    assert set(report["reasons"]) == set(report["dangerous"])
    assert all(report["reasons"].values())
    assert not run["marker"].exists()
    assert sorted(p.name for p in run["path"].parent.iterdir()) == ["f.pt"]  # no output


def check_error_json_ok(result: dict, command: str) -> str:
    """Exit 3, one stderr line (inspect --json may print its object on stdout)."""
    assert result["code"] == 3, (command, result)
    assert "Traceback" not in result["stderr"] + result["stdout"]
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpttool: refused: "), lines
    if command != "inspect":
        assert result["stdout"] == ""
    return lines[0]


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("p0-global-reduce", "called"),
        ("p0-inst", "called"),
        ("p1-obj", "called"),
        ("p2-module-override", "called"),
    ],
)
def test_json_says_how_the_pickle_uses_each_dangerous_global(hostile, name, reason):
    report = json.loads(hostile[(name, "raw")]["inspect"]["stdout"])
    assert report["reasons"][PAYLOADS[name][1]] == reason
    assert report["format"] == "pickle"
    assert report["tensors"] == [] and report["num_tensors"] == 0


def test_module_override_names_the_module_and_eval(hostile):
    """BUILD on ``torch.nn`` (the module itself) then eval: both named, no TypeError."""
    for kind in CONTAINERS:
        report = json.loads(hostile[("p2-module-override", kind)]["inspect"]["stdout"])
        assert report["dangerous"] == ["builtins.eval", "torch.nn"], kind
        assert report["reasons"]["torch.nn"].startswith("given BUILD state"), kind


def test_zip_refusal_json_names_the_format(hostile):
    report = json.loads(hostile[("p4-stack-global", "zip")]["inspect"]["stdout"])
    assert report["format"] == "torch-zip"
    assert report["reasons"] == {"posix.system": "called"}


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_globals_scan_refuses_what_the_full_read_refuses(tmp_path, name):
    """The scan of other rank files (GlobalsScanner) and the full read agree."""
    build, expected = PAYLOADS[name]
    data = build(str(tmp_path / "marker"))
    refused = []
    for scan_only in (False, True):
        with pytest.raises(UnsafeError) as info:
            load_pickle(data, scan_only=scan_only)
        # (what is named by a stand-in's words, "list(<an object>)", may differ)
        refused.append([g for g in info.value.dangerous if "(" not in g])
    assert refused[0] == refused[1]
    assert expected in refused[0]


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_static_walk_names_every_global(tmp_path, name):
    build, expected = PAYLOADS[name]
    data = build(str(tmp_path / "marker"))
    uses = scan_pickle(data, python3_name)
    assert uses.complete and uses.error is None and uses.end == len(data)
    assert expected in uses.uses
    assert is_pickle_start(data[:16])


def test_a_read_that_fails_early_still_names_what_follows():
    """A persistent id the reader refuses stops the read; the eval after it is named."""
    data = b"\x80\x02(X\x02\x00\x00\x00idQcbuiltins\neval\n(X\x03\x00\x00\x001+1tRt."
    with pytest.raises(UnsafeError) as info:
        load_pickle(data, persistent_load=lambda pid: 1 / 0)
    assert info.value.dangerous == ["builtins.eval"]
    assert info.value.reasons == {"builtins.eval": "called"}


def test_a_global_named_by_computed_strings_is_refused():
    """STACK_GLOBAL of a REDUCE's result: the static walk cannot know the name."""
    body = b"\x80\x04(" + short4("builtins") + short4("str") + b"\x93" + short4("posix")
    data = body + b"\x85R" + short4("system") + b"\x93K\x00\x85R" + b"t."
    uses = scan_pickle(data)
    assert any(name.startswith("<a global named by") for name in uses.uses)


@pytest.mark.parametrize("name", ["p0-global-reduce", "p1-obj", "p2-module-override"])
def test_dcp_metadata_of_any_protocol_is_judged(tmp_path, name):
    build, expected = PAYLOADS[name]
    folder = tmp_path / "dcp"
    write_dcp(folder, {"w": torch.ones(2)})
    (folder / ".metadata").write_bytes(build(str(tmp_path / "marker")))
    (result,) = run_many([["inspect", "--json", folder]])
    line = check_error_json_ok(result, "inspect")
    assert expected in line
    assert json.loads(result["stdout"])["format"] == "dcp"


# ------------------------------------------------------------ benign pickles


@pytest.mark.parametrize("protocol", range(6))
def test_a_benign_pickle_of_any_protocol_is_exit_2_saying_so(tmp_path, protocol):
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"a": [1, 2.5, "x"]}, protocol=protocol))
    (result,) = run_many([["inspect", path]])
    check_error(completed([], result), 2, "a pickle that is not a torch checkpoint")


def test_text_files_are_not_pickles(tmp_path):
    files = {
        "a.txt": "hello world\n",
        "b.csv": "1,2\n3,4\n",
        "c.json": '{"a": 1}',
        "d.md": "# Title\n\nIt is.\n",
        "e.yaml": "lr: 0.1\n",
        "f.txt": "Some text without a newline",
        "g.py": "import os\nprint(os.getcwd())\n",  # INST of "mport os": no import finds it
        "h.py": "class Config:\n    lr = 0.1\n",
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content)
        assert not is_pickle_start(content.encode(), whole=True), name
    results = run_many([["inspect", tmp_path / n] for n in files])
    for result in results:
        check_error(completed([], result), 2, "not a checkpoint ckpttool knows")


def test_concatenated_pickles_are_judged_as_torch_load_reads_them(tmp_path):
    """After a pickle that is not the magic number, torch.load stops (it never runs the
    second); after the magic number it runs the next one. ckpttool follows it."""
    marker = tmp_path / "marker"
    first_only = tmp_path / "first-only.pkl"
    first_only.write_bytes(pickle.dumps({"a": 1}, protocol=2) + p0_global_reduce(str(marker)))
    run_child("run-payloads", items=[str(first_only)], cwd=tmp_path)
    assert not marker.exists()
    (result,) = run_many([["inspect", first_only]])
    check_error(completed([], result), 2, "a pickle that is not a torch checkpoint")


def test_a_benign_tar_container_is_judged_then_unsupported(tmp_path):
    path = tmp_path / "old.pt"
    dumps = lambda v: pickle.dumps(v, protocol=2)  # noqa: E731
    path.write_bytes(tar_container(dumps(0) + dumps([]), dumps(0), dumps({"a": 1})))
    assert torch.load(path, weights_only=False) == {"a": 1}  # torch still reads it
    (result,) = run_many([["inspect", path]])
    check_error(completed([], result), 2, "tar archive", "reference no dangerous global")


def test_a_tar_whose_main_pickle_is_hostile_is_refused(tmp_path):
    dumps = lambda v: pickle.dumps(v, protocol=2)  # noqa: E731
    path = tmp_path / "old.pt"
    marker = tmp_path / "marker"
    path.write_bytes(tar_container(dumps(0) + dumps([]), dumps(0), p4_stack_global(str(marker))))
    run_child("run-payloads", items=[str(path)], cwd=tmp_path)
    assert marker.exists()
    marker.unlink()
    (result,) = run_many([["inspect", path]])
    check_error(completed([], result), 3, "posix.system")
    assert not marker.exists()


# ------------------------------------------------------ torch.save, every protocol


def saved_state() -> dict:
    torch.manual_seed(0)
    return {
        "w": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(2, 2).to(torch.float16),
        "tied": None,
        "nested": {"t": torch.randn(6)[1:4], "step": 3},
    }


PROTOCOLS = (0, 1, 2, 4, 5)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("saved")
    state = saved_state()
    state["tied"] = state["w"]
    files = {}
    for zipped in (True, False):
        for protocol in PROTOCOLS:
            path = base / f"p{protocol}-{'zip' if zipped else 'legacy'}.pt"
            torch.save(state, path, pickle_protocol=protocol,
                       _use_new_zipfile_serialization=zipped)  # fmt: skip
            files[(protocol, zipped)] = path
    return {"state": state, "files": files, "base": base}


def test_torch_load_itself_refuses_protocol_0_persistent_ids(saved):
    """Why protocol 0 files are compared with what was saved: torch.load fails on them."""
    with pytest.raises(AssertionError, match="saved_id must be a tuple"):
        torch.load(saved["files"][(0, True)], weights_only=False)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_protocol_loads_bitwise(saved, protocol, zipped):
    path = saved["files"][(protocol, zipped)]
    want = saved["state"] if protocol == 0 else torch.load(path, weights_only=False)
    got = ckpttool.load(path, select="all")
    assert list(got) == list(want)
    for key in ("w", "b", "h", "tied"):
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert torch.equal(got["nested"]["t"], want["nested"]["t"])
    assert got["nested"]["step"] == 3


def test_every_protocol_reads_in_every_command(saved, tmp_path):
    reference = saved["files"][(2, True)]
    argvs, outputs = [], {}
    for (protocol, zipped), path in saved["files"].items():
        tag = f"p{protocol}-{'zip' if zipped else 'legacy'}"
        st, pt, merged = (tmp_path / f"{tag}.{ext}" for ext in ("safetensors", "pt", "m.pt"))
        outputs[tag] = (st, pt, merged)
        argvs += [
            ["inspect", "--json", path],
            ["convert", path, "--to", "safetensors", "-o", st, "--select", "all"],
            ["convert", path, "--to", "pt", "-o", pt, "--select", "all"],
            ["merge", path, "-o", merged],
            ["diff", path, reference],
        ]
    results = run_many(argvs)
    for argv, result in zip(argvs, results, strict=True):
        assert result["code"] == 0, (argv, result["stderr"])
    from safetensors.torch import load_file

    state = saved["state"]
    for tag, (st, pt, merged) in outputs.items():
        flat = load_file(st)
        assert torch.equal(flat["w"], state["w"]) and torch.equal(
            flat["nested.t"], state["nested"]["t"]
        )
        loaded = torch.load(pt, weights_only=True)
        assert torch.equal(loaded["h"], state["h"]), tag
        whole = torch.load(merged, weights_only=True)
        assert torch.equal(whole["tied"], state["w"]) and whole["nested"]["step"] == 3, tag
    reports = [json.loads(r["stdout"]) for a, r in zip(argvs, results, strict=True)
               if a[0] == "inspect"]  # fmt: skip
    for report in reports:
        assert report["dangerous"] == [] and report["unverified"] == []
        assert [t["key"] for t in report["tensors"]][:3] == [["w"], ["b"], ["h"]]
