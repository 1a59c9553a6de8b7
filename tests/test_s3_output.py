"""``-o s3://...`` against moto's S3 server on 127.0.0.1, behind a proxy that counts the
requests and injects faults: the same bytes as a local output for every --to and merge,
nothing visible before the end (the index last), a killed run resumed with only the
missing parts uploaded, runs of parts from several writers, retried 5xx, refused ETags,
--force rules, other stores refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import torch
from helpers import check_error, completed, run_many, subprocess_env
from servers import S3Proxy, S3Server

from ckpttool import sources
from ckpttool.convert import convert
from ckpttool.errors import CkptError, OutputExistsError, UsageError
from ckpttool.merge import merge
from ckpttool.sources.remote import base

pytest.importorskip("s3fs")
moto_models = pytest.importorskip("moto.s3.models")

PART = 64 << 10  # the tests' part size (moto is told to accept it)
BUCKET = "out"


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    proxy = S3Proxy(server.endpoint)
    direct = server.client()  # straight to moto: what the store holds, uncounted
    server.endpoint = proxy.endpoint  # every client of the code under test: through it
    server.env["FSSPEC_S3_ENDPOINT_URL"] = proxy.endpoint
    undo = server.configure()
    sources.forget("s3")
    saved = moto_models.S3_UPLOAD_PART_MIN_SIZE
    moto_models.S3_UPLOAD_PART_MIN_SIZE = PART
    direct.create_bucket(Bucket=BUCKET)
    server.proxy, server.direct = proxy, direct
    yield server
    moto_models.S3_UPLOAD_PART_MIN_SIZE = saved
    sources.forget("s3")
    undo()
    proxy.close()
    server.close()


@pytest.fixture(autouse=True)
def small_parts(s3, monkeypatch):
    monkeypatch.setenv("CKPTTOOL_S3_PART_SIZE", str(PART))
    s3.proxy.reset()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A torch.save file: tensors smaller and larger than a part, one spanning several."""
    folder = tmp_path_factory.mktemp("s3out")
    gen = torch.Generator().manual_seed(0)
    sd = {f"layer{i}.weight": torch.randn(50 + 13 * i, 61, generator=gen) for i in range(6)}
    sd["embed.weight"] = torch.randn(700, 64, generator=gen)  # 175 KiB: three parts
    sd["step"] = torch.tensor(7)
    torch.save(sd, folder / "model.pt")
    return folder / "model.pt"


def objects(s3, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` (read straight from moto), by key."""
    found = s3.direct.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents") or []
    return {
        o["Key"]: s3.direct.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in found
    }


def open_uploads(s3) -> list[str]:
    return [u["Key"] for u in s3.direct.list_multipart_uploads(Bucket=BUCKET).get("Uploads") or []]


def local_files(path: Path) -> dict[str, bytes]:
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return {"": path.read_bytes()}


def remote_files(s3, key: str, folder: bool) -> dict[str, bytes]:
    if not folder:
        return {"": objects(s3, key)[key]}
    return {k[len(key) + 1 :]: v for k, v in objects(s3, key + "/").items()}


CASES = {
    "safetensors": ("safetensors", {}),
    "safetensors-fp16": ("safetensors", {"dtype": "float16"}),
    "shards": ("safetensors", {"max_shard_size": "100KB"}),
    "pt": ("pt", {}),
    "dcp": ("dcp", {}),
}


@pytest.mark.parametrize("case", CASES)
def test_every_to_byte_identical(s3, ckpt, tmp_path, case):
    to, options = CASES[case]
    folder = to == "dcp" or "max_shard_size" in options
    suffix = "" if folder else f".{'pt' if to == 'pt' else 'safetensors'}"
    local = tmp_path / f"local{suffix}"
    convert([str(ckpt)], to, str(local), **options)
    key = f"every/{case}{suffix}"
    result = convert([str(ckpt)], to, f"s3://{BUCKET}/{key}", **options)
    assert result.output == f"s3://{BUCKET}/{key}"
    want = local_files(local)
    assert remote_files(s3, key, folder) == want
    assert len(s3.proxy.uploads()) > len(want)  # several parts per file
    assert open_uploads(s3) == []
    assert not any(".ckpttool-upload" in k for k in objects(s3, "every/"))  # journal gone


def test_merge_and_default_part_size(s3, ckpt, tmp_path, monkeypatch):
    """merge of a DCP folder; parts of the default size (8 MiB) under S3's real minimum."""
    dcp = tmp_path / "dcp"
    big = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: two parts
    torch.save(big, tmp_path / "big.pt")
    convert([str(tmp_path / "big.pt")], "dcp", str(dcp))
    merge([str(dcp)], str(tmp_path / "merged.pt"))
    monkeypatch.delenv("CKPTTOOL_S3_PART_SIZE")
    monkeypatch.setattr(moto_models, "S3_UPLOAD_PART_MIN_SIZE", 5 << 20)
    result = merge([str(dcp)], f"s3://{BUCKET}/merged/")  # into the prefix: default name
    assert result.output == f"s3://{BUCKET}/merged/dcp.pt"
    assert objects(s3, "merged/") == {"merged/dcp.pt": (tmp_path / "merged.pt").read_bytes()}
    assert sorted(s3.proxy.uploads()) == [1, 2]  # 8 MiB, then 4 MiB (the journal: one PUT)


def test_nothing_visible_until_complete_index_last(s3, ckpt, tmp_path):
    seen: list[tuple[str, list[str]]] = []

    def at_complete(method: str, query: str):
        args = urllib.parse.parse_qs(query)
        if method == "POST" and "uploadId" in args:  # CompleteMultipartUpload
            keys = sorted(objects(s3, "vis/"))
            seen.append((query, [k for k in keys if ".ckpttool-upload" not in k]))
        return None

    s3.proxy.fault = at_complete
    convert([str(ckpt)], "safetensors", f"s3://{BUCKET}/vis", max_shard_size="100KB")
    assert len(seen) == 5  # four shards, then the index
    assert seen[0][1] == []  # nothing visible before the first completion
    assert seen[-1][1] == [f"vis/model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(objects(s3, "vis/"))[-1] == "vis/model.safetensors.index.json"


@pytest.mark.parametrize("to", ["safetensors", "pt"])
def test_killed_mid_upload_then_resumed(s3, ckpt, tmp_path, to):
    """SIGKILL the CLI at its 4th part; the rerun uploads exactly the parts not there."""
    suffix = ".pt" if to == "pt" else ".safetensors"
    prefix = f"killed-{to}/"
    key = f"{prefix}model{suffix}"
    proc: list[subprocess.Popen] = []

    def kill_at_fourth(method: str, query: str):
        if "partNumber=" in query and method == "PUT" and len(s3.proxy.uploads()) >= 4:
            os.kill(proc[0].pid, signal.SIGKILL)
            return 503
        return None

    s3.proxy.fault = kill_at_fourth
    env = subprocess_env(**s3.env, CKPTTOOL_S3_PART_SIZE=str(PART))
    argv = [sys.executable, "-m", "ckpttool", "convert", str(ckpt), "--to", to]
    proc.append(subprocess.Popen([*argv, "-o", f"s3://{BUCKET}/{key}"], env=env))
    assert proc[0].wait(timeout=120) == -signal.SIGKILL
    s3.proxy.settle()  # parts the killed process sent still land
    s3.proxy.reset()
    assert key not in objects(s3, prefix)  # nothing under the final key
    (upload,) = s3.direct.list_multipart_uploads(Bucket=BUCKET)["Uploads"]
    there = s3.direct.list_parts(Bucket=BUCKET, Key=key, UploadId=upload["UploadId"])
    have = {p["PartNumber"] for p in there.get("Parts") or []}
    assert 0 < len(have) < 7
    # the same command, in this process: it says what it reused
    result = convert([str(ckpt)], to, f"s3://{BUCKET}/{key}")
    local = tmp_path / f"local{suffix}"
    convert([str(ckpt)], to, str(local))
    size = local.stat().st_size
    assert sorted(s3.proxy.uploads()) == sorted(set(range(1, -(-size // PART) + 1)) - have)
    parts = -(-size // PART)
    reused = sum(min(PART, size - (n - 1) * PART) for n in have)
    assert (result.outcome.units, result.outcome.reused) == (parts, len(have))
    assert (result.outcome.reused_bytes, result.outcome.kind) == (reused, "part")
    assert objects(s3, prefix) == {key: local.read_bytes()}
    assert open_uploads(s3) == []


def test_runs_of_parts_from_several_writers(s3, ckpt, tmp_path):
    """What ranks do: one prepares, each uploads its runs of parts (CRC fields of other
    runs' tensors deferred), the deferred parts again with every run's CRCs, one finishes."""
    from ckpttool.api.reading import flatten_tensors, read, select_node
    from ckpttool.targets.s3 import Session, finish, prepare, upload_run
    from ckpttool.writers import torch_zip
    from ckpttool.writers.plan import WriteOptions

    loaded = read(str(ckpt))
    _, node = select_node(loaded, "auto", "auto")
    plan = torch_zip.plan(flatten_tensors(node), WriteOptions(location="cpu"))
    url = f"s3://{BUCKET}/ranks/model.pt"
    session = prepare(plan, url, layout=None, force=False, identities=["x"])
    (file,) = plan.files
    count = session.files[0].parts
    runs = [(1, 2), (3, 4), (5, count)]  # one per "rank", each with its own session copy
    crcs: dict[int, int] = {}
    deferred: list[int] = []
    for first, last in reversed(runs):
        mine = Session.from_json(session.to_json())
        result = upload_run(mine, file, first=first, last=last)
        crcs.update(result.crcs)
        deferred += result.deferred
    assert deferred  # the central directory's part, at least
    for number in deferred:
        upload_run(session, file, first=number, last=number, crcs=crcs)
    assert key_absent(s3, "ranks/model.pt")
    finish(session, None)
    local = tmp_path / "local.pt"
    convert([str(ckpt)], "pt", str(local))
    assert objects(s3, "ranks/") == {"ranks/model.pt": local.read_bytes()}
    # each part went once, the deferred ones twice at most
    assert sorted(set(s3.proxy.uploads())) == list(range(1, count + 1))


def key_absent(s3, key: str) -> bool:
    return key not in objects(s3, key)


def test_flaky_part_retried(s3, ckpt, tmp_path):
    failed: list[str] = []

    def fail_part_two_once(method: str, query: str):
        if method == "PUT" and "partNumber=2&" in query + "&" and not failed:
            failed.append(query)
            return 503
        return None

    s3.proxy.fault = fail_part_two_once
    convert([str(ckpt)], "pt", f"s3://{BUCKET}/flaky/model.pt")
    local = tmp_path / "local.pt"
    convert([str(ckpt)], "pt", str(local))
    assert failed and s3.proxy.uploads().count(2) == 2
    assert objects(s3, "flaky/") == {"flaky/model.pt": local.read_bytes()}


def test_wrong_etag_refused_and_aborted(s3, ckpt):
    s3.proxy.fault = lambda method, query: "etag" if "partNumber=3&" in query + "&" else None
    with pytest.raises(CkptError) as info:
        convert([str(ckpt)], "safetensors", f"s3://{BUCKET}/etag/model.safetensors")
    text = str(info.value)
    assert "part 3 with ETag" in text and "aborted" in text and "(upload " in text
    assert "\n" not in text and info.value.exit_code == 2
    assert objects(s3, "etag/") == {}  # no object, no journal
    assert open_uploads(s3) == []


def test_failing_store_leaves_the_upload_for_a_rerun(s3, ckpt, monkeypatch):
    import fsspec.config
    from s3fs import S3FileSystem

    monkeypatch.setattr(base, "RETRIES", 2)
    monkeypatch.setattr(base, "BACKOFF", 0.01)
    conf = {**fsspec.config.conf["s3"], "config_kwargs": {"retries": {"max_attempts": 1}}}
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)  # botocore: no retries of its own
    S3FileSystem.clear_instance_cache()
    sources.forget("s3")
    s3.proxy.fault = lambda method, query: 503 if "partNumber=2&" in query + "&" else None
    url = f"s3://{BUCKET}/down/model.safetensors"
    try:
        with pytest.raises(CkptError, match="left for a rerun of the same command") as info:
            convert([str(ckpt)], "safetensors", url)
        assert "nothing is visible under the output" in str(info.value)
        assert open_uploads(s3) == ["down/model.safetensors"]
        s3.proxy.fault = None
        convert([str(ckpt)], "safetensors", url)
        assert open_uploads(s3) == [] and "down/model.safetensors" in objects(s3, "down/")
    finally:
        S3FileSystem.clear_instance_cache()
        sources.forget("s3")


def test_rerun_with_another_plan_aborts_the_first(s3, ckpt, tmp_path):
    from ckpttool.api.reading import flatten_tensors, read, select_node
    from ckpttool.targets.s3 import prepare
    from ckpttool.writers import safetensors
    from ckpttool.writers.plan import WriteOptions

    _, node = select_node(read(str(ckpt)), "auto", "auto")
    plan = safetensors.plan(flatten_tensors(node), WriteOptions(metadata={"source": "x"}))
    url = f"s3://{BUCKET}/replan/model.safetensors"
    first = prepare(plan, url, layout=None, force=False, identities=["earlier"])
    assert open_uploads(s3) == ["replan/model.safetensors"]
    convert([str(ckpt)], "safetensors", url, dtype="float16")
    assert open_uploads(s3) == []
    ids = {
        u["UploadId"] for u in s3.direct.list_multipart_uploads(Bucket=BUCKET).get("Uploads") or []
    }
    assert first.files[0].upload_id not in ids
    local = tmp_path / "local.safetensors"
    convert([str(ckpt)], "safetensors", str(local), dtype="float16")
    assert objects(s3, "replan/") == {"replan/model.safetensors": local.read_bytes()}


def test_force_rules_single_object(s3, ckpt):
    url = f"s3://{BUCKET}/force/model.pt"
    convert([str(ckpt)], "pt", url)
    with pytest.raises(OutputExistsError, match="output exists"):
        convert([str(ckpt)], "pt", url)
    convert([str(ckpt)], "pt", url, force=True, dtype="float16")  # a checkpoint: replaced
    s3.direct.put_object(Bucket=BUCKET, Key="force/notes.pt", Body=b"not a checkpoint")
    with pytest.raises(CkptError, match="not a checkpoint"):
        convert([str(ckpt)], "pt", f"s3://{BUCKET}/force/notes.pt", force=True)
    assert objects(s3, "force/notes.pt")["force/notes.pt"] == b"not a checkpoint"
    assert open_uploads(s3) == []


def test_force_rules_folder(s3, ckpt):
    url = f"s3://{BUCKET}/forcedir"
    convert([str(ckpt)], "safetensors", url, max_shard_size="100KB")
    s3.direct.put_object(Bucket=BUCKET, Key="forcedir/README.md", Body=b"mine")
    with pytest.raises(OutputExistsError, match="holds Hugging Face shards"):
        convert([str(ckpt)], "safetensors", url, max_shard_size="200KB")
    convert([str(ckpt)], "safetensors", url, max_shard_size="200KB", force=True)
    names = sorted(k.split("/", 1)[1] for k in objects(s3, "forcedir/"))
    assert names == [
        "README.md",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


def test_output_is_an_input(s3, ckpt):
    url = s3.upload(ckpt, BUCKET, "inputs/model.pt")
    with pytest.raises(CkptError, match="output would overwrite the input"):
        convert([url], "pt", url, force=True)


@pytest.mark.parametrize("url", ["gs://b/model.safetensors", "az://c/model.safetensors"])
def test_other_stores_refused(url, ckpt):
    with pytest.raises(UsageError, match="writes s3:// URLs only") as info:
        convert([str(ckpt)], "safetensors", url)
    assert "\n" not in str(info.value)


def test_cli_lines(s3, ckpt):
    """The CLI's one-line errors and its summary, in a fresh interpreter."""
    url = f"s3://{BUCKET}/cli/model.safetensors"
    argvs = [
        ["convert", ckpt, "--to", "safetensors", "-o", url],
        ["convert", ckpt, "--to", "safetensors", "-o", url],
        ["convert", ckpt, "--to", "safetensors", "-o", "gs://b/x.safetensors"],
        ["inspect", url],
    ]
    runs = run_many(argvs)
    assert runs[0]["code"] == 0 and "wrote s3://out/cli/model.safetensors" in runs[0]["stderr"]
    check_error(completed(argvs[1], runs[1]), 2, "output exists", "--force")
    check_error(completed(argvs[2], runs[2]), 2, "gs://b/x.safetensors", "composite uploads")
    assert runs[3]["code"] == 0 and "safetensors" in runs[3]["stdout"]


class Collectives:
    """broadcast / all_gather among threads standing for ranks (torch.distributed's
    ``broadcast_object_list`` / ``all_gather_object`` in a real run)."""

    def __init__(self, world: int) -> None:
        import threading

        self.world = world
        self.barrier = threading.Barrier(world, timeout=120)
        self.slots: list = [None] * world

    def all_gather(self, rank: int, obj):
        self.barrier.wait()
        self.slots[rank] = obj
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def broadcast(self, rank: int, obj):
        return self.all_gather(rank, obj)[0]


def run_ranks(world: int, ckpt: Path, to: str, url: str, **options):
    """``write_ranks`` on ``world`` threads, each planning from its own read, as ranks do."""
    import functools
    from concurrent.futures import ThreadPoolExecutor

    from ckpttool.api.reading import flatten_tensors, read, select_node
    from ckpttool.targets.s3 import write_ranks
    from ckpttool.writers import writer_for
    from ckpttool.writers.plan import WriteOptions

    comm = Collectives(world)
    writer = writer_for(to)
    opts = WriteOptions(location="cpu", metadata={"source": ckpt.name}, **options)

    def rank_main(rank: int) -> None:
        loaded = read(str(ckpt))
        _, node = select_node(loaded, "auto", "auto")
        plan = writer.plan(flatten_tensors(node), opts)
        write_ranks(
            plan,
            url,
            layout=writer.layout(opts),
            force=False,
            inputs=loaded.files,
            rank=rank,
            world=world,
            broadcast=functools.partial(comm.broadcast, rank),
            all_gather=functools.partial(comm.all_gather, rank),
        )

    with ThreadPoolExecutor(world) as pool:
        return [f.exception() for f in [pool.submit(rank_main, r) for r in range(world)]]


@pytest.mark.parametrize(("to", "world"), [("pt", 3), ("safetensors-shards", 2), ("dcp", 2)])
def test_ranks_write_the_same_bytes(s3, ckpt, tmp_path, to, world):
    options = {"max_shard_size": 100_000} if to == "safetensors-shards" else {}
    fmt = to.split("-")[0]
    folder = fmt == "dcp" or bool(options)
    key = f"ranks-{to}" + ("" if folder else ".pt")
    assert run_ranks(world, ckpt, fmt, f"s3://{BUCKET}/{key}", **options) == [None] * world
    local = tmp_path / ("local" if folder else "local.pt")
    convert([str(ckpt)], fmt, str(local), max_shard_size=options.get("max_shard_size"))
    assert remote_files(s3, key, folder) == local_files(local)
    assert open_uploads(s3) == []


def test_ranks_fail_alike_and_abort(s3, ckpt):
    s3.proxy.fault = lambda method, query: "etag" if "partNumber=2&" in query + "&" else None
    errors = run_ranks(2, ckpt, "pt", f"s3://{BUCKET}/ranks-bad.pt")
    assert all(isinstance(e, CkptError) for e in errors)
    assert len({str(e) for e in errors}) == 1
    assert "rank 0: " in str(errors[0]) and "aborted" in str(errors[0])
    assert objects(s3, "ranks-bad") == {} and open_uploads(s3) == []


def test_bucket_root(s3, ckpt, tmp_path):
    """A folder output at a bucket's root; a single file into it under its default name."""
    s3.direct.create_bucket(Bucket="root")
    convert([str(ckpt)], "dcp", "s3://root")
    convert([str(ckpt)], "safetensors", "s3://root/")
    names = sorted(o["Key"] for o in s3.direct.list_objects_v2(Bucket="root")["Contents"])
    assert names == [".metadata", "__0_0.distcp", "model.safetensors"]
    local = tmp_path / "dcp"
    convert([str(ckpt)], "dcp", str(local))
    body = s3.direct.get_object(Bucket="root", Key="__0_0.distcp")["Body"].read()
    assert body == (local / "__0_0.distcp").read_bytes()


def test_missing_bucket_one_line(s3, ckpt):
    with pytest.raises(CkptError, match=r"no such bucket 'nobucket'") as info:
        convert([str(ckpt)], "pt", "s3://nobucket/x.pt")
    assert "\n" not in str(info.value)


def test_complete_whose_answer_was_lost(s3, ckpt, tmp_path):
    """The store completed the upload but its answer was lost (a 500): the retry finds
    no upload, and the object's size and ETag say it is the one planned."""
    lost: list[str] = []

    def lose_first_complete(method: str, query: str):
        if method == "POST" and "uploadId=" in query and not lost:
            lost.append(query)
            return "lost"
        return None

    s3.proxy.fault = lose_first_complete
    convert([str(ckpt)], "pt", f"s3://{BUCKET}/lost/model.pt")
    local = tmp_path / "local.pt"
    convert([str(ckpt)], "pt", str(local))
    assert lost and objects(s3, "lost/") == {"lost/model.pt": local.read_bytes()}


@pytest.mark.slow  # a torchrun launch
def test_torchrun_ranks_into_one_bucket(s3, ckpt, tmp_path):
    """Two torchrun ranks (gloo) upload the parts of one pt output into the same upload
    (the parts holding CRC fields of the other rank's tensors once those are known):
    the bytes one process writes, each part sent once."""
    from helpers import finish, start_torchrun

    worker = Path(__file__).parent / "support" / "s3_rank_worker.py"
    env = {**s3.env, "CKPTTOOL_S3_PART_SIZE": str(PART)}
    url = f"s3://{BUCKET}/trun/model.pt"
    done = finish(start_torchrun(worker, ckpt, "pt", url, nproc=2, env=env), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    local = tmp_path / "local.pt"
    convert([str(ckpt)], "pt", str(local))
    assert objects(s3, "trun/") == {"trun/model.pt": local.read_bytes()}
    assert sorted(s3.proxy.uploads()) == list(range(1, -(-local.stat().st_size // PART) + 1))
    assert open_uploads(s3) == []


def test_zip_resumed_reads_only_what_it_needs(s3, tmp_path, monkeypatch):
    """A pt output interrupted at 70%: the journal kept the CRCs computed, so the rerun
    reads the tensors of the missing parts only (not the whole input again: a zip's
    central directory needs every CRC) and uploads only those parts."""
    import contextlib

    from ckpttool.targets import s3 as s3_output

    monkeypatch.setattr(s3_output, "JOURNAL_EVERY_S", 0.0)
    gen = torch.Generator().manual_seed(2)
    sd = {f"t{i}": torch.randn(2048, generator=gen) for i in range(48)}  # 8 KiB each
    src = tmp_path / "in.pt"
    torch.save(sd, src)
    url = f"s3://{BUCKET}/zipres/model.pt"

    def stop_at_70(total, description):
        done = [0]

        @contextlib.contextmanager
        def bar():
            def advance(n):
                done[0] += n
                if done[0] > total * 0.7:
                    raise KeyboardInterrupt

            yield advance

        return bar()

    with pytest.raises(KeyboardInterrupt):
        convert([str(src)], "pt", url, progress=stop_at_70)
    (upload,) = s3.direct.list_multipart_uploads(Bucket=BUCKET)["Uploads"]
    listed = s3.direct.list_parts(Bucket=BUCKET, Key="zipres/model.pt", UploadId=upload["UploadId"])
    have = {p["PartNumber"] for p in listed.get("Parts") or []}
    local = tmp_path / "local.pt"
    before = sources.LOCAL.bytes_read
    convert([str(src)], "pt", str(local))
    full = sources.LOCAL.bytes_read - before
    s3.proxy.reset()
    before = sources.LOCAL.bytes_read
    convert([str(src)], "pt", url)
    resumed = sources.LOCAL.bytes_read - before
    assert objects(s3, "zipres/") == {"zipres/model.pt": local.read_bytes()}
    count = -(-local.stat().st_size // PART)
    assert sorted(s3.proxy.uploads()) == sorted(set(range(1, count + 1)) - have)
    assert len(have) >= 3 and 0 < resumed < 0.6 * full, (have, resumed, full)


@pytest.mark.slow  # torchrun launches
@pytest.mark.parametrize("to", ["pt", "safetensors"])
def test_torchrun_cli_into_one_bucket(s3, ckpt, tmp_path, to):
    """``torchrun -m ckpttool convert ... -o s3://...``: every rank uploads its share of
    the parts of one multipart upload (the ranks exchange CRCs and the upload's session
    through torchrun's store); the object is byte for byte what one process writes."""
    import subprocess
    import sys

    from helpers import subprocess_env

    url = f"s3://{BUCKET}/cli-{to}/model.{'pt' if to == 'pt' else 'safetensors'}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "ckpttool", "convert", str(ckpt), "--to", to, "-o", url]  # fmt: skip
    env = subprocess_env(**s3.env, CKPTTOOL_S3_PART_SIZE=str(PART))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    local = tmp_path / f"local.{to}"
    convert([str(ckpt)], to, str(local))
    key = url.split(f"{BUCKET}/", 1)[1]
    assert objects(s3, f"cli-{to}/") == {key: local.read_bytes()}
    assert open_uploads(s3) == []
