"""Child programs the tests start in a fresh interpreter:
``python tests/support/children.py NAME ...``
(see :func:`helpers.run_child`).

A fresh process where the test needs one: to run the whole attack corpus through the CLI
with one torch import instead of a hundred, to load outputs with a real ``torch.load``
that must run nothing, to measure a command's own peak memory or CPU time. Nothing here
imports torch or ckpttool at module level: a measured child pays only for what it runs.
"""

from __future__ import annotations

import json
import sys


def cli_batch() -> None:
    """Run each argv of the JSON list on stdin through ckpttool's real entry point,
    in-process; print one JSON list of ``{"code", "stdout", "stderr"}``."""
    import contextlib
    import io

    from ckpttool.cli import main

    results = []
    for argv in json.load(sys.stdin):
        out, err = io.StringIO(), io.StringIO()
        sys.argv = ["ckpttool", *argv]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
    print(json.dumps(results))


def load_both_ways() -> None:
    """Load every path of the JSON list on stdin both ways: ``weights_only=True`` must
    read it, ``weights_only=False`` must run nothing (the caller looks for markers)."""
    import torch

    for path in json.load(sys.stdin):
        torch.load(path, weights_only=True)
        torch.load(path, weights_only=False)
    print("ok")


def run_payloads() -> None:
    """``torch.load(weights_only=False)`` every path of the JSON list on stdin: proves
    the payloads really act, so the "no marker" assertions can fail."""
    import torch

    for path in json.load(sys.stdin):
        try:
            torch.load(path, weights_only=False)
        except Exception:
            pass  # a payload's call may fail after it acted


def measured(*argv: str) -> None:
    """Run ``ckpttool ARGV``; at exit write this process's peak resident memory (KiB)
    to the file ``$CKPTTOOL_RSS_FILE``."""
    import atexit
    import os
    import resource

    from ckpttool.cli import main

    def report() -> None:
        with open(os.environ["CKPTTOOL_RSS_FILE"], "w") as f:
            f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))

    atexit.register(report)
    sys.argv = ["ckpttool", *argv]
    main()


def limited(specs: str) -> None:
    """Run each ``[cpu_limit_s, stdout_file, stderr_file, argv]`` of the JSON ``specs``
    (``argv``: ckpttool's arguments) one after the other under its own ``RLIMIT_CPU``;
    print each one's ``[exit code, CPU seconds, peak RSS bytes]`` as one JSON list.

    Started from pytest, a child's ru_maxrss would count the pytest image it was forked
    from (hundreds of MB, torch loaded): this small process imports ckpttool's CLI once
    and forks each command from that (a fresh interpreter per command would cost ~0.3 s
    each, torch's import more); each command's figures are its own child's.
    """
    import os
    import resource

    from ckpttool.cli import main

    results = []
    for cpu, out, err, args in json.loads(specs):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the command: its own limits, its own stdout and stderr
            code = 70
            try:
                resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
                for fd, path in ((1, out), (2, err)):
                    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(target, fd)
                    os.close(target)
                sys.argv = ["ckpttool", *args]
                try:
                    main()
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        cpu_s = usage.ru_utime + usage.ru_stime
        results.append([os.waitstatus_to_exitcode(status), cpu_s, usage.ru_maxrss * 1024])
    print(json.dumps(results))


CHILDREN = {
    "cli-batch": cli_batch,
    "load-both-ways": load_both_ways,
    "run-payloads": run_payloads,
    "measured": measured,
    "limited": limited,
}

if __name__ == "__main__":
    CHILDREN[sys.argv[1]](*sys.argv[2:])
