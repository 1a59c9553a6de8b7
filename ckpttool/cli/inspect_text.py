"""``inspect``'s human output: a summary first, then the tensors with repeated numbered
blocks collapsed, the structure, the values, each section limited unless ``--full``.

Every line is plain text built here and coloured (on a terminal) afterwards; nothing
wraps, so piped output keeps each name whole on its own line. Text that comes from the
file is shown through :func:`printable`, and summary labels start at column 0 while
every table row is indented: no key or value can pass for a line of the summary.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..sources import is_url
from .collapse import Row, collapse
from .fit import MAX_WIDTH, cut, fit_columns
from .structure import structure_lines
from .text import columns, human_bytes, human_count, plural, printable, short_dtype, short_value

Paint = Callable[[str, str], str]
MAX_FILES_SHOWN = 4
MAX_SUMMARY_VALUES = 8
MAX_SUMMARY_METADATA = 4
# The plain values a training run is known by, shown in the summary (last key, lowercase).
KEY_VALUES = re.compile(
    r"^(epochs?|epochs_run|current_epoch|step|steps|global_step|iter|iter_num|iteration|"
    r"iterations|num_updates|lr|learning_rate|loss|val_loss|train_loss|best_\w+|"
    r"timestamp|seed|world_size)$"
)
STATS_COLUMNS = ("min", "max", "mean", "std", "nan/inf")
# Rows per table unless --limit says; the values table (the summary names the key ones)
# gets what is left of one screen, at least VALUE_ROWS_MIN rows
DEFAULT_ROWS = 40
SCREEN_LINES = 40
VALUE_ROWS_MIN = 3


@dataclass
class Options:
    full: bool = False
    limit: int | None = None  # rows per table; 0: all; None: DEFAULT_ROWS, values fit a screen
    sort: str | None = None  # name, size, dtype; None: as stored
    filter: str | None = None
    # the terminal's columns, that rows fit by shortening names; None piped: rows whole
    width: int | None = None


def inspect_lines(ckpt: Any, report: dict, options: Options, paint: Paint) -> list[str]:
    """The human ``inspect`` output for ``report`` (from ``inspect_report``) as lines."""
    lines = summary_lines(ckpt, report, options, paint)
    if options.filter and not report["tensors"] and not report["values"]:
        lines.append(paint(f"nothing matches --filter {printable(options.filter)!r}", "yellow"))
        return lines
    lines += tensor_lines(report, options, paint)
    lines += tree_lines(ckpt, report, options, paint)
    lines += value_lines(report, options, paint, used=len(lines))
    lines += metadata_lines(report, options, paint)
    return lines


# ----------------------------------------------------------------------------- summary


def summary_lines(ckpt: Any, report: dict, options: Options, paint: Paint) -> list[str]:
    def label(name: str, text: str, style: str | None = None) -> str:
        return paint(f"{name}:", "bold") + " " + (paint(text, style) if style else text)

    files = report["files"]
    world = f", world size {report['world_size']}" if report["world_size"] else ""
    lines = [label("format", _format_text(report["format"], world, files))]
    shown, more = files, ""
    if not options.full and len(files) > MAX_FILES_SHOWN:  # the first ones and the last
        shown = [*files[: MAX_FILES_SHOWN - 1], "…", files[-1]]
        more = f" ({len(files)} files; --full lists them)"
    lines += _file_lines(files, shown, more, label)
    if any(is_url(f) for f in files) and "transfer" in report:
        read = report["transfer"]
        text = f"{human_bytes(read['bytes'])} in {plural(read['requests'], 'request')}"
        lines.append(label("transfer", text))

    model_key = tuple(report["model_key"]) if report["model_key"] is not None else None
    if model_key is None:
        lines.append(label("model", "no model state dict found", "yellow"))
    else:  # counted by the report (--filter applied, a tied embedding once), as --json says
        params = report["num_params"]
        depth = len(model_key)
        in_model = sum(tuple(t["key"][:depth]) == model_key for t in report["tensors"])
        where = printable(".".join(map(str, model_key))) if model_key else "(root)"
        count = human_count(params) + " parameters" + (f" ({params:,})" if params >= 1000 else "")
        prefix = report["prefix"]
        wrapper = f"wrapper prefix {printable(prefix)}" if prefix else "no wrapper prefix"
        matching = " matching --filter" if options.filter else ""
        text = f"{where}, {plural(in_model, 'tensor')}{matching}, {count}, {wrapper}"
        lines.append(label("model", text))

    by_dtype: dict[str, int] = defaultdict(int)
    devices = set()
    tied = [t for t in report["tensors"] if "tied_to" in t]
    for t in report["tensors"]:
        if "tied_to" not in t:  # (its bytes are another name's: counted once, as nbytes)
            by_dtype[short_dtype(t["dtype"])] += t["nbytes"]
        devices.add(t["device"])
    matching = " matching --filter" if options.filter else ""
    text = f"{human_bytes(report['nbytes'])} in {plural(report['num_tensors'], 'tensor')}{matching}"
    if by_dtype:
        parts = sorted(by_dtype.items(), key=lambda item: -item[1])
        text += " (" + ", ".join(f"{d} {human_bytes(n)}" for d, n in parts) + ")"
    if tied:  # one weight under two names (a tied head), its bytes counted once
        first = tied[0]
        text += (
            f"; {len(tied)} tied ({printable('.'.join(map(str, first['key'])))} = "
            f"{printable('.'.join(map(str, first['tied_to'])))}{', …' if len(tied) > 1 else ''})"
        )
    if devices - {"cpu"}:
        text += ", saved on " + ", ".join(sorted(map(printable, devices)))
    lines.append(label("size", text))

    values = report["values"]
    shown = summary_values(values, options)
    if shown:
        lines.append(label("values", _values_text(values, shown)))
    elif values:
        lines.append(label("values", f"{len(values)} (below)"))
    metadata = report.get("metadata") or {}
    if metadata:
        items = list(metadata.items())[:MAX_SUMMARY_METADATA]
        text = ", ".join(f"{printable(k)}={short_value(v, 40)}" for k, v in items)
        if len(metadata) > len(items):
            text += f" (+{len(metadata) - len(items)} below)"
        lines.append(label("metadata", text))
    lines.append(security_line(report, paint))
    return lines


def _format_text(fmt: str, world: str, files: list[str]) -> str:
    """The format id, and where the checkpoint's parts are in others (a run folder's
    ``optimizer.pt`` beside ``model.safetensors``), which: the label is the model's."""
    from ..formats import other_file_formats

    others = other_file_formats(fmt, files)
    if not others:
        return f"{fmt}{world}"
    text = f"{fmt}{world} (the model)"
    for other, names in others:
        text += f"; {other}: " + ", ".join(map(printable, names))
    return cut(text, MAX_WIDTH - len("format: "))


def _file_lines(files: list[str], shown: list[str], more: str, label: Callable) -> list[str]:
    """``file: PATH`` or ``files: A, B``; where that passes MAX_WIDTH, each path whole on
    a line of its own."""
    name = "files" if len(files) > 1 else "file"
    line = label(name, ", ".join(map(printable, shown))) + more
    if len(name) + 2 + len(", ".join(map(printable, shown))) + len(more) <= MAX_WIDTH:
        return [line]
    head = label(name, f"{len(files)}{more}") if len(files) > 1 else label(name, "")
    return [head.rstrip(), *(f"  {printable(f)}" for f in shown)]


VALUES_ROOM = MAX_WIDTH - len("values: ")


def _fitting(values: list[dict], shown: list[tuple[str, str, Row]]) -> int:
    """How many of ``shown`` the summary's ``values:`` line holds within MAX_WIDTH."""
    parts: list[str] = []
    counted = 0
    for name, value, row in shown:
        rest = len(values) - counted - row.count
        tail = f" (+{rest} below)" if rest else ""
        if parts and len(", ".join([*parts, f"{name}={value}"])) + len(tail) > VALUES_ROOM:
            break
        parts.append(f"{name}={value}")
        counted += row.count
    return len(parts)


def summary_shown(values: list[dict], options: Options) -> list[tuple[str, str, Row]]:
    """The key values the summary line shows (all of them with --full)."""
    shown = summary_values(values, options)
    return shown if options.full else shown[: _fitting(values, shown)]


def _values_text(values: list[dict], shown: list[tuple[str, str, Row]]) -> str:
    """``name=value, ...`` of the summary, as many as fit MAX_WIDTH, ``(+N below)``."""
    shown = shown[: _fitting(values, shown)]
    text = ", ".join(f"{name}={value}" for name, value, _ in shown)
    rest = len(values) - sum(row.count for _, _, row in shown)
    text += f" (+{rest} below)" if rest else ""
    return text if len(text) <= VALUES_ROOM else cut(text, VALUES_ROOM)


def summary_values(values: list[dict], options: Options) -> list[tuple[str, str, Row]]:
    """The values a run is known by (epoch, step, lr...), collapsed; rows' members are
    indexes into ``values``."""
    indexes = [i for i, v in enumerate(values) if _is_key_value(v)]
    rows = _value_rows([values[i] for i in indexes])
    shown = rows if options.full else rows[:MAX_SUMMARY_VALUES]
    out = []
    for name, text, row in shown:
        value = values[indexes[row.members[0]]]["value"]
        if isinstance(value, float):  # the summary is for reading: 0.00298159 (--json: exact)
            text = f"{value:.6g}"
        out.append((name, text, Row(row.name, [indexes[m] for m in row.members])))
    return out


def _is_key_value(value: dict) -> bool:
    last = value["key"][-1]
    return isinstance(last, str) and bool(KEY_VALUES.match(last.lower()))


def security_line(report: dict, paint: Paint) -> str:
    """The verdict: the only line that starts with ``security:``."""
    unverified = report.get("unverified") or []
    if report["dangerous"]:
        names = printable(", ".join(report["dangerous"]))
        return (
            paint("security:", "bold")
            + " "
            + paint(f"dangerous globals kept inert (--unsafe): {names}", "red")
        )
    if not report["globals"] and report["format"] in ("safetensors", "safetensors-sharded"):
        return paint("security:", "bold") + " " + paint("safetensors, no code involved", "green")
    opaque = sorted({v["value"] for v in report["values"] if v["type"] == "opaque"})
    extra = f"; shown as placeholders: {printable(', '.join(opaque))}" if opaque else ""
    if unverified:
        extra += f"; unverified (read inert): {printable(', '.join(unverified))}"
    if report.get("allowed"):
        extra += f"; allowed by --allow (read inert): {printable(', '.join(report['allowed']))}"
    verdict = (
        f"read without running code; {plural(len(report['globals']), 'global')}, "
        f"none dangerous{extra}"
    )
    return paint("security:", "bold") + " " + paint(verdict, "yellow" if unverified else "green")


# ----------------------------------------------------------------------------- tensors


def tensor_lines(report: dict, options: Options, paint: Paint) -> list[str]:
    tensors = report["tensors"]
    if not tensors:
        return []
    names = [printable(".".join(map(str, t["key"]))) for t in tensors]
    stats = any("stats" in t for t in tensors)
    devices = any(t["device"] != "cpu" for t in tensors)  # formats without devices say cpu
    sharded = any(t["sharded"] for t in tensors)
    files = options.full and len(report["files"]) > 1

    def signature(t: dict) -> tuple:
        return (t["dtype"], t.get("layout"), tuple(t["shape"]), t["device"], t.get("shards"))

    if options.full or stats:  # stats differ tensor by tensor: nothing to collapse
        rows = [Row(name, [i]) for i, name in enumerate(names)]
    else:
        rows = collapse((name, signature(t)) for name, t in zip(names, tensors, strict=True))
    rows = _sorted_rows(rows, tensors, options.sort)
    limit = DEFAULT_ROWS if options.limit is None else options.limit
    shown = rows[:limit] if limit else rows

    header = ["name", "dtype", "shape"]
    header += ["device"] if devices else []
    header += ["shards"] if sharded else []
    header += ["size", "count"]
    header += list(STATS_COLUMNS) if stats else []
    header += ["file"] if files else []
    table = [header]
    for row in shown:
        t = tensors[row.members[0]]
        dtype = short_dtype(t["dtype"]) + (f" {t['layout']}" if "layout" in t else "")
        cells = [row.name, dtype, str(t["shape"])]
        cells += [printable(t["device"])] if devices else []
        cells += [str(t.get("shards", ""))] if sharded else []
        cells += [human_bytes(t["nbytes"]), f"×{row.count}" if row.count > 1 else ""]
        if stats:
            s = t["stats"]
            cells += [_fmt(s["min"]), _fmt(s["max"]), _fmt(s["mean"]), _fmt(s["std"])]
            cells.append(f"{s['nan']}/{s['inf']}")
        cells += [printable(t.get("file") or "(several)")] if files else []
        table.append(cells)
    right = {header.index("size")} | ({header.index("shards")} if sharded else set())
    right |= {header.index(c) for c in STATS_COLUMNS} if stats else set()
    count = header.index("count")
    if not any(table_row[count] for table_row in table[1:]):
        for table_row in table:  # no repeated rows: no count column
            del table_row[count]
        right = {i - (i > count) for i in right}
    # --full: no limits anywhere, each row whole on its line (for grep)
    text = (
        columns(table, right=right)
        if options.full
        else fit_columns(table, right=right, width=options.width)
    )

    collapsed = (
        f" in {plural(len(rows), 'row')}, repeated layers collapsed"
        if len(rows) < len(tensors)
        else ""
    )
    title = f"tensors: {len(tensors):,}{collapsed}"
    if collapsed:
        title += " (--full lists each)"
    out = ["", paint(title, "bold"), paint(text[0], "dim"), *text[1:]]
    if len(shown) < len(rows):
        out.append(f"  … {plural(len(rows) - len(shown), 'more row')} (--limit 0 or --full)")
    return out


def _sorted_rows(rows: list[Row], tensors: list[dict], sort: str | None) -> list[Row]:
    if sort == "name":
        return sorted(rows, key=lambda row: row.name)
    if sort == "size":  # the biggest rows first: all the members together
        return sorted(
            rows, key=lambda row: (-tensors[row.members[0]]["nbytes"] * row.count, row.name)
        )
    if sort == "dtype":
        return sorted(rows, key=lambda row: (tensors[row.members[0]]["dtype"], row.name))
    return rows


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


# ----------------------------------------------------------------------- tree, values


def tree_lines(ckpt: Any, report: dict, options: Options, paint: Paint) -> list[str]:
    """The structure, unless the whole checkpoint is the model state dict."""
    from ..tree import children

    model_key = tuple(report["model_key"]) if report["model_key"] is not None else None
    if model_key == () or not list(children(ckpt.root)):
        return []
    pattern = re.compile(options.filter) if options.filter else None
    lines = structure_lines(ckpt.root, model_key, "model state dict", pattern, options.full)
    return ["", paint("structure:", "bold"), *lines] if lines else []


def _value_rows(values: list[dict]) -> list[tuple[str, str, Row]]:
    """Values collapsed where numbered blocks hold the same value: (name, value, row)."""
    texts = [short_value(v["value"]) if v["type"] != "opaque" else printable(v["value"])
             for v in values]  # fmt: skip
    names = [printable(".".join(map(str, v["key"]))) for v in values]
    rows = collapse(zip(names, texts, strict=True))
    return [(row.name, texts[row.members[0]], row) for row in rows]


def value_lines(report: dict, options: Options, paint: Paint, used: int = 0) -> list[str]:
    """The values the summary did not show (all of them with --full); without --limit, as
    many rows as the ``used`` lines above leave of one screen (at least VALUE_ROWS_MIN)."""
    values = report["values"]
    in_summary = set()
    if not options.full:
        in_summary = {i for _, _, row in summary_shown(values, options) for i in row.members}
    rest = [v for i, v in enumerate(values) if i not in in_summary]
    if not rest:
        return []
    rows = _value_rows(rest) if not options.full else [
        (printable(".".join(map(str, v["key"]))), short_value(v["value"]), Row("", [i]))
        for i, v in enumerate(rest)
    ]  # fmt: skip
    limit = options.limit
    if limit is None:
        limit = max(VALUE_ROWS_MIN, SCREEN_LINES - used - 3)  # (blank, title, "… more")
    shown = rows[:limit] if limit else rows
    table = [[name, rest[row.members[0]]["type"], text] for name, text, row in shown]
    title = f"values: {len(rest):,}" + (
        " more (the others are in the summary)" if in_summary else ""
    )
    out = [
        "",
        paint(title, "bold"),
        *(
            columns(table)
            if options.full
            else fit_columns(table, shrink=2, header=False, width=options.width)
        ),
    ]
    if len(shown) < len(rows):
        out.append(f"  … {plural(len(rows) - len(shown), 'more row')} (--limit 0 or --full)")
    return out


def metadata_lines(report: dict, options: Options, paint: Paint) -> list[str]:
    metadata = report.get("metadata") or {}
    if len(metadata) <= MAX_SUMMARY_METADATA and all(
        len(short_value(v)) <= 40 for v in metadata.values()
    ):
        return []  # the summary showed it whole
    items = list(metadata.items())
    rows_limit = DEFAULT_ROWS if options.limit is None else options.limit
    shown = items[:rows_limit] if rows_limit else items
    limit = None if options.full else 200
    table = [
        [printable(k), short_value(v, limit) if limit else printable(repr(v))] for k, v in shown
    ]
    text = (
        columns(table)
        if options.full
        else fit_columns(table, shrink=1, header=False, width=options.width)
    )
    out = ["", paint(f"metadata: {plural(len(items), 'key')}", "bold"), *text]
    if len(shown) < len(items):
        out.append(f"  … {plural(len(items) - len(shown), 'more key')} (--limit 0 or --full)")
    return out
