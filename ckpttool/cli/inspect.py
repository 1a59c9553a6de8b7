"""``ckpttool inspect``: what is inside a checkpoint, without reading tensor data."""

from __future__ import annotations

from collections import defaultdict
from typing import Annotated

import typer

from .app import app, handle_errors
from .options import Json, Paths, Unsafe
from .render import (
    byte_progress,
    dumps_json,
    human_bytes,
    short,
    stdout_console,
    structure_tree,
)

STATS_PROGRESS_BYTES = 256 << 20


@app.command()
@handle_errors
def inspect(
    paths: Paths,
    json_output: Json = False,
    filter: Annotated[
        str | None,
        typer.Option("--filter", help="Only tensors/values whose dotted key matches this regex."),
    ] = None,
    stats: Annotated[
        bool, typer.Option("--stats", help="Read the data: min/max/mean/std, NaN/Inf counts.")
    ] = False,
    unsafe: Unsafe = False,
) -> None:
    """Show format, structure, tensors, totals and plain values (epoch, step...)."""
    from ..api import read
    from ..report import inspect_report
    from ..tree import iter_tensors

    ckpt = read(paths, unsafe=unsafe)
    total = sum(ref.nbytes for _, ref in iter_tensors(ckpt.root)) if stats else 0
    with byte_progress(total, "reading tensors", stats and total > STATS_PROGRESS_BYTES) as advance:
        report = inspect_report(ckpt, filter=filter, stats=stats, progress=advance)
    if json_output:
        print(dumps_json(report))
        return
    render(ckpt, report)


def render(ckpt, report: dict) -> None:
    from rich.markup import escape  # keys, values, names come from the file: never markup
    from rich.table import Table  # only for human output: --json stays fast

    from ..layout import model_state
    from ..tree import get_path, iter_tensors

    console = stdout_console()
    world = f", world size {report['world_size']}" if report["world_size"] else ""
    console.print(
        f"[bold]{report['format']}[/]{world}: "
        + ", ".join(escape(f) for f in report["files"][:4])
        + (f" … ({len(report['files'])} files)" if len(report["files"]) > 4 else "")
    )
    model_key = tuple(report["model_key"]) if report["model_key"] is not None else None
    if model_key is None:
        console.print("model state dict: [yellow]none found[/]")
        model_label = ""
    else:
        where = escape(".".join(map(str, model_key))) or "(root)"
        n = sum(1 for _ in iter_tensors(model_state(get_path(ckpt.root, model_key)) or {}))
        prefix = escape(report["prefix"] or "none")
        model_label = f"model state dict, {n} tensors, prefix {prefix}"
        console.print(f"model state dict: [green]{where}[/], wrapper prefix: [green]{prefix}[/]")
    console.print(structure_tree("[bold]structure[/]", ckpt.root, model_key, model_label))

    stats = any("stats" in t for t in report["tensors"])
    table = Table(title="tensors", title_justify="left")
    for column in ("name", "dtype", "shape", "device", "size"):
        table.add_column(
            column,
            justify="right" if column == "size" else "left",
            overflow="fold" if column == "name" else "ellipsis",
        )
    if any(t["sharded"] for t in report["tensors"]):
        table.add_column("shards", justify="right")
    if stats:
        for column in ("min", "max", "mean", "std", "nan/inf"):
            table.add_column(column, justify="right")
    for t in report["tensors"]:
        row = [
            escape(".".join(map(str, t["key"]))),
            f"{t['dtype']} {t['layout']}" if "layout" in t else t["dtype"],
            str(t["shape"]),
            escape(t["device"]),
            human_bytes(t["nbytes"]),
        ]
        if len(table.columns) > 5 + (5 if stats else 0):
            row.append(str(t.get("shards", "")))
        if stats:
            s = t["stats"]
            row += [
                _fmt(s["min"]),
                _fmt(s["max"]),
                _fmt(s["mean"]),
                _fmt(s["std"]),
                f"{s['nan']}/{s['inf']}",
            ]
        table.add_row(*row)
    console.print(table)

    by_dtype: dict[str, int] = defaultdict(int)
    for t in report["tensors"]:
        by_dtype[t["dtype"]] += t["nbytes"]
    console.print(
        f"[bold]totals[/]: {report['num_tensors']} tensors, "
        f"{report['num_params']:,} model parameters, "
        f"{human_bytes(report['nbytes'])} ("
        + ", ".join(f"{d} {human_bytes(n)}" for d, n in sorted(by_dtype.items()))
        + ")"
    )
    if report["values"]:
        values = Table(title="values", title_justify="left")
        values.add_column("key", overflow="fold")
        values.add_column("type")
        values.add_column("value")
        for v in report["values"]:
            key = ".".join(map(str, v["key"]))
            values.add_row(escape(key), escape(v["type"]), escape(short(v["value"])))
        console.print(values)
    opaque = sorted({v["value"] for v in report["values"] if v["type"] == "opaque"})
    if report["dangerous"]:
        console.print(
            "[red]security[/]: dangerous globals kept inert (--unsafe): "
            + escape(", ".join(report["dangerous"]))
        )
    elif report["globals"] or report["format"] not in ("safetensors", "safetensors-sharded"):
        extra = f"; shown as placeholders: {escape(', '.join(opaque))}" if opaque else ""
        if report["unverified"]:
            extra += f"; unverified (on no allow-list): {escape(', '.join(report['unverified']))}"
        console.print(
            "[green]security[/]: read without running code; "
            f"{len(report['globals'])} globals, none dangerous{extra}"
        )
    else:
        console.print("[green]security[/]: safetensors, no code involved")


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)
