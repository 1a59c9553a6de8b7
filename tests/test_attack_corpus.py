"""The hostile corpus of ``attack_corpus.py`` against every command.

Each file gets the contract's answer from ``inspect``, ``merge`` and ``convert``: exit 3
naming the globals (refused), exit 2 in one line (corrupt), or exit 0 with outputs that
``torch.load(weights_only=True)`` reads and ``weights_only=False`` runs nothing from.
Nothing is written after an error, the input is never changed, no marker appears, and
the files built to cost time or memory are read under a memory bound.

The commands run in one child process (``children.py cli-batch``) so the corpus costs one torch
import, not a hundred.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from attack_corpus import CASES, CASES_BY_NAME, Case, write_case
from helpers import run_child, run_many, sha256


def commands(path: Path, folder: Path) -> dict[str, list[str]]:
    return {
        "inspect": ["inspect", "--json", str(path)],
        "merge": ["merge", str(path), "-o", str(folder / "merged.pt")],
        "convert-pt": ["convert", str(path), "--to", "pt", "-o", str(folder / "conv.pt")],
        "convert-st": [
            "convert",
            str(path),
            "--to",
            "safetensors",
            "-o",
            str(folder / "conv.safetensors"),
        ],
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, dict]:
    """Every case written and run through every command once: {case: {...}}."""
    base = tmp_path_factory.mktemp("corpus")
    runs: dict[str, dict] = {}
    argvs = []
    for case in CASES:
        folder = base / case.name
        folder.mkdir()
        path = write_case(case, folder)
        cmds = commands(path, folder)
        runs[case.name] = {"path": path, "folder": folder, "hash": sha256(path), "cmds": cmds}
        argvs.extend(cmds.values())
    results = iter(run_many(argvs))
    for run in runs.values():
        run["results"] = {name: next(results) for name in run["cmds"]}
    return runs


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_command_answers_as_the_contract_says(corpus, case: Case):
    run = corpus[case.name]
    for command, result in run["results"].items():
        assert result["code"] == case.exit, (command, result)
        assert "Traceback" not in result["stderr"] + result["stdout"]
        if case.exit:
            lines = result["stderr"].splitlines()
            assert len(lines) == 1, (command, result["stderr"])
            word = "refused" if case.exit == 3 else "error"
            assert lines[0].startswith(f"ckpttool: {word}: "), lines[0]
            for needle in case.names:
                assert needle in lines[0], (command, needle, lines[0])
            assert "error: unexpected " not in lines[0]
    folder = run["folder"]
    assert not (folder / "marker").exists()
    assert sha256(run["path"]) == run["hash"]  # the input is never changed
    if case.exit:  # nothing written after an error, not even a temporary file
        assert sorted(p.name for p in folder.iterdir()) == [run["path"].name]


def test_refused_files_name_their_globals_in_json_fields(corpus):
    """inspect --unsafe reads them inert and lists the offenders in ``dangerous``."""
    refused = [c for c in CASES if c.exit == 3]
    argvs = [["inspect", "--json", "--unsafe", str(corpus[c.name]["path"])] for c in refused]
    for case, result in zip(refused, run_many(argvs), strict=True):
        assert result["code"] == 0, (case.name, result["stderr"])
        report = json.loads(result["stdout"])
        for name in case.names:
            assert name in report["dangerous"], (case.name, report["dangerous"])
            assert name not in report["unverified"]
        assert not (corpus[case.name]["folder"] / "marker").exists()


def test_a_benign_unknown_class_is_unverified_not_dangerous(corpus):
    result = corpus["unknown-class-referenced"]["results"]["inspect"]
    report = json.loads(result["stdout"])
    assert report["dangerous"] == []
    assert report["unverified"] == ["mylib.config.TrainConfig"]
    assert "mylib.config.TrainConfig" in report["globals"]
    assert "collections.OrderedDict" not in report["unverified"]  # allowed names are not


def test_an_unknown_class_constructed_is_refused_naming_the_allow_that_reads_it(corpus):
    result = corpus["unknown-class-newobj-build"]["results"]["inspect"]
    assert result["code"] == 3
    report = json.loads(result["stdout"])
    assert report["dangerous"] == ["mylib.config.TrainConfig"]
    assert report["reasons"]["mylib.config.TrainConfig"].startswith("constructed (NEWOBJ")
    assert result["stderr"].splitlines() == [
        f"ckpttool: refused: {corpus['unknown-class-newobj-build']['path']}: the pickle "
        "constructs or calls globals ckpttool cannot vouch for: mylib.config.TrainConfig "
        "(constructed); nothing was executed (if you trust them, pass --allow "
        "mylib.config.TrainConfig; only if you trust this file, --unsafe)"
    ]


def test_outputs_of_valid_hostile_inputs_load_safely(corpus):
    outputs = []
    for case in CASES:
        if case.exit == 0:
            folder = corpus[case.name]["folder"]
            outputs += [str(folder / "merged.pt"), str(folder / "conv.pt")]
    assert outputs
    proc = run_child("load-both-ways", items=outputs)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
    for case in CASES:
        assert not (corpus[case.name]["folder"] / "marker").exists()


def test_live_payloads_act_under_a_plain_torch_load(tmp_path):
    live = [c for c in CASES if c.live]
    assert len(live) >= 5
    paths = []
    for case in live:
        folder = tmp_path / case.name
        folder.mkdir()
        paths.append(str(write_case(case, folder)))
    run_child("run-payloads", items=paths, cwd=tmp_path)
    for case in live:
        assert (tmp_path / case.name / "marker").exists(), case.name


COSTLY = [
    "memo-index-of-a-billion",
    "bytearray-constructor-repeated",
    "list-copies-of-a-shared-list",
    "one-string-repeated",  # (valid: read within the bound)
    "billion-laughs",
    "stride-zero-view-of-2-62",
]
MEMORY_BOUND_MIB = 256


def peak_rss_mib(argv: list[str], tmp_path: Path) -> tuple[int, float]:
    rss_file = tmp_path / "rss"
    env = {"COLUMNS": "200", "CKPTTOOL_RSS_FILE": str(rss_file)}
    # timeout: a hang guard, not a timing assertion
    proc = run_child("measured", *argv, env=env, timeout=120)
    return proc.returncode, int(rss_file.read_text()) / 1024


@pytest.mark.parametrize("name", COSTLY)
def test_costly_files_are_refused_within_the_memory_bound(tmp_path, name):
    case = CASES_BY_NAME[name]
    path = write_case(case, tmp_path)
    # the same command on a plain checkpoint: what starting up and importing costs
    (tmp_path / "plain").mkdir()
    plain = write_case(CASES_BY_NAME["unknown-class-referenced"], tmp_path / "plain")
    for command in (["inspect", "--json"], ["merge", "-o", str(tmp_path / "out.pt")]):
        base_code, base_rss = peak_rss_mib([*command[:1], str(plain), *command[1:]], tmp_path)
        (tmp_path / "out.pt").unlink(missing_ok=True)
        code, rss = peak_rss_mib([*command[:1], str(path), *command[1:]], tmp_path)
        assert base_code == 0 and code == case.exit, (command, code)
        assert rss - base_rss < MEMORY_BOUND_MIB, (command, rss, base_rss)


def _edit_pickles(folder: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) in every rank file's data.pkl."""
    from helpers import rewrite_zip

    for path in sorted(folder.glob("*.pt")):
        edited = path.with_suffix(".tmp")

        def edit(name: str, data: bytes) -> bytes | None:
            return data.replace(old, new) if name.endswith("data.pkl") else None

        rewrite_zip(path, edited, edit)
        edited.replace(path)


@pytest.mark.parametrize(
    ("fixture", "old", "new", "needle"),
    [
        ("dtensor", b"_spec", b"_spxc", "device mesh"),  # load raised TypeError: prod(None)
        ("composer", b"shard_sizes", b"shard_sizez", "corrupt"),
        ("fsdp_uneven", b"shard_offsets", b"shard_offsetz", "corrupt"),
    ],
)
def test_damaged_sharded_metadata_is_one_ckpt_error(tmp_path, fixture, old, new, needle):
    from helpers import FIXTURES

    import ckpttool

    folder = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, folder)
    _edit_pickles(folder, old, new)
    with pytest.raises(ckpttool.CkptError, match=needle) as info:
        ckpttool.load(str(sorted(folder.glob("*.pt"))[0]), select="all")
    assert "\n" not in str(info.value)
    result = run_many([["merge", str(folder), "-o", str(tmp_path / "out.pt")]])[0]
    assert result["code"] == 2 and len(result["stderr"].splitlines()) == 1, result
    assert not (tmp_path / "out.pt").exists()


def test_many_small_storages_each_expanded_are_refused_together(tmp_path):
    """Each of 200 one-element storages saved as a 64 MiB stride-0 view (a 56 KB file):
    no view passes the per-view bound by much, but together they would be 12.5 GiB of
    output. The budget is the file's, not each storage's."""
    import torch
    from helpers import check_error, run_cli

    import ckpttool

    sd = {f"w{i}": torch.full((1,), float(i)).expand(16 << 20) for i in range(200)}
    torch.save(sd, tmp_path / "expanded.pt")
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli("convert", tmp_path / "expanded.pt", "--to", "safetensors", "-o", out / "x")
    check_error(proc, 2, "name the same stored bytes over and over")
    assert list(out.iterdir()) == []
    small = {f"w{i}": torch.full((1,), float(i)).expand(1 << 20) for i in range(3)}
    torch.save(small, tmp_path / "small.pt")  # a few broadcast views are read as saved
    loaded = ckpttool.load(tmp_path / "small.pt")
    assert all(torch.equal(loaded[k], v) for k, v in small.items())


def test_one_storage_named_by_many_tensors(tmp_path):
    """A pickle names a storage again in a few bytes: 100 tensors of one 1 MiB storage
    (what torch.save writes for them: a 1 MB file) were each read and written in full,
    100 MiB by every command that reads bytes (5,000 of them: a 4.9 GiB output, 90 s of
    --stats). Refused as the file is read, by every command (its tensors would total
    far more than the file stores); tied weights (a few tensors of one storage) are
    read as before."""
    import torch
    from helpers import check_error, completed, tree_files

    shared = torch.arange(1 << 18, dtype=torch.float32)
    torch.save({f"w{i}": shared for i in range(100)}, tmp_path / "many.pt")
    torch.save({"embed": shared, "head": shared}, tmp_path / "tied.pt")
    before = sha256(tmp_path / "many.pt")
    commands = [
        ["inspect"],
        ["inspect", "--stats"],
        ["convert", "--to", "safetensors", "-o", tmp_path / "o.safetensors"],
        ["convert", "--to", "pt", "-o", tmp_path / "o.pt"],
        ["convert", "--to", "dcp", "-o", tmp_path / "o"],
        ["merge", "-o", tmp_path / "m.pt"],
    ]
    message = "name the same stored bytes over and over"
    argvs = [[c[0], tmp_path / "many.pt", *c[1:]] for c in commands]
    argvs.append(["diff", tmp_path / "many.pt", tmp_path / "many.pt"])
    for argv, run in zip(argvs, run_many(argvs), strict=True):  # (one interpreter for all)
        check_error(completed(argv, run), 2, message)
    assert tree_files(tmp_path) == ["many.pt", "tied.pt"]
    assert sha256(tmp_path / "many.pt") == before
    argvs = [[c[0], tmp_path / "tied.pt", *c[1:]] for c in commands]
    for argv, run in zip(argvs, run_many(argvs), strict=True):
        assert run["code"] == 0, (argv, run["stderr"])
