"""Progress bars that read well in a log file: a tqdm bar on a terminal; off one, a plain line every 30 seconds.

tqdm redraws its bar with carriage returns, which a file keeps as one endless line (``make demo > demo.log`` showed
minutes of encoding as a single line). Off a terminal the same bar writes each update as its own line, at most one
every ``every_s`` seconds, so a log says how far encoding or search got and how fast.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

OFF_TERMINAL_EVERY_S = 30.0


class _LineWriter:
    """A stream for tqdm whose redraws (``"\\r" + status``) become lines, the final empty ones dropped."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True,
                 every_s: float = OFF_TERMINAL_EVERY_S) -> Any:
    """A tqdm bar over ``total`` ``unit``s (disabled when not ``enabled``), lines every ``every_s`` off a terminal."""
    from tqdm.auto import tqdm

    stream = sys.stderr
    on_terminal = bool(getattr(stream, "isatty", lambda: False)())
    if not enabled or on_terminal:
        return tqdm(total=total, unit=unit, desc=desc, disable=not enabled)
    return tqdm(total=total, unit=unit, desc=desc, file=_LineWriter(stream), mininterval=every_s,
                maxinterval=every_s, ascii=True, dynamic_ncols=False, ncols=100)
