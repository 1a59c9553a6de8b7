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
