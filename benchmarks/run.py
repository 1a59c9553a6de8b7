"""Benchmark ckpttool against its baselines, all measured in the same run.

    python benchmarks/run.py                      # everything, full scale (~12 GiB of inputs)
    python benchmarks/run.py --scale 0.05 --only inspect,help
    python benchmarks/run.py --markdown           # README-ready table

Inputs are generated once into ``--workdir`` (reused later); every command runs as a
fresh subprocess, warm (untimed warm-up, then the median of ``--repeat`` runs).
Exit status: 0 all targets met, 1 a target missed or a command failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import cases
import data
from measure import CommandFailed, Measurement, child_env, measure, rss_source

REPO = Path(__file__).resolve().parent.parent
COLUMNS = ("case", "ckpttool", "baseline", "ratio", "peak RSS", "target", "ok")
SPACE_MARGIN = 1 << 30


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time ckpttool and its baselines; print absolute times, peak RSS, ratios.",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=REPO / "bench-data",
        help="where inputs are generated and outputs written (default: bench-data/)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="input sizes relative to the issues' (1 GB, 4 GB, 2 GB); 0.05 for a quick run",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help=f"comma-separated groups to run: {','.join(cases.GROUPS)} (default: all)",
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per command")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before those")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="run the commands in rounds (each once per round) instead of one after the "
        "other: load from other processes then drifts over both sides of a ratio alike",
    )
    parser.add_argument("--json", type=Path, help="also write every raw sample to this file")
    parser.add_argument(
        "--generate-only", action="store_true", help="generate the inputs, measure nothing"
    )
    args = parser.parse_args(argv)
    groups = [g.strip() for item in args.only for g in item.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(cases.GROUPS))
    if unknown:
        parser.error(f"unknown --only {unknown}; choose from {', '.join(cases.GROUPS)}")
    args.groups = groups or list(cases.DEFAULT_GROUPS)
    if args.scale <= 0 or args.repeat < 1 or args.warmup < 0:
        parser.error("--scale must be > 0, --repeat >= 1, --warmup >= 0")
    return args


def check_space(folder: Path, needed: list[data.Input], scale: float) -> None:
    """Fail early, with a scale that would fit, instead of filling the disk."""
    missing = [i for i in needed if not data.is_ready(folder, i)]
    largest_output = int(4 * data.GiB * scale * 1.05)
    need = sum(data.disk_bytes(i) for i in missing) + largest_output + SPACE_MARGIN
    probe = folder if folder.exists() else next(p for p in folder.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if need > free:
        fit = scale * (free - SPACE_MARGIN) / (need - SPACE_MARGIN)
        sys.exit(
            f"run.py: needs {need / data.GiB:.1f} GiB free in {probe}, has "
            f"{free / data.GiB:.1f} GiB; try --scale {max(fit, 0.01):.2f}"
        )


def fmt_time(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def fmt_ratio(ratio: float) -> str:
    return f"{ratio:.3f} (1/{1 / ratio:.1f})" if ratio < 1 else f"{ratio:.2f}"


def evaluate(row: cases.Row, tool: Measurement | None, base: Measurement | None) -> list[str]:
    """One table line: the cells of ``COLUMNS``."""
    targets = []
    if row.max_wall is not None:
        targets.append(f"≤{row.max_wall:g} s")
    if row.max_ratio is not None:
        targets.append(f"ratio ≤{row.ratio_text}")
    if row.max_rss is not None:
        targets.append(f"RSS ≤{row.max_rss:.0f} MiB")
    if row.max_rss_ratio is not None:
        targets.append(f"RSS ratio ≤{row.max_rss_ratio:g}")
    if row.max_rss_extra is not None:
        targets.append(f"RSS ≤ base +{row.max_rss_extra:.0f} MiB")
    target = ", ".join(targets) or "(info)"
    if tool is None or base is None:
        return [row.case, fmt_time(tool.wall) if tool else "error",
                fmt_time(base.wall) if base else "error", "-", "-", target, "ERROR"]  # fmt: skip
    ratio = tool.wall / base.wall
    missed = []
    if row.max_wall is not None and tool.wall > row.max_wall:
        missed.append("time")
    if row.max_ratio is not None and ratio > row.max_ratio:
        missed.append("ratio")
    if row.max_rss is not None and tool.rss_mib > row.max_rss:
        missed.append("RSS")
    if row.max_rss_ratio is not None and tool.rss_mib > row.max_rss_ratio * base.rss_mib:
        missed.append("RSS ratio")
    if row.max_rss_extra is not None and tool.rss_mib > base.rss_mib + row.max_rss_extra:
        missed.append("RSS")
    ok = "—" if row.informative else ("NO: " + ", ".join(missed) if missed else "yes")
    rss = f"{tool.rss_mib:.0f} / {base.rss_mib:.0f} MiB"
    return [row.case, fmt_time(tool.wall), fmt_time(base.wall), fmt_ratio(ratio), rss, target, ok]


def render(lines: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        out += ["| " + " | ".join(c.strip().replace("|", "\\|") for c in line) + " |"
                for line in lines]  # fmt: skip
        return "\n".join(out)
    widths = [max(len(r[i]) for r in [list(COLUMNS), *lines]) for i in range(len(COLUMNS))]
    rule = "  ".join("-" * w for w in widths)
    out = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)), rule]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def machine() -> str:
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / data.GiB
    except (OSError, ValueError):
        mem = float("nan")
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}, "
        f"torch {version('torch')}"
    )


def measure_in_rounds(keys: list[str], commands: dict, args, env) -> tuple[dict, list[str]]:
    """Every command once per round, ``warmup + repeat`` rounds; a failed command drops out."""
    results: dict[str, Measurement | None] = {k: Measurement(commands[k].cmd) for k in keys}
    failures: list[str] = []
    for round_no in range(args.warmup + args.repeat):
        log(f"round {round_no + 1} of {args.warmup + args.repeat}")
        for key in keys:
            if results[key] is None:
                continue
            command = commands[key]
            try:
                once = measure(
                    command.cmd,
                    outputs=command.outputs,
                    expect_rc=command.expect_rc,
                    check_stdout=command.check_stdout,
                    warmup=0,
                    repeat=1,
                    env=env,
                )
            except CommandFailed as exc:
                results[key] = None
                failures.append(f"{key}: {exc}")
                log(f"  {key} FAILED: {exc}")
                continue
            if round_no >= args.warmup:
                results[key].walls += once.walls
                results[key].rss_kib += once.rss_kib
    for key, m in results.items():
        if m is not None:
            log(f"{key}: {fmt_time(m.wall)} (runs {', '.join(f'{w:.3f}' for w in m.walls)}), "
                f"peak RSS {m.rss_mib:.0f} MiB")  # fmt: skip
    return results, failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = args.workdir.resolve() / f"scale-{args.scale:g}"
    out = folder / "out"
    inputs = data.plan(folder, args.scale)
    rows = [r for r in cases.rows(inputs) if r.group in args.groups]
    commands = cases.commands(inputs, out)
    keys = list(dict.fromkeys(k for r in rows for k in (r.tool, r.base)))
    needed = [inputs[n] for n in dict.fromkeys(n for k in keys for n in commands[k].needs)]

    check_space(folder, needed, args.scale)
    started = time.perf_counter()
    for inp in needed:
        data.ensure(folder, inp, log=log)
    if args.generate_only:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]

    env = child_env(args.workdir.resolve() / "pycache")
    results: dict[str, Measurement | None] = {}
    failures: list[str] = []
    if args.interleave:
        results, failures = measure_in_rounds(keys, commands, args, env)
    for key in keys if not args.interleave else ():
        command = commands[key]
        log(f"measuring {key}: {' '.join(command.cmd)}")
        try:
            results[key] = m = measure(
                command.cmd,
                outputs=command.outputs,
                expect_rc=command.expect_rc,
                check_stdout=command.check_stdout,
                warmup=args.warmup,
                repeat=args.repeat,
                env=env,
            )
            log(f"  {fmt_time(m.wall)} (runs {', '.join(f'{w:.3f}' for w in m.walls)}), "
                f"peak RSS {m.rss_mib:.0f} MiB")  # fmt: skip
        except CommandFailed as exc:
            results[key] = None
            failures.append(f"{key}: {exc}")
            log(f"  FAILED: {exc}")

    lines = [evaluate(r, results[r.tool], results[r.base]) for r in rows]
    print(render(lines, args.markdown))
    print()
    print(
        f"ratio = ckpttool wall / baseline wall, median of {args.repeat} warm runs after "
        f"{args.warmup} warm-up{' (interleaved rounds)' if args.interleave else ''}; "
        "peak RSS = ckpttool / baseline (max over runs, "
        f"{rss_source()}); "
        f"scale {args.scale:g}; {machine()}; 1-min load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after; total {time.perf_counter() - started:.0f} s"
    )
    for failure in failures:
        print(f"\nFAILED {failure}")
    if args.json:
        raw = {k: (m.as_dict() if m else None) for k, m in results.items()}
        args.json.write_text(json.dumps({"rows": lines, "measurements": raw}, indent=1))
    missed = any(line[-1].startswith(("NO", "ERROR")) for line in lines)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
