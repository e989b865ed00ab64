"""The one exception type for problems a user can fix, and the one line for an exception user code raised.

Its message is a single line that names the problem and the fix; the CLI prints it and exits 2.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

__all__ = ["PrecsearchError", "raised_at", "user_code_error"]

_PACKAGE = Path(__file__).resolve().parent


class PrecsearchError(ValueError):
    """A user-fixable problem: bad spec, bad file, bad option. Subclasses ValueError so callers may catch either."""


def raised_at(error: BaseException) -> str:
    """`` at file:line in function`` of the deepest frame of ``error``'s traceback outside torch, the standard
    library and precsearch's own machinery: the line of the user's (or the zoo's) code it came from; "" when
    there is none (an op torch.fx ran for the model)."""
    frames = traceback.extract_tb(error.__traceback__)
    skipped = (sysconfig.get_paths()["stdlib"], str(_PACKAGE))

    def model_code(filename: str) -> bool:
        return (not filename.startswith(("<", *skipped)) and "torch" not in Path(filename).parts) or (
            Path(filename).is_relative_to(_PACKAGE / "models"))

    own = [frame for frame in frames if model_code(frame.filename)]
    return f" at {own[-1].filename}:{own[-1].lineno} in {own[-1].name}" if own else ""


def user_code_error(what: str, error: BaseException) -> PrecsearchError:
    """One line for an exception ``what`` (a model factory, a forward) raised: its type, message and the line it
    came from. Raise it ``from error``: the CLI prints that traceback with -v."""
    text = str(error).strip().splitlines()
    message = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return PrecsearchError(f"{what} raised {message}{raised_at(error)}; fix it there (-v shows the traceback)")
