"""The read guard: the address-space cap is the process's, so reads that overlap (other
threads, a read inside a read) must leave the limit as they found it; a pickle whose memo
index asks for gigabytes fails as a corrupt file, in this process, without taking them."""

from __future__ import annotations

import pickle
import resource
import struct
import threading

import pytest

from ckpttool.errors import CkptError
from ckpttool.guard import address_space_limit
from ckpttool.unpickler.restricted import load_pickle

# BINUNICODE "a", LONG_BINPUT 1e9: CPython grows its memo table to 2e9 slots first
MEMO_BOMB = b"\x80\x02X\x01\x00\x00\x00ar" + struct.pack("<I", 1_000_000_000) + b"."


def test_memo_bomb_is_corrupt_and_the_limit_is_restored():
    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(CkptError, match="more memory than it holds"):
        load_pickle(MEMO_BOMB, path="bomb.pkl")
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    big = pickle.dumps({"x": list(range(100_000))}, protocol=2)
    assert load_pickle(big)["x"][-1] == 99_999  # a real pickle still reads


def test_overlapping_reads_restore_the_limit():
    before = resource.getrlimit(resource.RLIMIT_AS)
    data = pickle.dumps([{"a": (i, "x" * 10)} for i in range(20_000)], protocol=2)
    errors: list[BaseException] = []

    def read_many() -> None:
        try:
            for _ in range(5):
                assert len(load_pickle(data)) == 20_000
                with pytest.raises(CkptError):
                    load_pickle(MEMO_BOMB)
        except BaseException as exc:  # reported below, with the thread's own error
            errors.append(exc)

    threads = [threading.Thread(target=read_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert resource.getrlimit(resource.RLIMIT_AS) == before


def test_a_read_inside_a_read_keeps_the_outer_limit():
    before = resource.getrlimit(resource.RLIMIT_AS)
    with address_space_limit(1000):
        outer = resource.getrlimit(resource.RLIMIT_AS)
        if before[0] == resource.RLIM_INFINITY:  # (a tighter limit already set is kept)
            assert outer[0] != resource.RLIM_INFINITY
        with address_space_limit(10**9):
            assert resource.getrlimit(resource.RLIMIT_AS) == outer
        assert resource.getrlimit(resource.RLIMIT_AS) == outer
    assert resource.getrlimit(resource.RLIMIT_AS) == before
