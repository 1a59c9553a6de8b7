"""``ckpttool diff``: compare two checkpoints tensor by tensor (exit 1 when they differ)."""

from __future__ import annotations

from typing import Annotated

import typer

from .app import EXIT_DIFFERENT, app, handle_errors
from .options import Json, Unsafe
from .render import dumps_json, stdout_console


@app.command()
@handle_errors
def diff(
    a: Annotated[str, typer.Argument(help="First checkpoint.", show_default=False)],
    b: Annotated[str, typer.Argument(help="Second checkpoint.", show_default=False)],
    atol: Annotated[float, typer.Option("--atol", help="Absolute tolerance.")] = 0.0,
    rtol: Annotated[float, typer.Option("--rtol", help="Relative tolerance.")] = 0.0,
    json_output: Json = False,
    unsafe: Unsafe = False,
) -> None:
    """Names only in A or B, dtype/shape mismatches, max absolute difference."""
    from ..diff import diff as diff_checkpoints

    result = diff_checkpoints(a, b, atol=atol, rtol=rtol, unsafe=unsafe)
    if json_output:
        print(dumps_json(result))
    else:
        render(result)
    if not result["equal"]:
        raise typer.Exit(EXIT_DIFFERENT)


def render(result: dict) -> None:
    from rich.markup import escape  # names come from the files: never markup
    from rich.table import Table  # only for human output: --json stays fast

    console = stdout_console(highlight=False)
    for name in result["only_in_a"]:
        console.print(f"[red]- only in A[/]: {escape(name)}")
    for name in result["only_in_b"]:
        console.print(f"[green]+ only in B[/]: {escape(name)}")
    for m in result["mismatched"]:
        a, b = m["a"], m["b"]
        name = escape(m["name"])
        console.print(f"[yellow]! {name}[/]: {a['dtype']}{a['shape']} vs {b['dtype']}{b['shape']}")
    if result["different"]:
        table = Table(title="different tensors", title_justify="left")
        table.add_column("name", overflow="fold")
        table.add_column("max |a-b|", justify="right")
        table.add_column("elements", justify="right")
        for d in result["different"]:
            table.add_row(escape(d["name"]), f"{d['max_abs_diff']:.6g}", str(d["num_different"]))
        console.print(table)
    verdict = "[green]equal[/]" if result["equal"] else "[red]different[/]"
    tol = (
        "bitwise"
        if not (result["atol"] or result["rtol"])
        else f"atol={result['atol']}, rtol={result['rtol']}"
    )
    console.print(f"{verdict}: {result['compared']} tensors compared ({tol})")
