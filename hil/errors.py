"""The user-facing error types, and how a command turns them into one line.

:class:`UserError` is every error a user can fix from what they gave (a file, a line, an option, a key, a model
folder): every command line prints it as one line, ``error: <message>``, and exits with status 2. Raise it (or a
subclass) where the value enters -- argument parsing, loaders, model loading -- with a message that names the
thing to fix.

Every loader in ``hil.data`` reports malformed input as a :class:`DataFormatError` that names the file, the
1-based line (when the problem sits on one line) and what is wrong, so a user can open the file and fix it; a file,
folder or dataset that is not there is a :class:`MissingInputError`. Both subclass ``ValueError`` (and the second
``FileNotFoundError``) so callers that already catch those keep working.

:func:`user_error` and :func:`one_line` are what the commands (``train.py``, ``evaluate.py``, the BEIR and paper
experiments) share to print such an error; ``HIL_DEBUG=1`` (:data:`DEBUG_ENV`) keeps the traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

DEBUG_ENV = "HIL_DEBUG"  # set to 1 for full tracebacks (and jsonargparse's usage screens)
PACKAGE_DIR = Path(__file__).resolve().parent  # hil/
# A user-facing message when raised by the package's own code (a missing path, a refused value); raised elsewhere
# (torch, a third-party library) it may be a bug, so it keeps its traceback.
OWN_ERRORS = (FileNotFoundError, NotADirectoryError, ValueError)
# Lines of jsonargparse's messages that only repeat that an argument is ``X | None``.
_UNION_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
                "- Expected a <class 'NoneType'>", "Given value type:", "Given value:")


class UserError(ValueError):
    """A mistake in what the user gave; ``str(err)`` names the file, line, option or key and what is wrong."""


class MissingInputError(UserError, FileNotFoundError):
    """A file, folder, dataset or model the user named is not there; ``str(err)`` names it and where it was
    looked for."""


def check_output_path(path: str | os.PathLike, option: str, *, folder: bool) -> None:
    """Refuse, before any work, an output that cannot be written where the user pointed it: a file where a folder
    is written (``folder=True``) or a folder where a file is, a parent path that is a file, or a folder where
    nothing can be created (read-only, immutable, not permitted). Nothing exists yet, so nothing is renamed or left
    half-written."""
    target = Path(path).expanduser()
    if target.exists() and target.is_dir() != folder:
        what, wanted = ("a file", "a folder") if folder else ("a folder", "a file")
        raise UserError(f"{option} {path}: {what} is there; {wanted} is written at this path (give another path or "
                        "remove it)")
    nearest = None
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{option} {path}: {parent} is a file, not a folder")
            nearest = parent
            break
    # Probed by writing, not by os.access: root passes every permission bit, yet not a read-only mount or an
    # immutable folder (chattr +i). The parent takes the temporary copy an atomic write renames into place; an
    # existing folder takes the files written inside it.
    for folder_written in {nearest, target if target.is_dir() else None} - {None}:
        reason = _not_writable(folder_written)
        if reason:
            raise UserError(f"{option} {path}: {folder_written} is not writable ({reason}); give another path")


def _not_writable(folder: Path) -> str | None:
    """Why nothing can be created in ``folder`` (the OS's words), or None when a probe file could be."""
    import tempfile
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".hil-write-probe-")
    except OSError as error:
        return error.strerror or type(error).__name__
    os.close(handle)
    os.unlink(probe)
    return None


class DataFormatError(UserError):
    """Bad input data: ``str(err)`` is ``"path:line: reason"``, or ``"path: reason"`` when no line applies."""

    def __init__(self, path: str | os.PathLike, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        location = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{location}: {reason}")

    def __reduce__(self):  # keep the three fields when pickled (e.g. across DataLoader workers)
        return (type(self), (self.path, self.line, self.reason))


def one_line(message: object) -> str:
    """A (possibly nested, multi-line) error message on one line, without jsonargparse's Union boilerplate."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return " ".join(line.removeprefix("- ") for line in lines if not line.startswith(_UNION_NOISE))


def raised_in_package(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is in this package's code."""
    frame = error.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return PACKAGE_DIR in Path(frame.tb_frame.f_code.co_filename).resolve().parents


def user_error(error: BaseException, also: tuple[type[BaseException], ...] = ()) -> BaseException | None:
    """The user-facing error behind ``error`` -- a :class:`UserError` or one of ``also`` anywhere, an
    :data:`OWN_ERRORS` raised in the package -- following ``__cause__``/``__context__`` (jsonargparse wraps the
    exceptions of the classes it instantiates in its own ValueError); None when it looks like a bug."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (UserError, *also)):
            return current
        if isinstance(current, OWN_ERRORS) and raised_in_package(current):
            return current
        current = current.__cause__ or current.__context__
    return None


def exit_status(prog: str, run: Callable[[], int], also: tuple[type[BaseException], ...] = ()) -> int:
    """``run()``'s exit status; a user error (:func:`user_error`) becomes one line on stderr, ``<prog>: error:
    <message>``, and status 2; Ctrl-C one line and status 130 (``HIL_DEBUG=1`` raises either with its traceback).
    Anything else (a bug) propagates."""
    try:
        return run()
    except KeyboardInterrupt:  # Ctrl-C: what was written is whole (atomic writes); say so in one line
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"{prog}: interrupted (files are written whole or not at all; a rerun resumes)", file=sys.stderr)
        return 130
    except Exception as error:
        shown = None if os.environ.get(DEBUG_ENV) else user_error(error, also)
        if shown is None:
            raise
        print(f"{prog}: error: {' '.join(one_line(shown).split())}", file=sys.stderr)
        return 2
