"""The command line itself: help, version, exit codes, one-line errors, no torch at startup."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import ROOT, check_error, run_cli, small_state_dict

import ckpttool

COMMANDS = ("inspect", "convert", "merge", "diff", "verify")


def test_help_lists_every_command():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    for command in COMMANDS:
        assert command in proc.stdout
    assert run_cli("-h").stdout == proc.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command):
    proc = run_cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage:" in proc.stdout and command in proc.stdout
    assert "--unsafe" in proc.stdout or command == "diff" and "--atol" in proc.stdout


def test_inspect_help_shows_its_options():
    out = run_cli("inspect", "--help").stdout
    for option in ("--json", "--filter", "--stats", "--unsafe"):
        assert option in out


def test_convert_help_shows_its_options():
    out = run_cli("convert", "--help").stdout
    for option in (
        "--to",
        "--select",
        "--strip-prefix",
        "--dtype",
        "--map-location",
        "--max-shard-size",
        "--force",
        "--unsafe",
    ):
        assert option in out


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"ckpttool {ckpttool.__version__}"


def test_console_script_matches_module(tmp_path):
    """``ckpttool`` (the installed script) and ``python -m ckpttool`` are the same program."""
    script = ROOT / ".venv" / "bin" / "ckpttool"
    if not script.exists():
        pytest.skip("ckpttool console script not installed in .venv")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"ckpttool {ckpttool.__version__}"


def test_importing_the_cli_does_not_import_torch():
    code = "import ckpttool, ckpttool.cli, sys; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_help_does_not_import_torch():
    code = (
        "import sys; sys.argv = ['ckpttool', '--help']\n"
        "from ckpttool.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["bogus"], "bogus"),
        (["inspect"], "PATH..."),
        (["inspect", "--bogus", "x.pt"], "--bogus"),
        (["convert", "x.pt"], "--to"),
        (["diff", "x.pt"], "'B'"),
        (["merge", "x.pt"], "-o"),
    ],
    ids=[
        "unknown-command",
        "missing-path",
        "unknown-option",
        "missing-to",
        "diff-one",
        "merge-no-out",
    ],
)
def test_usage_errors_are_exit_2_with_one_line(args, needle):
    check_error(run_cli(*args), 2, needle)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(small_state_dict(), path)
    return path


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--to", "onnx"], "unknown --to 'onnx'"),
        (["--to", "safetensors", "--dtype", "int8"], "unknown --dtype 'int8'"),
        (["--to", "safetensors", "--max-shard-size", "lots"], "bad size 'lots'"),
        (["--to", "pt", "--max-shard-size", "1GB"], "--max-shard-size"),
        (["--to", "safetensors", "--map-location", "cuda:0"], "--map-location"),
        (["--to", "pt", "--map-location", "gpu"], "bad --map-location 'gpu'"),
        (["--to", "safetensors", "--select", "no.such.key"], "no key"),
    ],
)
def test_bad_convert_arguments_are_exit_2(model_file, tmp_path, args, needle):
    out = tmp_path / "out.x"
    check_error(run_cli("convert", model_file, "-o", out, *args), 2, needle)
    assert not out.exists()


def test_existing_output_is_refused_without_force(model_file, tmp_path):
    out = tmp_path / "exists.safetensors"
    out.write_bytes(b"keep me")
    check_error(run_cli("convert", model_file, "--to", "safetensors", "-o", out), 2, "--force")
    assert out.read_bytes() == b"keep me"


def test_diff_exits_1_on_differences(model_file, tmp_path):
    other = tmp_path / "other.pt"
    sd = small_state_dict()
    sd["fc.bias"] = sd["fc.bias"] + 1
    torch.save(sd, other)
    proc = run_cli("diff", model_file, other)  # exit 0 for equal inputs: tests/test_diff.py
    assert proc.returncode == 1, proc.stderr
    assert "fc.bias" in proc.stdout


def test_exit_code_3_for_unsafe_and_0_with_unsafe(tmp_path):
    import os

    from payloads import Reduce

    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "x": Reduce(os.system, (f"touch {marker}",))}, path)
    check_error(run_cli("inspect", path), 3, "posix.system")
    assert run_cli("inspect", "--unsafe", path).returncode == 0
    assert not marker.exists()


def test_debug_is_accepted():
    assert run_cli("--debug", "--version").returncode == 0


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_reader_leaving_early_is_not_an_error(json_flag):
    """`ckpttool inspect ... | head`: exit 0, no traceback (rich alone would exit 1)."""
    fixture = ROOT / "fixtures" / "ddp" / "ep0-rank0.pt"
    if not fixture.exists():
        pytest.skip("fixture not generated")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpttool", "inspect", str(fixture), *json_flag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.read(20)
    proc.stdout.close()  # the reader leaves, as `head -c 20` does
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in stderr


def test_text_from_the_file_is_shown_literally_never_as_markup(tmp_path):
    """Keys, values and names come from the file: a tokenizer's "[/s]" made rich raise
    (inspect failed halfway, diff exited 2), and "[red]" silently vanished from names."""

    checkpoint = {
        "layer[red]0.weight": torch.ones(1),
        "special_tokens": ["[CLS]", "[/s]"],
        "note": "[bold]important",
    }
    a, b = tmp_path / "a[1].pt", tmp_path / "b.pt"
    torch.save({**checkpoint, "enc.[/x]": torch.ones(2)}, a)
    torch.save(checkpoint, b)
    proc = run_cli("inspect", a, columns=200)
    assert proc.returncode == 0, proc.stderr
    for text in ("layer[red]0.weight", "'[/s]'", "'[bold]important'", "enc.[/x]", "a[1].pt"):
        assert text in proc.stdout, text
    proc = run_cli("diff", a, b, columns=200)
    assert proc.returncode == 1, proc.stderr
    assert "- only in A: enc.[/x]" in proc.stdout
    proc = run_cli("convert", a, "--to", "pt", "-o", tmp_path / "out[/x].pt")
    assert proc.returncode == 0 and "wrote " + str(tmp_path / "out[/x].pt") in proc.stderr


# ------------------------------------------- one error boundary, flags anywhere, help


@pytest.mark.parametrize(
    "args",
    [
        ["--debug", "diff", "missing", "missing2"],
        ["diff", "missing", "missing2", "--debug"],
        ["diff", "--debug", "missing", "missing2"],
    ],
)
def test_debug_keeps_the_exit_code_and_adds_the_traceback(tmp_path, args):
    """--debug anywhere: the traceback, then the same one line, and still exit 2 (it
    was 1, "different", when the error escaped the command before the boundary)."""
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "ckpttool: error: missing: no such file or directory"
    check_error(run_cli("diff", "missing", "missing2", cwd=tmp_path), 2, "missing: no such file")


def test_debug_on_unsafe_input_keeps_exit_3(tmp_path):
    import os

    from payloads import Reduce

    path = tmp_path / "evil.pt"
    torch.save({"x": Reduce(os.system, ("true",))}, path)
    proc = run_cli("inspect", path, "--debug")
    assert proc.returncode == 3 and "Traceback" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("ckpttool: refused: ")


def test_quiet_and_no_color_are_accepted_anywhere(model_file, tmp_path):
    for i, args in enumerate(
        [["--quiet", "convert"], ["convert", "-q"], ["convert", "--no-color", "--quiet"]]
    ):
        out = tmp_path / f"q{i}.safetensors"
        where = args.index("convert")
        argv = [*args[: where + 1], model_file, "--to", "safetensors", "-o", out]
        argv += args[where + 1 :]
        proc = run_cli(*argv)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""  # quiet: no 'wrote' line
        assert out.exists()
    # a flag's name given as an option's value stays that value
    proc = run_cli("inspect", model_file, "--filter", "--quiet")
    assert proc.returncode == 0 and "nothing matches --filter '--quiet'" in proc.stdout


def test_value_options_list_every_option_that_takes_a_value():
    """main() must know which options take a value, not to take that value for a flag."""
    import typer.main

    from ckpttool.cli.entry import VALUE_OPTIONS, app

    group = typer.main.get_command(app)
    found = set()
    for command in group.commands.values():
        for param in command.params:
            if param.param_type_name == "option" and not param.is_flag:
                found |= set(param.opts)
    assert found == VALUE_OPTIONS


def test_help_shows_choices_examples_and_whole_summaries():
    top = run_cli("--help").stdout
    for command, summary in [
        ("convert", "Write the tensors as safetensors, pt, dcp or a Hugging Face model."),
        ("diff", "Compare two checkpoints tensor by tensor."),
        ("inspect", "What a checkpoint holds, without reading tensor data."),
        ("merge", "Merge per-rank shards or DCP into one torch.save file."),
        ("verify", "Check that a checkpoint is whole: every byte read once."),
    ]:
        assert [command, summary] in [line.split(None, 1) for line in top.splitlines()]
    assert "--install-completion" in top and "Examples:" in top
    for command in COMMANDS:
        out = run_cli(command, "--help").stdout
        assert "Examples:" in out and f"    ckpttool {command} " in out
        assert "{paths}" not in out and "<str>" not in out.lower()
    convert_help = run_cli("convert", "--help").stdout
    assert "--to <safetensors|pt|dcp|hf>" in convert_help
    assert "--dtype <float32|float16|bfloat16>" in convert_help
    assert "NAME.safetensors" in convert_help and "NAME-dcp/" in convert_help
    assert "--sort <name|size|dtype>" in run_cli("inspect", "--help").stdout
    assert "docs/inspect-json.md" in run_cli("inspect", "--help").stdout


def test_shell_completion_is_available():
    import os

    # the script --show-completion prints for bash (asked by name: typer's detection of
    # the calling shell finds none where no shell is a parent, as under some CI runners)
    env = dict(os.environ, _CKPTTOOL_COMPLETE="source_bash", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "ckpttool"], capture_output=True, text=True,
                          env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "_CKPTTOOL_COMPLETE" in proc.stdout and "complete_bash" in proc.stdout
    env = dict(os.environ, _CKPTTOOL_COMPLETE="complete_bash", COMP_CWORD="4",
               COMP_WORDS="ckpttool convert x.pt --to s", PYTHONPATH=str(ROOT))  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "ckpttool"], capture_output=True, text=True,
                          env=env)  # fmt: skip
    assert proc.stdout.split() == ["safetensors"]


@pytest.mark.parametrize(
    ("to", "out", "fix"),
    [
        ("pt", "x.safetensors", "use -o {d}/x.pt, or --to safetensors"),
        ("safetensors", "x.pt", "use -o {d}/x.safetensors, or --to pt"),
        ("dcp", "x.pt", "use -o {d}/x-dcp/, or --to pt"),
    ],
)
def test_output_extension_contradicting_to_is_refused(model_file, tmp_path, to, out, fix):
    target = tmp_path / out
    line = check_error(run_cli("convert", model_file, "--to", to, "-o", target), 2)
    assert line.endswith(f"({fix.format(d=tmp_path)})")
    assert not target.exists()
    check_error(run_cli("merge", model_file, "-o", tmp_path / "m.safetensors"), 2, "-o ")


def test_trainer_help_shows_defaults():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "trainers" / "ddp_trainer.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for default in ("(default: 10)", "(default: runs/demo)", "(default: auto)", "(default: ddp)"):
        assert default in text
