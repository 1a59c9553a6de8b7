"""Rich rendering helpers: sizes, the structure tree, progress on stderr."""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.tree import Tree


MAX_CHILDREN = 12
MAX_DEPTH = 6
MAX_VALUE_CHARS = 60


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


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def short(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    text = repr(value)  # an opaque object's is "<opaque pkg.mod.Class>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe_tensor(ref: Any) -> str:
    from ..tree import ShardedRef, SparseRef

    shape = "×".join(map(str, ref.shape)) or "scalar"
    text = f"[cyan]{ref.dtype.name}[/] [{shape}]"
    if isinstance(ref, SparseRef):
        text += f" [magenta]{ref.layout}[/]"
    if isinstance(ref, ShardedRef):
        text += f" [magenta]{len(ref.shards)} shards[/]"
    elif ref.device != "cpu":
        text += f" on {ref.device}"
    return text


def structure_tree(label: str, root: Any, model_key: tuple | None, model_label: str) -> Tree:
    """The nested structure, with the model state dict collapsed to one line."""
    from rich.markup import escape
    from rich.tree import Tree

    from ..layout import is_plain
    from ..tree import Opaque, StorageRef, children, is_tensor

    tree = Tree(label)

    def add(node: Any, branch: Tree, path: tuple, depth: int) -> None:
        items = list(children(node))
        for i, (key, value) in enumerate(items):
            if i == MAX_CHILDREN:
                branch.add(f"[dim]… {len(items) - MAX_CHILDREN} more[/]")
                break
            here = path + (key,)
            name = f"[bold]{escape(str(key))}[/]"
            if here == model_key:
                branch.add(f"{name} [green]← {model_label}[/]")
            elif is_tensor(value):
                branch.add(f"{name}: {describe_tensor(value)}")
            elif isinstance(value, StorageRef):  # saved on its own, not as a tensor
                branch.add(f"{name}: storage {value.dtype.name} [{value.numel}]")
            elif is_plain(value) or isinstance(value, Opaque) and not list(value.children()):
                branch.add(f"{name} = {escape(short(value))}")
            else:
                kind = type(value).__name__ if not isinstance(value, Opaque) else value.class_name()
                size = len(value) if isinstance(value, (dict, list, tuple)) else ""
                sub = branch.add(f"{name} [dim]({kind}{f', {size}' if size != '' else ''})[/]")
                if depth < MAX_DEPTH:
                    add(value, sub, here, depth + 1)

    if model_key == ():
        tree.add(f"[green]{model_label}[/]")
    else:
        add(root, tree, (), 0)
    return tree


def stdout_console(**options: Any) -> Console:
    """A rich console on stdout; a reader that leaves early (``| head``) is not an error.

    rich's default exits 1 on a broken pipe, and 1 means "differences" to ``diff``'s callers.
    """
    from rich.console import Console

    class _Stdout(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(0)

    return _Stdout(**options)


def stderr_console() -> Console:
    # soft_wrap: a message is one line whatever the width (no folded paths or class names)
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


@contextmanager
def byte_progress(total: int, description: str, enabled: bool):
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

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr_console(),
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def progress_factory(quiet: bool):
    """What the core's ``progress`` argument expects: (total, description) -> context."""

    def make(total: int, description: str):
        return byte_progress(total, description, enabled=not quiet)

    return make
