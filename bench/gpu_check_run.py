"""How ``bench/gpu_check.py`` runs a step: a subprocess in a process group of its own, with a wall-clock limit, that
never outlives the check.

- Each step is the leader of a new process group (its DDP ranks and loader workers join it), so stopping a step
  stops all of it: SIGTERM to the group, SIGKILL :data:`GRACE_S` seconds later to whatever is left.
- A step that runs past its limit is stopped that way and raises :class:`StepFailed` with ``timed_out`` set.
- SIGINT and SIGTERM sent to the check (Ctrl-C; ``timeout`` in ``shared/gpu/run.sh``) raise :class:`Interrupted`
  in it (:func:`signals_interrupt`); the running step is stopped before the exception leaves :func:`run_step`.
- Where the check itself dies without a chance to clean up (SIGKILL), Linux's parent-death signal sends the step's
  leader SIGTERM (Lightning forwards it to its DDP ranks), so no orphaned training keeps the GPU busy.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["GRACE_S", "Interrupted", "StepFailed", "last_line", "run_step", "signals_interrupt"]

GRACE_S = 10.0  # between SIGTERM and SIGKILL: time for Lightning to stop its ranks and for files to close
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class StepFailed(Exception):
    """A step that failed or ran past its limit: its name, exit status and log; the message is one line, ending with
    the log's last line (``reason`` instead, where one is given)."""

    def __init__(self, step: str, status: int | None, log: Path, reason: str | None = None,
                 timed_out: bool = False):
        what = "timed out" if timed_out else f"failed (exit {status})"
        super().__init__(f"step {step} {what}: {reason or last_line(log)}; log: {log}")
        self.step, self.status, self.log, self.timed_out = step, status, log, timed_out


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the check; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def last_line(log: Path) -> str:
    """The log's last non-empty line (a one-line ``error: ...`` where the program printed one)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """While inside: the first SIGINT or SIGTERM raises :class:`Interrupted`; later ones are ignored, so the
    cleanup it starts (stopping the step, writing the JSON) is not cut short by a second Ctrl-C."""
    raised = []

    def handler(signum: int, frame: object) -> None:
        if not raised:
            raised.append(signum)
            raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _die_with_parent(parent: int) -> None:
    """In the child, before ``exec``: ask Linux for SIGTERM when the check dies; exit if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)


def stop(process: subprocess.Popen) -> None:
    """Stop ``process``'s whole group: SIGTERM, then, after :data:`GRACE_S` seconds or as soon as the leader has
    exited, SIGKILL to whatever of the group is left (DDP ranks, loader workers)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # nothing of the group is left
    try:
        process.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run_step(step: str, command: list[str], out: Path, cwd: Path, env: dict[str, str],
             limit_s: float | None = None, on_start: Callable[[int], None] | None = None) -> Path:
    """Run ``command`` in ``cwd``, its output to ``out/<step>.log``; -> the log. ``on_start`` is told its process id.
    Raises :class:`StepFailed` when it exits non-zero or runs past ``limit_s`` seconds (then stopped), and lets
    :class:`Interrupted` through after stopping it."""
    log = out / f"{step}.log"
    print(f"[gpu-check] {step}: {' '.join(command[1:])}", flush=True)
    with open(log, "w", encoding="utf-8") as handle:
        handle.write(" ".join(command) + "\n\n")
        handle.flush()
        parent = os.getpid()
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, process_group=0,
                                   preexec_fn=lambda: _die_with_parent(parent))
        try:
            if on_start is not None:
                on_start(process.pid)
            status = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stop(process)
            raise StepFailed(step, None, log, f"still running after its limit of {limit_s:.0f} s, stopped",
                             timed_out=True) from None
        except BaseException:
            stop(process)
            raise
    if status != 0:
        raise StepFailed(step, status, log)
    return log
