"""The one exception type for problems a user can fix, and the one line for an exception user code raised.

Its message is a single line that names the problem and the fix; the CLI prints it and exits 2.
"""

from __future__ import annotations

import contextlib
import signal
import sysconfig
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

__all__ = ["ECHO_LIMIT", "PrecsearchError", "clip", "described", "echo", "find_cause", "first_line", "raised_at",
           "run_user_code", "user_code_error"]

T = TypeVar("T")

_PACKAGE = Path(__file__).resolve().parent
ECHO_LIMIT = 80  # characters of a user's value an error line repeats


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` of a user's for an error line, cut after ``limit`` characters with an ellipsis and its length: a
    value pasted by mistake (an id of 200,000 characters) stays a line one can read."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def echo(value: object, limit: int = ECHO_LIMIT) -> str:
    """``clip`` of ``repr(value)``: a user's value, quoted, as an error line repeats it."""
    return clip(repr(value), limit)


class PrecsearchError(ValueError):
    """A user-fixable problem: bad spec, bad file, bad option. Subclasses ValueError so callers may catch either."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its type's name when it has none: a reason fit for one line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def described(error: BaseException) -> str:
    """``Type: first line of the message`` (just the type when it has none), for errors of code not ours."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def find_cause(error: BaseException | None, matches: Callable[[BaseException], bool]) -> BaseException | None:
    """The first of ``error`` and what caused it (``__cause__``, else ``__context__``) that ``matches``: libraries
    wrap the error that matters (a full disk, a lost connection) in their own, or fail while handling it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if matches(error):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def raised_at(error: BaseException) -> str:
    """`` at file:line in function`` of the deepest frame of ``error``'s traceback outside torch, the standard
    library and precsearch's own machinery: the line of the user's (or the zoo's) code it came from; "" when
    there is none (an op torch.fx ran for the model). A SyntaxError names the line it could not read."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" at {error.filename}:{error.lineno}"
    frames = traceback.extract_tb(error.__traceback__)
    skipped = (sysconfig.get_paths()["stdlib"], str(_PACKAGE))
    zoo = _PACKAGE / "models"  # its models are code a forward runs; its __init__ (build, import) is machinery

    def model_code(filename: str) -> bool:
        return (not filename.startswith(("<", *skipped)) and "torch" not in Path(filename).parts) or (
            Path(filename).parent == zoo and Path(filename).name != "__init__.py")

    own = [frame for frame in frames if model_code(frame.filename)]
    return f" at {own[-1].filename}:{own[-1].lineno} in {own[-1].name}" if own else ""


def user_code_error(what: str, error: BaseException) -> PrecsearchError:
    """One line for an exception ``what`` (a model factory, a forward) raised: its type, message and the line it
    came from. Raise it ``from error``: the CLI prints that traceback with -v."""
    return PrecsearchError(f"{what} raised {described(error)}{raised_at(error)}; fix it there (-v shows the traceback)")


def run_user_code(what: str, call: Callable[[], T]) -> T:
    """``call()``, which runs user code (``what``: a model factory, its module's import): anything it raises, even
    SystemExit and KeyboardInterrupt, is ``user_code_error``'s one line, so a factory that exits or raises a
    BaseException cannot end the command as if it had finished or been stopped. Our own one-line errors pass
    through, and so does the interrupt of a SIGINT or SIGTERM that arrived meanwhile: the user stopped it."""
    with _stops_seen() as stops:
        try:
            return call()
        except PrecsearchError:
            raise
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt) and stops:
                raise
            raise user_code_error(what, error) from error


@contextlib.contextmanager
def _stops_seen() -> Iterator[list[int]]:
    """The SIGINT and SIGTERM signals that arrive during the block, recorded before their handlers run (those
    stay in charge). Signals reach the main thread only; elsewhere the list stays empty."""
    seen: list[int] = []
    previous: dict[int, Callable[..., object]] = {}

    def record(signum: int, frame: object) -> object:
        seen.append(signum)
        return previous[signum](signum, frame)

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if callable(handler):  # SIG_DFL and SIG_IGN are left as they are: no Python code runs for them
                previous[signum] = handler
                signal.signal(signum, record)
    try:
        yield seen
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
