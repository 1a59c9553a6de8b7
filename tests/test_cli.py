"""The command line itself: help, version, exit codes, one-line errors, no torch at startup."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, check_error, run_cli, small_state_dict

import ckpttool

COMMANDS = ("inspect", "convert", "merge", "diff")


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
        (["--to", "onnx"], "'onnx' is not one of 'safetensors', 'pt', 'dcp'"),
        (["--to", "safetensors", "--dtype", "int8"], "'int8' is not one of 'float32'"),
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

    from conftest import Reduce

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
