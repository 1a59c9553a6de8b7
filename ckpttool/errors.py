"""Typed errors. The core raises these; the CLI maps them to exit codes in one place."""

from __future__ import annotations

import errno
import functools
import os
import re
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


# a URL's user:password@ and its ?query (pre-signed signatures, tokens): never shown
URL_SECRETS = re.compile(
    r"\b([A-Za-z][A-Za-z0-9+.-]+://)([^/\s@]*@)?([^\s?#]*)(\?[^\s#]*?)?(#\S*?)?(?=[:,;)]?(?:\s|$))"
)


class CkptError(Exception):
    """Base error: bad arguments or missing, corrupt, truncated or unsupported input (exit 2).

    Args:
        message: One line saying what is wrong.
        path: The file or key it concerns, shown before the message.
        hint: The next step for the user, shown after the message.
    """

    exit_code = 2

    def __init__(self, message: str, *, path: object = None, hint: str | None = None):
        self.message = message
        self.path = None if path is None else str(path)
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.hint:
            text += f" ({self.hint})"
        return URL_SECRETS.sub(r"\1\3", " ".join(text.split()))


class InputNotFoundError(CkptError, FileNotFoundError):
    """The input does not exist (exit 2); also a ``FileNotFoundError``, as ``torch.load``
    and ``safetensors`` raise, so ``except OSError`` code catches it."""

    def __init__(self, message: str, *, path: object = None, hint: str | None = None):
        super().__init__(message, path=path, hint=hint)
        self.errno = errno.ENOENT
        self.strerror = message
        self.filename = self.path

    def __str__(self) -> str:
        return self.one_line()


class TruncatedPickleError(CkptError):
    """A pickle whose every opcode parsed up to where its data ends (exit 2): what
    follows, where there is more than was read, has not been judged."""


class UsageError(CkptError):
    """The arguments do not make sense together (exit 2)."""


class OutputExistsError(CkptError):
    """The output exists and --force was not given (exit 2)."""


class SeparateCheckpointsError(CkptError):
    """Several inputs that are checkpoints of their own, not the rank files of one (exit 2).

    Attributes:
        files: The inputs (globs expanded), each a checkpoint by itself: ``inspect``
            reports each in turn, the commands that read one checkpoint refuse them.
    """

    def __init__(self, message: str, *, files: list[str], hint: str | None = None):
        super().__init__(message, hint=hint)
        self.files = list(files)


class SeveralCheckpointsError(CkptError):
    """A folder holds several checkpoints and no rule says which one is meant (exit 2).

    Args:
        candidates: Their names as shown (``ep3/``, ``ep0-rank*.pt``), newest last.
    """

    def __init__(
        self,
        message: str,
        *,
        path: object = None,
        hint: str | None = None,
        candidates: list[str] | None = None,
    ):
        super().__init__(message, path=path, hint=hint)
        self.candidates = list(candidates or [])


class UnsafeError(CkptError):
    """A pickle would run code, or construct what ckpttool cannot vouch for; nothing
    was executed (exit 3).

    Args:
        dangerous: The offending globals, as ``module.name``.
        path: The file that holds them.
        reasons: How the pickle uses each of them (``called``, ``BUILD-set on x.Y``...).
        globals: Every global the refused file names, as far as it was read.
        unverified: Those on none of ckpttool's allow-lists.
        allowable: Those of ``dangerous`` refused only because ckpttool cannot vouch for
            them (a class the pickle constructs or calls, on no list): ``--allow`` reads
            them. Where every one is, the message names the ``--allow`` that reads the file.
    """

    exit_code = 3

    def __init__(
        self,
        dangerous: list[str],
        *,
        path: object = None,
        reasons: dict[str, str] | None = None,
        globals: list[str] | None = None,
        unverified: list[str] | None = None,
        allowable: list[str] | None = None,
    ):
        self.dangerous = sorted(set(dangerous))
        self.reasons = {name: (reasons or {}).get(name, "referenced") for name in self.dangerous}
        self.globals = sorted(set(globals or ()) | set(self.dangerous))
        self.unverified = sorted(set(unverified or ()) - set(self.dangerous))
        self.allowable = sorted(set(allowable or ()) & set(self.dangerous))
        self.format: str | None = None  # the detected format, where the reader knew it
        if self.dangerous and self.allowable == self.dangerous:
            shown = self.dangerous[:4]
            flags = " ".join(f"--allow {name}" for name in shown)
            message = (
                "the pickle constructs or calls globals ckpttool cannot vouch for: "
                + ", ".join(f"{name} ({self.reasons[name].split(' (')[0]})" for name in shown)
                + ("..." if len(self.dangerous) > len(shown) else "")
                + "; nothing was executed"
            )
            hint = f"if you trust them, pass {flags}; only if you trust this file, --unsafe"
        else:
            message = (
                "the pickle references dangerous globals "
                + ", ".join(self.dangerous)
                + "; nothing was executed"
            )
            hint = "only if you trust this file, pass --unsafe"
        super().__init__(message, path=path, hint=hint)


def error_data(exc: CkptError) -> dict:
    """``exc`` as plain data, for another process of the same command to raise
    (:func:`error_from_data`): its kind, its line, a refusal's verdict."""
    data: dict[str, Any] = {"kind": type(exc).__name__, "message": exc.message, "path": exc.path}
    data["hint"], data["exit_code"] = exc.hint, exc.exit_code
    if isinstance(exc, UnsafeError):
        data.update(reasons=exc.reasons, globals=exc.globals, unverified=exc.unverified)
        data["allowable"] = exc.allowable
        data["format"] = exc.format
    return data


def error_from_data(data: dict) -> CkptError:
    """The error :func:`error_data` describes: a refusal with its verdict, a missing
    input, or any other as a :class:`CkptError` of the same line and exit code."""
    exc: CkptError
    if data["kind"] == "UnsafeError":
        exc = UnsafeError(
            list(data["reasons"]), path=data["path"], reasons=data["reasons"],
            globals=data["globals"], unverified=data["unverified"],
            allowable=data.get("allowable"),
        )  # fmt: skip
        exc.format = data["format"]
        return exc
    kind = InputNotFoundError if data["kind"] == "InputNotFoundError" else CkptError
    exc = kind(data["message"], path=data["path"], hint=data["hint"])
    exc.exit_code = data["exit_code"]
    return exc


# What reading a hostile or damaged file can raise below ckpttool's own checks: the C
# unpickler, struct, zlib, torch's view and storage code. Each becomes one CkptError line.
_INPUT_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    ArithmeticError,
    RuntimeError,
    EOFError,
    LookupError,
)


class InternalError(CkptError):
    """An error of ckpttool's own, not of the input (exit 2): says so, names ``--debug``,
    and never calls the input corrupt."""

    def __init__(self, exc: BaseException):
        text = " ".join(str(exc).split())[:200]
        super().__init__(
            f"internal error ({type(exc).__name__}: {text}); the input is not to blame",
            hint="rerun with --debug for the traceback, and report it",
        )


# Exceptions that, raised in ckpttool's own code, are a mistake of that code: a name or an
# attribute it expected (the input's own values are checked before they are used so),
# an assertion, an import. Raised in a library below (struct, zlib, the C unpickler,
# torch), or any other kind, they are what a damaged or hostile input provokes.
_BUG_ERRORS = (AttributeError, NameError, AssertionError, ImportError)
_PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


def is_internal(exc: BaseException) -> bool:
    """Whether ``exc`` is a mistake of ckpttool's own (see :data:`_BUG_ERRORS`): raised
    by a frame of the package itself, not by a library below it."""
    if not isinstance(exc, _BUG_ERRORS):
        return False
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_code.co_filename.startswith(_PACKAGE)


def translate_errors(function: Callable[P, R]) -> Callable[P, R]:
    """Raise only :class:`CkptError` (and its subclasses) from ``function`` on bad input.

    The public entry points (read, load, convert, merge, diff, inspect) wear this, so no
    file can make them raise anything a caller would have to know ckpttool's insides for.
    """

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        except CkptError:
            raise
        except MemoryError:
            raise CkptError("corrupt input: sizes past what memory holds") from None
        except RecursionError:
            raise CkptError("corrupt input: it nests too deeply") from None
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise CkptError(f"I/O error ({reason})", path=exc.filename) from None
        except _INPUT_ERRORS as exc:
            if is_internal(exc):
                raise InternalError(exc) from exc
            text = " ".join(str(exc).split())[:200]
            reason = f"{type(exc).__name__}: {text}"
            raise CkptError(f"corrupt or unsupported input ({reason})") from None

    return wrapper
