"""The typer app, the global options, and the one place errors become exit codes."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from ..errors import CkptError

EXIT_OK, EXIT_DIFFERENT, EXIT_BAD_INPUT, EXIT_UNSAFE = 0, 1, 2, 3

app = typer.Typer(
    name="ckpttool",
    help="Inspect, convert, merge and diff PyTorch checkpoints (DDP, FSDP, DCP) safely.",
    add_completion=False,
    # plain help: rich markup would import markdown-it on every --help (+0.1 s)
    rich_markup_mode=None,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
_settings = {"debug": False}


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"ckpttool {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    _settings["debug"] = debug


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Print one line on stderr and exit with ``code``. Plain text: never wrapped."""
    sys.stderr.write(f"ckpttool: {message}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def handle_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the core's typed errors into the contract's exit codes and one stderr line."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except typer.Exit:
            raise
        except CkptError as exc:
            if _settings["debug"]:
                raise
            prefix = "refused" if exc.exit_code == EXIT_UNSAFE else "error"
            fail(f"{prefix}: {exc.one_line()}", exc.exit_code)
        except BrokenPipeError:  # `ckpttool inspect | head`: the reader left, that is fine
            # Later flushes would fail again (and click would exit 1, which means
            # "differences" here): send what is left of stdout to /dev/null.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise typer.Exit(EXIT_OK) from None
        except KeyboardInterrupt:
            fail("interrupted; no output was written", 130)
        except Exception as exc:  # a bug or an input we failed to classify: still one line
            if _settings["debug"]:
                raise
            text = " ".join(str(exc).split())[:300]
            fail(f"error: unexpected {type(exc).__name__}: {text} (rerun with --debug)")

    return wrapper


def main() -> None:
    """Console-script entry point."""
    if not sys.argv[1:]:  # bare `ckpttool`: typer shows the help
        app()
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as exc:
        # Bad arguments (click's usage errors) get one line too, not usage text in a box:
        # the contract says exit 2 and one clear line on stderr.
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "ckpttool"
        text = " ".join(exc.format_message().split())
        sys.stderr.write(f"ckpttool: error: {text} (see: {where} --help)\n")
        sys.exit(getattr(exc, "exit_code", EXIT_BAD_INPUT))
    except typer.Abort:
        sys.stderr.write("ckpttool: interrupted; no output was written\n")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else EXIT_OK)
