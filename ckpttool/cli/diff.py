"""``ckpttool diff``: compare two checkpoints tensor by tensor (exit 1 when they differ)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .entry import EXIT_DIFFERENT, app, settings
from .options import Json, Quiet, Select, StripPrefix, Unsafe, examples
from .render import Painter, byte_progress, dumps_json
from .text import columns, plural, printable, short_dtype, write

DEFAULT_LIMIT = 20
# a progress bar only for diffs long enough to wonder about (and only on a terminal)
PROGRESS_BYTES = 256 << 20


@app.command(
    short_help="Compare two checkpoints tensor by tensor.",
    epilog=examples(
        "ckpttool diff ep3-rank0.pt ep3.safetensors    # bitwise",
        "ckpttool diff model.pt model-bf16.safetensors --atol 1e-2",
        "ckpttool diff a/ b/ --json | jq .counts",
        "ckpttool diff ep3-rank0.pt resumed-rank0.pt --select all    # optimizer state too",
        "ckpttool diff last.ckpt hf-export/ --select-a state_dict --strip-prefix-a model.",
    )
    + "\n\nTensors of different dtypes are compared by value, both cast to the wider one: "
    "with --atol/--rtol, a bf16 export within tolerance is equal. "
    "Exit 0: equal within tolerance, 1: different, 2: bad input.",
)
def diff(
    a: Annotated[str, typer.Argument(metavar="A", help="First checkpoint.", show_default=False)],
    b: Annotated[str, typer.Argument(metavar="B", help="Second checkpoint.", show_default=False)],
    atol: Annotated[
        float, typer.Option("--atol", metavar="X", help="Absolute tolerance (0: bitwise).")
    ] = 0.0,
    rtol: Annotated[
        float,
        typer.Option("--rtol", metavar="X", help="Relative tolerance: |a-b| <= atol + rtol*|b|."),
    ] = 0.0,
    limit: Annotated[
        int,
        typer.Option(
            "--limit", metavar="N", help="At most N lines per kind, largest first; 0: all."
        ),
    ] = DEFAULT_LIMIT,
    select: Select = "auto",
    strip_prefix: StripPrefix = "auto",
    select_a: Annotated[
        str | None,
        typer.Option(
            "--select-a",
            metavar="auto|all|KEY.PATH",
            help="--select for A alone.",
            show_default=False,
        ),
    ] = None,
    select_b: Annotated[
        str | None,
        typer.Option(
            "--select-b",
            metavar="auto|all|KEY.PATH",
            help="--select for B alone.",
            show_default=False,
        ),
    ] = None,
    strip_prefix_a: Annotated[
        str | None,
        typer.Option(
            "--strip-prefix-a",
            metavar="auto|none|PREFIX",
            help="--strip-prefix for A alone.",
            show_default=False,
        ),
    ] = None,
    strip_prefix_b: Annotated[
        str | None,
        typer.Option(
            "--strip-prefix-b",
            metavar="auto|none|PREFIX",
            help="--strip-prefix for B alone.",
            show_default=False,
        ),
    ] = None,
    arch: Annotated[
        str | None,
        typer.Option(
            "--arch",
            metavar="NAME",
            help="Compare through a mapping (torchtitan:llama3) with a Hugging Face folder.",
            show_default=False,
        ),
    ] = None,
    json_output: Json = False,
    unsafe: Unsafe = False,
    quiet: Quiet = False,
) -> None:
    """Names only in A or B, dtype/shape mismatches, largest value differences first."""
    from ..diff import diff as diff_checkpoints
    from ..errors import UsageError

    if limit < 0:
        raise UsageError("--limit must be >= 0 (0: no limit)")
    quiet = quiet or settings.quiet

    def progress(total: int, description: str) -> Any:
        return byte_progress(total, description, not quiet and total > PROGRESS_BYTES)

    result = diff_checkpoints(
        a,
        b,
        atol=atol,
        rtol=rtol,
        select=select,
        strip_prefix=strip_prefix,
        unsafe=unsafe,
        progress=progress,
        select_a=select_a,
        select_b=select_b,
        strip_prefix_a=strip_prefix_a,
        strip_prefix_b=strip_prefix_b,
        arch=arch,
    )
    if json_output:
        write(dumps_json(result) + "\n")
    else:
        write("\n".join(diff_lines(result, limit, Painter.for_stdout())) + "\n")
    if not result["equal"]:
        raise typer.Exit(EXIT_DIFFERENT)


def _spec(side: dict) -> str:
    return f"{side['dtype']}{side['shape']}"


def diff_lines(result: dict, limit: int, paint: Painter) -> list[str]:
    """The human diff: each kind largest first, at most ``limit`` lines each, then the
    verdict with counts per kind."""
    lines: list[str] = []

    def section(items: list[str], what: str) -> None:
        shown = items[:limit] if limit else items
        lines.extend(shown)
        if len(shown) < len(items):
            lines.append(f"  … {len(items) - len(shown):,} more {what} (--limit 0 shows all)")

    section([paint("- only in A", "red") + f": {printable(n)}" for n in result["only_in_a"]],
            "only in A")  # fmt: skip
    section([paint("+ only in B", "green") + f": {printable(n)}" for n in result["only_in_b"]],
            "only in B")  # fmt: skip
    shapes = [m for m in result["mismatched"] if m["kind"] == "shape"]
    section(
        [paint(f"! {printable(m['name'])}", "yellow") + f": {_spec(m['a'])} vs {_spec(m['b'])}"
         for m in shapes],
        "shape mismatches",
    )  # fmt: skip
    # those within tolerance are summed up in the verdict, not listed
    dtypes = sorted(
        (m for m in result["mismatched"] if m["kind"] == "dtype" and not m["within_tolerance"]),
        key=lambda m: -m.get("max_abs_diff", float("inf")),
    )
    outside = "differ" if not (result["atol"] or result["rtol"]) else "outside tolerance"
    dtype_lines = []
    for m in dtypes:
        line = f"! {printable(m['name'])}: {_spec(m['a'])} vs {_spec(m['b'])}"
        if "max_abs_diff" in m:
            line += f", max |a-b| {m['max_abs_diff']:.6g}"
            if m["num_different"]:
                line += f", {plural(m['num_different'], 'element')} {outside}"
        dtype_lines.append(paint(line, "yellow"))
    section(dtype_lines, "dtype mismatches")
    different = sorted(result["different"], key=lambda d: (-d["max_abs_diff"], d["name"]))
    if different:
        shown = different[:limit] if limit else different
        table = [["name", "max |a-b|", "elements"]]
        table += [
            [printable(d["name"]), f"{d['max_abs_diff']:.6g}", f"{d['num_different']:,}"]
            for d in shown
        ]
        text = columns(table, right={1, 2})
        lines += [paint("different values (largest first):", "bold"), paint(text[0], "dim")]
        lines += text[1:]
        if len(shown) < len(different):
            more = len(different) - len(shown)
            lines.append(f"  … {more:,} more different tensors (--limit 0 shows all)")
    lines.append(verdict(result, paint))
    return lines


def verdict(result: dict, paint: Painter) -> str:
    """``equal: 4 tensors compared (bitwise)`` or ``different: 1 only in A, ...; ...``."""
    counts = result["counts"]
    tol = (
        "bitwise"
        if not (result["atol"] or result["rtol"])
        else f"atol={result['atol']:g}, rtol={result['rtol']:g}"
    )
    compared = f"{plural(result['compared'], 'tensor')} compared ({tol})"
    if result["equal"]:
        text = paint("equal", "green") + f": {compared}"
    else:
        kinds = [
            (counts["only_in_a"], "only in A"),
            (counts["only_in_b"], "only in B"),
            (counts["shape"], "shape"),
            (counts["dtype"], "dtype"),
            (counts["values"], "values"),
        ]
        found = ", ".join(f"{n:,} {kind}" for n, kind in kinds if n)
        text = paint("different", "red") + f": {found}; {compared}"
    prefixes = result.get("prefixes", {})
    if prefixes.get("a") != prefixes.get("b"):  # two layouts paired: say how
        shown = ", ".join(
            f"{side.upper()} {printable(p) if p else 'none'}"
            for side, p in sorted(prefixes.items())
        )
        text += f"; prefixes stripped: {shown}"
    mapping = result.get("mapping")
    if mapping:  # compared across a mapping: say which side went through it
        text += (
            f"; {mapping['side'].upper()} mapped through {mapping['spec']} to "
            f"{mapping['architecture']}"
        )
    tied = result.get("tied", [])
    if tied:  # a tie one side alone names: the same weight
        first = tied[0]
        text += (
            f"; {plural(len(tied), 'name')} tied on one side only ({printable(first['name'])} "
            f"= {printable(first['to'])} in {first['side'].upper()}"
            + (", …" if len(tied) > 1 else "")
            + ")"
        )
    cast = [m for m in result["mismatched"] if m.get("within_tolerance")]
    if cast:
        pairs = sorted({(m["a"]["dtype"], m["b"]["dtype"]) for m in cast})
        names = ", ".join(f"{short_dtype(x)} vs {short_dtype(y)}" for x, y in pairs)
        worst = max(m["max_abs_diff"] for m in cast)
        text += (
            f"; {plural(len(cast), 'tensor')} within tolerance across dtypes ({names}), "
            f"max |a-b| {worst:.6g}"
        )
    return text
