"""hf:// through huggingface_hub's HfFileSystem, its endpoint a loopback server that
answers the Hub's routes (revision, tree, resolve) over local files (tests/support/servers.py)."""

from __future__ import annotations

import random

import pytest
from servers import RangeServer

from ckpttool import sources
from ckpttool.errors import InputNotFoundError
from ckpttool.sources.remote import base

pytest.importorskip("huggingface_hub")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    import fsspec.config

    root = tmp_path_factory.mktemp("hub-root")
    repo = root / "hub" / "user" / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "model.bin").write_bytes(random.Random(2).randbytes(700_000))
    (repo / "sub" / "x.txt").write_bytes(b"x")
    server = RangeServer(root)
    saved = fsspec.config.conf.get("hf")
    fsspec.config.conf["hf"] = {"endpoint": f"http://127.0.0.1:{server.port}"}
    sources.forget("hf")
    yield server, repo
    sources.forget("hf")
    if saved is None:
        fsspec.config.conf.pop("hf", None)
    else:
        fsspec.config.conf["hf"] = saved
    server.close()


def test_reads_by_ranges_of_the_resolve_url(hub):
    server, repo = hub
    want = (repo / "model.bin").read_bytes()
    url = "hf://user/repo@main/model.bin"
    server.reset()
    assert sources.getsize(url) == len(want)
    assert bytes(sources.read(url, 5, 100)) == want[5:105]
    assert bytes(sources.read(url, len(want) - 10, 10)) == want[-10:]
    ranged = [(p, r) for m, p, r in server.requests if r]
    window = base.FIRST_WINDOW
    tail = (len(want) - window) // base.BLOCK * base.BLOCK
    assert ranged == [
        ("/ok/hub/user/repo/model.bin", f"bytes=0-{window - 1}"),
        ("/ok/hub/user/repo/model.bin", f"bytes={tail}-{len(want) - 1}"),
    ]
    assert bytes(sources.read(url)) == want


def test_repositories_list_and_glob(hub):
    assert sources.listdir("hf://user/repo@main") == ["model.bin", "sub"]
    assert sources.isdir("hf://user/repo/sub") and not sources.isdir("hf://user/repo/model.bin")
    assert sources.glob("hf://user/repo/*.bin") == ["hf://user/repo/model.bin"]


def test_revision_and_repo_type_are_parsed(hub):
    server, _ = hub
    server.reset()
    for url in ("hf://user/other@v1.0/x.pt", "hf://datasets/user/data@main/x.pt"):
        with pytest.raises(InputNotFoundError, match=r": no such file"):
            sources.getsize(url)
    assert [p for _, p, _ in server.requests] == [
        "/api/models/user/other/revision/v1.0",
        "/api/datasets/user/data/revision/main",
    ]


def test_missing_file(hub):
    with pytest.raises(InputNotFoundError, match=r"^hf://user/repo@main/nope\.bin: no such"):
        sources.getsize("hf://user/repo@main/nope.bin")
