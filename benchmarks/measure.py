"""Wall time and peak RSS of a command run as a subprocess (``os.wait4``'s rusage).

Each measurement is warm: untimed warm-up run(s) first, then the median wall time
of ``repeat`` runs; peak RSS is the largest of those runs. Outputs are removed and
dirty pages flushed (``os.sync``, untimed) after every run, so one run's writeback
does not land in the next one's time. The page cache is never dropped.

Peak RSS comes from GNU ``/usr/bin/time -f %M`` when it is there: Linux carries the
parent's high-water RSS into a child across fork/vfork + exec, so ``wait4`` straight
from this (torch-importing, hundreds of MiB) process would report at least that. The
tiny ``time`` process in between keeps the number honest. Wall time is measured here
(``time``'s own ``%e`` has 10 ms resolution).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20
GNU_TIME = "/usr/bin/time"


def rss_source() -> str:
    """How peak RSS is measured: ``gnu-time`` or ``wait4`` (inflated to this process's RSS)."""
    return "gnu-time" if os.access(GNU_TIME, os.X_OK) else "wait4"


class CommandFailed(RuntimeError):
    pass


@dataclass
class Measurement:
    cmd: list[str]
    walls: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    rc: int = 0

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def rss_mib(self) -> float:
        return max(self.rss_kib) / 1024

    def as_dict(self) -> dict:
        return {"cmd": self.cmd, "walls": self.walls, "rss_kib": self.rss_kib, "rc": self.rc}


def remove(path: str | Path) -> None:
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def child_env(pycache: Path) -> dict[str, str]:
    """The environment commands run in: bytecode caches on, as in an installed package.

    Some shells (CI, sandboxes) export ``PYTHONDONTWRITEBYTECODE=1``; then every run
    recompiles ckpttool from source (~40 ms, more than users ever pay). The caches go
    to ``pycache`` (``PYTHONPYCACHEPREFIX``), never into the source tree; the
    warm-up run fills them.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def run_once(cmd: Sequence[str], stdout, stderr, env=None) -> tuple[float, int, int]:
    """(wall seconds, peak RSS KiB, exit code) of one run of ``cmd``."""
    with tempfile.NamedTemporaryFile("r") as rss_file:
        wrapped = list(cmd)
        if rss_source() == "gnu-time":
            wrapped = [GNU_TIME, "-f", "%M", "-o", rss_file.name, *wrapped]
        start = time.perf_counter()
        proc = subprocess.Popen(
            wrapped, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from waiting again
        rss = usage.ru_maxrss
        if wrapped[0] == GNU_TIME:
            # GNU time writes "Command exited with non-zero status N" before %M on failure.
            rss = int(rss_file.read().split()[-1])
    return wall, rss, proc.returncode


def measure(
    cmd: Sequence[str],
    *,
    outputs: Sequence[str | Path] = (),
    expect_rc: Sequence[int] = (0,),
    check_stdout: Callable[[bytes], str | None] | None = None,
    warmup: int = 1,
    repeat: int = 3,
    env: dict[str, str] | None = None,
) -> Measurement:
    """Run ``cmd`` ``warmup + repeat`` times; raise :class:`CommandFailed` on a bad run.

    Args:
        outputs: Paths the command writes; checked to exist, then removed after each run.
        expect_rc: Exit codes that count as success (``diff`` exits 1 on differences).
        check_stdout: Returns an error message for bad stdout, or None.
    """
    result = Measurement(list(map(str, cmd)))
    for path in outputs:
        remove(path)
    os.sync()
    for i in range(warmup + repeat):
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            wall, rss, rc = run_once(result.cmd, out, err, env)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        problem = None
        if rc not in expect_rc:
            problem = f"exit code {rc} (expected {list(expect_rc)})"
        elif missing := [str(p) for p in outputs if not Path(p).exists()]:
            problem = f"did not write {missing}"
        elif check_stdout is not None:
            problem = check_stdout(stdout)
        for path in outputs:
            remove(path)
        os.sync()
        if problem:
            tail = stderr.decode(errors="replace").strip()[-1500:]
            raise CommandFailed(f"{' '.join(result.cmd)}: {problem}\n{tail}")
        result.rc = rc
        if i >= warmup:
            result.walls.append(wall)
            result.rss_kib.append(rss)
    return result
