"""The s3:// byte source against moto's S3 server on 127.0.0.1: exact bytes, listings and
globs of prefixes, an object rewritten mid-read, missing keys and buckets."""

from __future__ import annotations

import random

import pytest
from servers import S3Server

from ckpttool import sources
from ckpttool.errors import CkptError, InputNotFoundError
from ckpttool.sources.remote import base
from ckpttool.sources.remote.store import StoreSource

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server()
    undo = server.configure()
    sources.forget("s3")
    root = tmp_path_factory.mktemp("bucket")
    rng = random.Random(1)
    (root / "run").mkdir()
    for rank in range(3):
        (root / "run" / f"ep0-ba1-rank{rank}.pt").write_bytes(rng.randbytes(300_000 + rank))
    (root / "run" / "sub").mkdir()
    (root / "run" / "sub" / "x.bin").write_bytes(b"x")
    (root / "big.bin").write_bytes(rng.randbytes(2_500_000))
    server.upload(root, "bkt", "data")
    server.root = root
    yield server
    sources.forget("s3")
    undo()
    server.close()


def test_reads_exact_bytes(s3):
    url = "s3://bkt/data/big.bin"
    want = (s3.root / "big.bin").read_bytes()
    source = sources.source_for(url)
    assert isinstance(source, StoreSource)
    assert sources.getsize(url) == len(want)
    assert bytes(sources.read(url, len(want) - 22, 22)) == want[-22:]
    assert bytes(sources.read(url, 17, 1000)) == want[17:1017]
    assert sources.local_path(url) is None


def test_spans_in_parallel(s3, monkeypatch):
    monkeypatch.setattr(base, "PART", 200 << 10)
    monkeypatch.setattr(base, "MAX_WINDOW", 100 << 10)
    url = "s3://bkt/data/big.bin"
    want = (s3.root / "big.bin").read_bytes()
    source = StoreSource("s3")
    buf = bytearray(len(want))
    view = memoryview(buf)
    source.read_spans(url, [(view[:1_000_000], 0), (view[1_000_000:], 1_000_000)])
    assert buf == want
    # one info, then 5 + 8 parts of at most 200 KiB
    assert source.requests == 1 + 5 + 8
    assert source.bytes_read == len(want)


def test_prefixes_list_and_glob(s3):
    folder = "s3://bkt/data/run"
    assert sources.isdir(folder) and sources.isdir(folder + "/")
    assert not sources.isdir(folder + "/ep0-ba1-rank0.pt")
    assert sources.listdir(folder) == [
        "ep0-ba1-rank0.pt",
        "ep0-ba1-rank1.pt",
        "ep0-ba1-rank2.pt",
        "sub",
    ]
    assert sources.glob("s3://bkt/data/run/ep0-ba1-rank*.pt") == [
        f"s3://bkt/data/run/ep0-ba1-rank{r}.pt" for r in range(3)
    ]
    assert sources.isfile(folder + "/ep0-ba1-rank2.pt")
    assert sources.exists(folder + "/sub/x.bin") and not sources.exists(folder + "/nope")


def test_object_rewritten_mid_read(s3):
    url = "s3://bkt/data/rewritten.bin"
    client = s3.client()
    client.put_object(Bucket="bkt", Key="data/rewritten.bin", Body=b"a" * 1_000_000)
    source = StoreSource("s3")
    assert bytes(source.read(url, 0, 10)) == b"a" * 10
    client.put_object(Bucket="bkt", Key="data/rewritten.bin", Body=b"b" * 1_000_000)
    with pytest.raises(CkptError, match="changed while being read") as info:
        source.read(url, 900_000, 10)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_missing_key_and_bucket(s3):
    with pytest.raises(InputNotFoundError, match=r"^s3://bkt/data/nope\.pt: no such file"):
        sources.getsize("s3://bkt/data/nope.pt")
    with pytest.raises(InputNotFoundError, match=r"^s3://nobucket/x\.pt: no such file"):
        sources.getsize("s3://nobucket/x.pt")


@pytest.mark.parametrize("name", ["../other/x.pt", "/x.pt", "s3://other-bucket/x.pt"])
def test_names_stay_in_the_folder(s3, name):
    with pytest.raises(CkptError, match="leaves the checkpoint's folder"):
        sources.join("s3://bkt/data/run", name)
