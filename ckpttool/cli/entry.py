"""The typer app, the global options, and the one place errors become exit codes."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any, NoReturn

import typer

from .. import distributed
from ..errors import CkptError, InternalError
from .text import printable

EXIT_OK, EXIT_DIFFERENT, EXIT_BAD_INPUT, EXIT_UNSAFE = 0, 1, 2, 3
EXIT_INTERRUPTED = 130

app = typer.Typer(
    name="ckpttool",
    help="Inspect, convert, merge and diff PyTorch checkpoints (DDP, FSDP, DCP) safely: "
    "no code from a checkpoint runs.",
    epilog="Examples:\n\n\b\n"
    "  ckpttool inspect model.safetensors\n"
    "  ckpttool convert ep3-rank0.pt --to safetensors\n"
    "  ckpttool diff model.pt model-bf16.safetensors --atol 1e-2\n"
    "  ckpttool verify ckpt-dcp/    # every byte read once, CRC-32s checked\n\n"
    "Exit codes: 0 ok, 1 diff found differences, 2 bad input, 3 refused as unsafe. "
    "--debug, --quiet, --no-color and --allow NAME may also follow the command.",
    # plain help: rich markup would import markdown-it on every --help (+0.1 s)
    rich_markup_mode=None,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Settings:
    """The global flags, read by every command. ``main`` sets them wherever they were
    given on the command line (before or after the command's name)."""

    debug = False
    quiet = False
    no_color = False
    allow: tuple[str, ...] = ()  # --allow NAME, repeatable, on every command
    argv: list[str] = []  # the command line as main() got it (``--workers`` reruns it)


settings = Settings()
# Flags that may appear anywhere on the command line; main() takes them out before
# typer parses, so `ckpttool inspect x.pt --debug` and `ckpttool --debug inspect x.pt`
# are the same command.
GLOBAL_FLAGS = {"--debug": "debug", "--quiet": "quiet", "-q": "quiet", "--no-color": "no_color"}
# A global option with a value, anywhere on the command line too: the globals a user trusts.
ALLOW_OPTION = "--allow"
# Options that take a value: a global flag's name right after one of these is that value.
VALUE_OPTIONS = frozenset(
    {
        "--filter",
        "--arch",
        "--config",
        "--tokenizer",
        "--layout",
        "--limit",
        "--sort",
        "--to",
        "-o",
        "--out",
        "--select",
        "--strip-prefix",
        "--select-a",
        "--select-b",
        "--strip-prefix-a",
        "--strip-prefix-b",
        "--dtype",
        "--map-location",
        "--max-shard-size",
        "--atol",
        "--rtol",
        "--workers",
    }
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"ckpttool {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    debug: Annotated[
        bool,
        typer.Option("--debug", help="Show the traceback of an error (the exit code stays)."),
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress bars, no 'wrote' line.")
    ] = False,
    no_color: Annotated[
        bool, typer.Option("--no-color", help="No colours (also when NO_COLOR is set).")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
    allow: Annotated[
        list[str] | None,
        typer.Option(
            ALLOW_OPTION,
            metavar="NAME",
            help="Trust a global (pkg.mod.Class) or a module (pkg.mod.*) as torch's "
            "add_safe_globals does: it may be called, it is still read inert. Repeatable, "
            "on every command; dangerous families cannot be allowed.",
        ),
    ] = None,
) -> None:
    # Also reached through app() directly (tests, embedding): flags given here count too.
    settings.debug |= debug
    settings.quiet |= quiet
    settings.no_color |= no_color
    settings.allow += tuple(allow or ())


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Stop the command: ``main`` prints ``message`` as one stderr line and exits ``code``."""
    raise CommandError(message, code)


class CommandError(Exception):
    """A command's own refusal, already worded for the user."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def pull_global_flags(args: Sequence[str]) -> list[str]:
    """Take the global flags out of ``args`` wherever they are, and set them."""
    out: list[str] = []
    taking_allow = False
    for i, arg in enumerate(args):
        if taking_allow:
            settings.allow += (arg,)
            taking_allow = False
            continue
        if arg == "--":  # everything after it is a path, even "--debug"
            out.extend(args[i:])
            break
        name = GLOBAL_FLAGS.get(arg)
        after_value_option = bool(out) and out[-1] in VALUE_OPTIONS
        if name is not None and not after_value_option:
            setattr(settings, name, True)
        elif arg == ALLOW_OPTION and not after_value_option:
            taking_allow = True
        elif arg.startswith(ALLOW_OPTION + "=") and not after_value_option:
            settings.allow += (arg.partition("=")[2],)
        else:
            out.append(arg)
    if taking_allow:
        settings.allow += ("",)  # refused by name when the command starts
    return out


def allowing_settings() -> contextlib.AbstractContextManager[None]:
    """The globals ``--allow`` trusts, for the command's run (nothing imported without it).

    Raises:
        UsageError: A name that cannot be allowed (a dangerous family).
    """
    if not settings.allow:
        return contextlib.nullcontext()
    from ..unpickler import allowing, parse_allow

    return allowing(parse_allow(settings.allow))


def exit_code_for(exc: BaseException) -> int:
    """The one error boundary: one stderr line for ``exc`` and the contract's exit code.

    With ``--debug`` the traceback comes first; the exit code is the same either way.
    """
    if getattr(exc, "silent", False):  # another torchrun rank printed the error
        return int(getattr(exc, "exit_code", EXIT_BAD_INPUT))
    if isinstance(exc, BrokenPipeError):  # `ckpttool inspect | head`: the reader left
        # Later flushes would fail again: send what is left of stdout to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    if isinstance(exc, (KeyboardInterrupt, typer.Abort)) and distributed.own_launch():
        return EXIT_INTERRUPTED  # a worker of --workers: its launcher says it, once
    if isinstance(exc, (KeyboardInterrupt, typer.Abort)):
        code, message = EXIT_INTERRUPTED, "interrupted; no output was written"
    elif isinstance(exc, CommandError):
        code, message = exc.code, str(exc)
    elif isinstance(exc, CkptError):
        code = exc.exit_code
        message = f"{'refused' if code == EXIT_UNSAFE else 'error'}: {exc.one_line()}"
    elif isinstance(exc, typer.TyperException):  # click's usage errors: exit 2, one line
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "ckpttool"
        code = getattr(exc, "exit_code", EXIT_BAD_INPUT)
        message = f"error: {exc.format_message()} (see: {where} --help)"
    else:  # a bug of ckpttool's own: still one line, still exit 2, the input not blamed
        code = EXIT_BAD_INPUT
        message = f"error: {InternalError(exc).one_line()}"
    if settings.debug:
        import traceback

        traceback.print_exception(exc)
    # the message may quote keys and names from the file: one line, no terminal escapes
    sys.stderr.write(f"ckpttool: {' '.join(printable(message).split())}\n")
    sys.stderr.flush()
    return code


def _interrupt_again(unraisable: Any) -> None:
    """A Ctrl-C that lands in a callback Python cannot raise from (a weakref's, during a
    collection) is printed as "Exception ignored" and lost: deliver it to the command
    again instead, silently, so it stops as from any other place."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        import _thread

        _thread.interrupt_main()
        return
    sys.__unraisablehook__(unraisable)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point: run one command, map whatever it raises to an exit code."""
    sys.unraisablehook = _interrupt_again
    settings.debug = settings.quiet = settings.no_color = False  # main() may run twice
    settings.allow = ()
    settings.argv = list(sys.argv[1:] if argv is None else argv)
    if distributed.launched():  # one of several ranks: the one whose error is posted says it
        distributed.report_errors_with(exit_code_for)
    args = pull_global_flags(settings.argv)
    try:
        if not args:  # bare `ckpttool`: typer shows the help (and exits 2, as click does)
            app(args=[], prog_name="ckpttool")
        with allowing_settings():
            code = app(args=args, prog_name="ckpttool", standalone_mode=False)
        if code == EXIT_INTERRUPTED:  # typer turns Ctrl-C into Exit(130), silently
            code = exit_code_for(KeyboardInterrupt())
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        code = exit_code_for(exc)
    code = code if isinstance(code, int) else EXIT_OK
    if code and distributed.launched():
        # the ranks left together (distributed.collective): torchrun ends the others as
        # soon as one exits, so each exits now, not after an interpreter teardown of its
        # own length, and torchrun finds them all with the contract's code
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
