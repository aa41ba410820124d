"""The user-facing error types.

:class:`UserError` is every error a user can fix from what they gave (a file, a line, an option, a key, a model
folder): both command lines print it as one line, ``error: <message>``, and exit with status 2. Raise it (or a
subclass) where the value enters -- argument parsing, loaders, model loading -- with a message that names the
thing to fix.

Every loader in ``hil.data`` reports malformed input as a :class:`DataFormatError` that names the file, the
1-based line (when the problem sits on one line) and what is wrong, so a user can open the file and fix it.
It subclasses ``ValueError`` so callers that already catch ``ValueError`` keep working.
"""

from __future__ import annotations

import os


class UserError(ValueError):
    """A mistake in what the user gave; ``str(err)`` names the file, line, option or key and what is wrong."""


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
