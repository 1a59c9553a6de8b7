"""What is judged is what torch would load (formats/zip_pickle.py): every ``data.pkl`` a
reader could take from a damaged or ambiguous torch zip.

Each case starts from a real ``torch.save`` output, rebuilt entry by entry
(``hostile_zips.zip_bytes``) with one lie. A payload case is proven live first: in a
fresh interpreter, ``torch.load(weights_only=False)`` (or ``zipfile``, where it is that
reader that takes the payload) creates a marker file; then ckpttool must refuse it, exit
3 naming the global. The same damage around a benign pickle is exit 2 with one line,
except where torch itself reads the file fine (a deflated checkpoint, ``DATA.PKL``).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from helpers import check_error, run_cli
from hostile_zips import Entry, deflate, tensor_pickle, torch_entries, zip_bytes
from safetensors.torch import load_file

import ckpttool
from ckpttool.errors import CkptError, UnsafeError

MARKER = "marker"
# builtins.exec("open('marker','w').close()"), called by REDUCE (protocol 2)
CODE = f"open({MARKER!r},'w').close()".encode()
PAYLOAD = b"\x80\x02cbuiltins\nexec\nX" + len(CODE).to_bytes(4, "little") + CODE + b"\x85R."
STATE = {"w": torch.arange(4.0), "h": torch.ones(2, 3, dtype=torch.float16)}
PKL = "archive/data.pkl"


def _entries() -> list[Entry]:
    """The entries of a real torch.save output, as stored (data.pkl first)."""
    buffer = io.BytesIO()
    torch.save(STATE, buffer)
    import zipfile

    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
        return [Entry(i.filename, z.read(i)) for i in z.infolist()]


def _with_pickles(*pickles: tuple[str, bytes], lean: bool = False) -> list[Entry]:
    """The real entries with ``data.pkl`` replaced by ``pickles`` (name, bytes), first.

    ``lean``: without ``.format_version`` (torch before 2.1 wrote none). Which of two
    equal names torch's reader takes depends on the entry count: it sorts the directory
    (a heap sort, not stable) and binary-searches it. With 9 entries it lands on the
    second of two, with 8 on the first; the cases use both."""
    rest = [e for e in _entries() if e.name != PKL]
    if lean:
        rest = [e for e in rest if e.name != "archive/.format_version"]
    return [Entry(name, data) for name, data in pickles] + rest


def _benign() -> bytes:
    return next(e.data for e in _entries() if e.name == PKL)


def _local_header_lies(pickle: bytes) -> list[Entry]:
    """data.pkl's local header names another entry (of the same length) and carries an
    extra field holding a benign pickle: torch reads ``pickle`` after it, a reader that
    trusts the directory's name and no extra reads the benign one."""
    entries = _with_pickles((PKL, pickle))
    entries[0].local_name = PKL[:-1] + "X"
    entries[0].local_extra = _benign()
    return entries


def _crc_wrong(pickle: bytes) -> list[Entry]:
    entries = _with_pickles((PKL, pickle))
    entries[0].crc = zlib.crc32(pickle) ^ 0xFFFF
    return entries


def _deflated(pickle: bytes) -> list[Entry]:
    """Every member deflated, as a re-zip with compression writes it."""
    entries = _with_pickles((PKL, pickle))
    for e in entries:
        e.crc, e.size, e.data, e.method = zlib.crc32(e.data), len(e.data), deflate(e.data), 8
    return entries


def _build(kind: str, pickle: bytes) -> list[Entry]:
    benign = _benign()
    return {
        "case_twin_first": lambda: _with_pickles(
            ("archive/Data.pkl", pickle), (PKL, benign), lean=True
        ),
        "case_twin_second": lambda: _with_pickles((PKL, benign), ("archive/Data.pkl", pickle)),
        "upper_case_alone": lambda: _with_pickles(("archive/DATA.PKL", pickle)),
        "two_payload_first": lambda: _with_pickles((PKL, pickle), (PKL, benign), lean=True),
        "two_payload_second": lambda: _with_pickles((PKL, benign), (PKL, pickle)),
        "three_payload_last": lambda: _with_pickles((PKL, benign), (PKL, benign), (PKL, pickle)),
        "nul_twin": lambda: _with_pickles((PKL + "\0", benign), (PKL, pickle)),
        "crc_wrong": lambda: _crc_wrong(pickle),
        "local_header_lies": lambda: _local_header_lies(pickle),
        "deflated": lambda: _deflated(pickle),
    }[kind]()


# (case, the reader proven to run its payload, what ckpttool says of the benign twin:
# the phrase of its exit-2 line, or None where it reads like torch reads it)
CASES = [
    ("case_twin_first", "torch", "appears twice"),
    ("case_twin_second", "torch", "appears twice"),
    # torch's reader finds names case-insensitively: DATA.PKL alone is its data.pkl
    # (read as torch reads it, not refused as damage: torch.load returns the tensors)
    ("upper_case_alone", "torch", None),
    ("two_payload_first", "torch", "appears twice"),
    ("two_payload_second", "torch", "appears twice"),
    ("three_payload_last", "torch", "appears twice"),
    ("nul_twin", "torch", "appears twice"),
    ("crc_wrong", "torch", "CRC-32 mismatch"),
    ("local_header_lies", "torch", "local header"),
    # a re-zipped checkpoint: torch inflates its members, so does ckpttool
    ("deflated", "torch", None),
]

# Runs each file's reader in a fresh interpreter, each in a folder of its own: did the
# marker appear? (one torch import for every case)
LIVE = """
import json, os, pickle, sys, zipfile
import torch
out = {}
for name, path, reader, folder in json.loads(sys.argv[1]):
    os.chdir(folder)
    try:
        if reader == "torch":
            torch.load(path, weights_only=False)
        else:
            with zipfile.ZipFile(path) as z:
                pickle.loads(z.read("archive/data.pkl"))
    except Exception:
        pass
    out[name] = os.path.exists("marker")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """case -> (payload file, benign file), the payloads proven live."""
    root = tmp_path_factory.mktemp("what_torch_loads")
    made, jobs = {}, []
    for name, reader, _ in CASES:
        evil, benign = root / f"{name}.pt", root / f"{name}_benign.pt"
        evil.write_bytes(zip_bytes(_build(name, PAYLOAD)))
        benign.write_bytes(zip_bytes(_build(name, _benign())))
        folder = root / f"{name}_run"
        folder.mkdir()
        jobs.append([name, str(evil), reader, str(folder)])
        made[name] = (evil, benign)
    proc = subprocess.run(
        [sys.executable, "-c", LIVE, json.dumps(jobs)],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    live = json.loads(proc.stdout.splitlines()[-1])
    assert live == {name: True for name, _, _ in CASES}, live  # every payload really runs
    return made


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_payload_any_reader_could_take_is_refused(files: dict, name: str, tmp_path: Path):
    evil, _ = files[name]
    line = check_error(run_cli("inspect", evil, cwd=tmp_path), 3, "builtins.exec")
    assert "nothing was executed" in line
    with pytest.raises(UnsafeError, match="builtins.exec"):
        ckpttool.load(str(evil))
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("name,phrase", [(c[0], c[2]) for c in CASES if c[2] is not None])
def test_same_damage_around_a_benign_pickle_is_one_line_exit_2(files: dict, name: str, phrase: str):
    _, benign = files[name]
    check_error(run_cli("inspect", benign), 2, phrase)
    with pytest.raises(CkptError, match=phrase) as raised:
        ckpttool.load(str(benign))
    assert not isinstance(raised.value, UnsafeError)


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[2] is None])
def test_what_torch_reads_fine_reads_bitwise_equal(files: dict, name: str, tmp_path: Path):
    """A deflated checkpoint and a lone DATA.PKL: read, and converted, as torch.load
    gives them."""
    _, benign = files[name]
    want = torch.load(benign, weights_only=True)
    assert set(want) == set(STATE)
    got = ckpttool.load(str(benign))
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert run_cli("inspect", benign).returncode == 0
    out = tmp_path / "out.safetensors"
    proc = run_cli("convert", benign, "--to", "safetensors", "-o", out)
    assert proc.returncode == 0, proc.stderr
    written = load_file(out)
    assert set(written) == set(want)
    for key, tensor in want.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key


def test_deflated_checkpoint_verify_checks_every_crc(files: dict):
    _, benign = files["deflated"]
    result = ckpttool.verify(str(benign))
    assert result["ok"], result
    assert result["files"][0]["crc_checked"] == len(_entries())


def test_deflated_storage_that_declares_more_than_deflate_holds_is_refused(tmp_path: Path):
    """A storage's declared size is checked against what its stored bytes can inflate to
    before a byte is inflated: 18 bytes never cost a gigabyte."""
    numel = 1 << 28  # float32: 1 GiB
    entries = torch_entries(tensor_pickle({"w": (("0", "cpu", numel), numel)}))
    storage = next(e for e in entries if e.name == "archive/data/0")
    storage.crc, storage.size = zlib.crc32(storage.data), numel * 4
    storage.data, storage.method = deflate(storage.data), 8
    path = tmp_path / "bomb.pt"
    path.write_bytes(zip_bytes(entries))
    check_error(run_cli("inspect", path), 2, "archive/data/0", "more than deflate can hold")


def test_a_candidate_past_what_is_judged_cannot_be_vouched_for(tmp_path):
    """Two data.pkl, one a deflated pickle that inflates past the 64 MiB judged of it
    (a long string, then anything): its verdict cannot be reached, so the file is
    exit 3 "cannot be vouched for", never the damage's exit 2."""
    filler = b"a" * (70 << 20)
    long = b"\x80\x02X" + len(filler).to_bytes(4, "little") + filler + b"0" + PAYLOAD[2:]
    raw = deflate(long)
    entries = _with_pickles((PKL, _benign()), (PKL, raw))
    entries[1].method, entries[1].crc, entries[1].size = 8, zlib.crc32(long), len(long)
    path = tmp_path / "long.pt"
    path.write_bytes(zip_bytes(entries))
    proc = run_cli("inspect", path)
    assert proc.returncode == 3, proc.stderr
    assert "past what ckpttool judges: cannot be vouched for" in proc.stderr
    with pytest.raises(UnsafeError):
        ckpttool.load(path)
