"""Terminal helpers: colours (NO_COLOR, --no-color), JSON, progress bars on stderr."""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


from .text import human_bytes  # noqa: F401  (the commands' 'wrote' lines use it from here)


def dumps_json(value: Any) -> str:
    """Strict JSON (no NaN/Infinity tokens, which JSON.parse rejects): they become strings."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # a NaN or infinity somewhere: walk the value to replace them
        pass

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(value), allow_nan=False)


def stderr_console() -> Console:
    # soft_wrap: a message is one line whatever the width (no folded paths or class names)
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, no_color=not color_enabled(sys.stderr) or None)


def color_enabled(stream: Any) -> bool:
    """Colours only on a terminal, never with NO_COLOR set (https://no-color.org) or
    --no-color; FORCE_COLOR asks for them anyway (CI logs)."""
    from .entry import settings

    if settings.no_color or os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return stream.isatty() and os.environ.get("TERM") != "dumb"


class Painter:
    """ANSI colours for whole lines or words of plain text, or nothing at all."""

    CODES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}

    def __init__(self, enabled: bool):
        self.enabled = enabled

    @classmethod
    def for_stdout(cls) -> Painter:
        return cls(color_enabled(sys.stdout))

    def __call__(self, text: str, style: str) -> str:
        if not self.enabled or not text:
            return text
        return f"\x1b[{self.CODES[style]}m{text}\x1b[0m"


@contextmanager
def byte_progress(total: int, description: str, enabled: bool) -> Any:
    """A progress bar on stderr (bytes done, rate), only when stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class _BinarySpeedColumn(TransferSpeedColumn):
        """MiB/s: rich's own shows MB/s beside DownloadColumn's MiB."""

        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            if speed is None:
                return Text("?", style="progress.data.speed")
            return Text(f"{human_bytes(speed)}/s", style="progress.data.speed")

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),  # the units of every other size ckpttool shows
        _BinarySpeedColumn(),
        TimeRemainingColumn(),
        console=stderr_console(),
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def progress_factory(quiet: bool) -> Any:
    """What the core's ``progress`` argument expects: (total, description) -> context."""

    def make(total: int, description: str) -> Any:
        return byte_progress(total, description, enabled=not quiet)

    return make
