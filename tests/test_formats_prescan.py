"""The forked pre-scan of sibling rank files: the child's results are the parent's,
a failed scan is redone in the parent (so its real error surfaces), an unwanted
child is stopped and reaped, and nothing is forked while other threads run.

Each case runs in a fresh interpreter: pytest's own process may have threads left
by other tests, and then (by design) nothing is forked.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

COMMON = """
import os, threading, time
from ckpttool.errors import CkptError
from ckpttool.formats.prescan import Prescan

def scan_reporting_pid(path):
    # which process scanned `path`; a path named `bad` fails as a corrupt file would
    if path == "bad":
        raise CkptError("corrupt pickle", path=path)
    return [f"{path}@{os.getpid()}"], [], [f"{path}.Unverified"]
"""


def run_case(body: str) -> None:
    code = COMMON + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_child_scans_and_parent_gets_its_results():
    run_case("""
        with Prescan(["a", "b"], scan_reporting_pid) as prescan:
            seen, bad, unverified = prescan.scan("a")
            child = int(seen[0].split("@")[1])
            assert child != os.getpid() and bad == [] and unverified == ["a.Unverified"]
            assert prescan.scan("b") == ([f"b@{child}"], [], ["b.Unverified"])
            # a path the child was not given is scanned here
            assert prescan.scan("c") == scan_reporting_pid("c")
    """)


def test_failed_scan_is_redone_in_the_parent_with_its_error():
    run_case("""
        with Prescan(["a", "bad"], scan_reporting_pid) as prescan:
            try:
                prescan.scan("bad")
                raise SystemExit("no error")
            except CkptError as exc:
                assert str(exc) == "bad: corrupt pickle", exc
            assert prescan.scan("a")[0] != scan_reporting_pid("a")[0]
    """)


def test_unwanted_child_is_stopped_and_reaped():
    run_case("""
        def slow(path):
            time.sleep(60)
            return [], []

        with Prescan(["a"], slow) as prescan:
            pid = prescan._pid
            assert pid > 0
        try:
            os.kill(pid, 0)
            raise SystemExit("child still exists")
        except ProcessLookupError:  # killed and waited for: no zombie left
            pass
    """)


def test_no_fork_while_other_threads_run():
    run_case("""
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait)
        worker.start()
        try:
            with Prescan(["a"], scan_reporting_pid) as prescan:
                assert prescan._pid == 0
                assert prescan.scan("a") == scan_reporting_pid("a")
        finally:
            stop.set()
            worker.join()
    """)


SHARED = """
from ckpttool import sharing

class Members:
    # rank `rank` of `size`; the others' results are made up, their scans named `@rankR`
    def __init__(self, rank, size, paths):
        self.rank, self.size, self.paths, self.sent = rank, size, paths, []

    def all_gather(self, mine):
        self.sent.append(mine)
        out = []
        for r in range(self.size):
            if r == self.rank:
                out.append(mine)
            else:
                share = range(r, len(self.paths), self.size)
                out.append({i: ([f"{self.paths[i]}@rank{r}"], [], []) for i in share})
        return out
"""


def test_several_processes_each_scan_their_share_and_gather_the_rest():
    run_case(
        SHARED
        + """
        paths = ["a", "b", "c", "d", "e"]
        members = Members(1, 3, paths)  # rank 1 of 3: "b" and "e" are its share
        with sharing.joined(members), Prescan(paths, scan_reporting_pid) as prescan:
            assert prescan.scan("a") == (["a@rank0"], [], [])
            assert prescan.scan("c") == (["c@rank2"], [], [])
            assert prescan.scan("d") == (["d@rank0"], [], [])
            seen, bad, unverified = prescan.scan("b")
            assert seen[0].startswith("b@") and unverified == ["b.Unverified"]
            assert prescan.scan("e")[0][0].startswith("e@")
        # one gather, of this rank's share only
        assert len(members.sent) == 1 and sorted(members.sent[0]) == [1, 4], members.sent
        # in one process nothing is dealt: every file scanned here
        with Prescan(paths, scan_reporting_pid) as prescan:
            assert all("@rank" not in prescan.scan(p)[0][0] for p in paths)
    """
    )


def test_a_failing_scan_of_its_share_raises_before_the_gather():
    run_case(
        SHARED
        + """
        paths = ["a", "bad", "c"]
        members = Members(1, 2, paths)  # rank 1 of 2: "bad" is its share
        with sharing.joined(members), Prescan(paths, scan_reporting_pid) as prescan:
            try:
                prescan.scan("a")
                raise SystemExit("no error")
            except CkptError as exc:
                assert str(exc) == "bad: corrupt pickle", exc
        assert members.sent == []  # the others learn of it from the posted error
    """
    )
