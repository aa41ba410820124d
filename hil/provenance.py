"""What made an artifact (package versions, settings, content fingerprints and checksums), and writing artifacts
so that a crash or a second process never leaves half of one.

Every checkpoint, exported model, index and results file records these (docs/design.md: settings travel with
artifacts).
Writers use :func:`atomic_output` (one file), :func:`atomic_directory` (a folder, renamed into place when
complete) and :func:`file_lock` (one writer at a time, the others wait); :func:`file_digest` is the checksum
artifacts record of their files.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Iterator

logger = logging.getLogger(__name__)

# The checksum artifacts record: SHA-256, read in 1 MiB blocks. Measured on this project's machine (x86 with the
# SHA extensions, hashlib on OpenSSL, warm page cache): sha256 650-1100 MiB/s, blake2b 310-640 MiB/s, so sha256.
DIGEST = "sha256"
_DIGEST_BLOCK = 1 << 20

_PACKAGES = ("hil", "torch", "pytorch-lightning", "transformers", "faiss-cpu", "faiss-gpu-cu12",
             "pytrec-eval-terrier", "bm25s", "numpy")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class StageClock:
    """Wall seconds of the stages of a piece of work, as its record keeps them: ``stage(name)`` records the time
    since the previous stage ended (or since the clock was made), rounded to ``digits``."""

    def __init__(self, digits: int = 3) -> None:
        self.stages: dict[str, float] = {}
        self.digits = digits
        self._last = time.perf_counter()

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = round(now - self._last, self.digits)
        self._last = now


def provenance(settings: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A record for an artifact: creation time, versions, git commit, the settings and anything extra."""
    record: dict[str, Any] = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "git_commit": git_commit(),
        "host": platform.node(),
    }
    if settings is not None:
        record["settings"] = settings
    record.update(extra)
    return record


def fingerprint_strings(items: Iterable[str]) -> str:
    """A short, order-sensitive SHA-256 fingerprint of a sequence of strings."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def place_file(source: str | os.PathLike, target: str | os.PathLike, *, overwrite: bool) -> None:
    """``target`` becomes the same file as ``source`` (a hard link; a copy where the file system has none), atomically;
    ``source`` stays. Without ``overwrite`` only where no file is: a file another process put there meanwhile raises
    ``FileExistsError`` and is kept (a run file checked absent when a command started, then written by another)."""
    source, target = Path(source), Path(target)
    if target.exists() and os.path.samefile(source, target):
        return  # already this file (rename() between two links of one file would do nothing)
    if not overwrite:
        try:
            os.link(source, target)  # fails, atomically, when the name is taken
            return
        except FileExistsError:
            raise FileExistsError(f"{target}: a file is there") from None
        except OSError:  # no hard links here: checked, then copied and renamed into place
            if target.exists():
                raise FileExistsError(f"{target}: a file is there") from None
    staged = target.with_name(f".{target.name}.{os.getpid()}.placed")
    staged.unlink(missing_ok=True)
    try:
        os.link(source, staged)
    except OSError:
        shutil.copyfile(source, staged)
    os.replace(staged, target)


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed to ``path``, on error removed.

    Readers never see half a file, and an interrupted writer leaves only a hidden ``.<name>.<pid>.tmp``. The
    result gets the permissions a plain ``open()`` would give it (0666 & ~umask). Writers that append a suffix
    of their own (``np.save`` adds ``.npy`` to a bare name) should write to an open handle of the yielded path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.chmod(tmp, plain_file_mode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plain_file_mode() -> int:
    """The permissions a plain ``open()`` gives a new file: 0666 less the process's umask."""
    umask = os.umask(0)  # read only by setting it: put back at once
    os.umask(umask)
    return 0o666 & ~umask


def give_plain_file_modes(folder: str | os.PathLike) -> None:
    """Give every file under ``folder`` :func:`plain_file_mode`: a library that writes a ``mkstemp`` file and
    renames it (safetensors' ``save_file``, which ``save_pretrained`` calls too) leaves it 0600, unreadable to the
    group and others whom the user's umask lets read the rest of the folder. Links are left alone."""
    mode = plain_file_mode()
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, mode)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """JSON (indented, ``default=str`` for anything else) written through :func:`atomic_output`."""
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=False, default=str)
        handle.write("\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


# -- checksums --------------------------------------------------------------------------------------------------

def file_digest(path: str | os.PathLike, algorithm: str = DIGEST) -> str:
    """Hex digest of a file's bytes, streamed in 1 MiB blocks (bounded memory for files of any size)."""
    digest = hashlib.new(algorithm)
    block = bytearray(_DIGEST_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(block):
            digest.update(view[:count])
    return digest.hexdigest()


# -- one writer at a time ---------------------------------------------------------------------------------------

_HELD: dict[str, tuple[threading.RLock, list[int]]] = {}  # lock path -> (in-process lock, [depth])
_HELD_GUARD = threading.Lock()


def _holder(handle: Any) -> str:
    """What the lock file says of its holder (``pid <n> on <host>``), or ``another process``."""
    try:
        handle.seek(0)
        return handle.read().strip() or "another process"
    except OSError:
        return "another process"


@contextmanager
def file_lock(path: str | os.PathLike, *, timeout: float | None = None, what: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block: other processes asking for
    it wait, with one log line naming the holder (``pid <n> on <host>``, written into the file).

    An ``fcntl.flock`` lock: the kernel releases it when its holder ends, however it ends (SIGKILL included), so a
    dead writer never leaves a stale lock. The holder removes the file before it unlocks, so no ``.lock`` file is
    left behind; a waiter that then gets the lock of the removed file sees that the path no longer names the file
    it locked and opens the path again (the usual unlink-then-unlock protocol: at any moment only the file the path
    names can be held, so two processes never both hold the lock). A SIGKILLed holder leaves the file, unlocked:
    the next holder removes it. Re-entrant within a process (nested blocks of one thread, or of
    several threads one after the other), so a locked function may call another that takes the same lock.
    ``timeout`` (seconds; None waits as long as it takes) raises ``TimeoutError`` naming the holder. Local file
    systems only: ``flock`` over NFS depends on the server.
    """
    path = Path(path).absolute()
    with _HELD_GUARD:
        local, depth = _HELD.setdefault(str(path), (threading.RLock(), [0]))
    with local:
        if depth[0]:  # this process already holds the file lock
            depth[0] += 1
            try:
                yield
            finally:
                depth[0] -= 1
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = _lock_current_file(path, timeout, what)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {platform.node()}\n")
            handle.flush()
            depth[0] = 1
            yield
        finally:
            depth[0] = 0
            try:
                path.unlink()  # while still locked: a waiter on this file sees it gone and opens the path again
            except FileNotFoundError:
                pass
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def _lock_current_file(path: Path, timeout: float | None, what: str | None) -> Any:
    """Open ``path`` and lock it; -> the handle, once the locked file is still the one ``path`` names (a holder
    removes it before unlocking: the lock of a removed file protects nothing)."""
    while True:
        handle = open(path, "a+", encoding="utf-8")
        try:
            _acquire(handle, path, timeout, what)
            try:
                current = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                current = False
        except BaseException:
            handle.close()
            raise
        if current:
            return handle
        handle.close()


def _acquire(handle: Any, path: Path, timeout: float | None, what: str | None) -> None:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    holder = _holder(handle)
    for _ in range(50):  # the holder writes its name just after it locks: give it a moment
        if holder != "another process":
            break
        time.sleep(0.01)
        holder = _holder(handle)
    logger.warning("%s is locked by %s: waiting for it to finish%s", path, holder, f" ({what})" if what else "")
    if timeout is None:
        fcntl.flock(handle, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: still locked by {_holder(handle)} after {timeout:g} s") from None
            time.sleep(0.1)


def lock_path(path: str | os.PathLike) -> Path:
    """The lock file of an artifact at ``path``: ``<path>.lock`` beside it (not inside: a folder written through
    :func:`atomic_directory` is replaced as a whole)."""
    path = Path(path)
    return path.with_name(path.name + ".lock")


# -- folders written whole --------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_dead_writers_leftovers(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders ``.<name>.<pid>.tmp-dir`` / ``.<name>.<pid>.old`` beside ``path`` left by
    writers of this host that died (SIGKILL, power loss) before they could clean up; -> those removed. A folder
    whose process still runs is kept."""
    path = Path(path)
    removed = []
    if not path.parent.is_dir():
        return removed
    prefix = f".{path.name}."
    for leftover in path.parent.iterdir():
        name = leftover.name
        if not name.startswith(prefix) or not leftover.is_dir():
            continue
        pid, _, kind = name[len(prefix):].partition(".")
        if kind in ("tmp-dir", "old") and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def replace_directory(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename the finished folder ``source`` to ``target``; an existing ``target`` is renamed aside first (to
    ``.<name>.<pid>.old``), then removed. Between the two renames ``target`` is absent for an instant (a directory
    cannot be renamed onto a non-empty one): a reader finds the old folder, no folder, or the new one, never a
    mix. What a writer killed in between leaves aside is removed by the next one."""
    source, target = Path(source), Path(target)
    if target.exists() and not target.is_dir():  # a file the user keeps there: never renamed aside or removed
        raise FileExistsError(f"{target}: a file is there, not a folder; nothing was replaced (the result is in "
                              f"{source})")
    remove_dead_writers_leftovers(target)
    if not target.exists():
        os.replace(source, target)
        return
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    if old.exists():
        shutil.rmtree(old)
    os.replace(target, old)
    os.replace(source, target)
    shutil.rmtree(old)


@contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path`` (``.<name>.<pid>.tmp-dir``); when the block succeeds it
    replaces ``path`` (:func:`replace_directory`), when it raises it is removed, so ``path`` is only ever a
    complete folder (a process killed inside the block leaves ``path`` as it was, and its temporary folder, which
    the next writer removes: :func:`remove_dead_writers_leftovers`). ``overwrite=False`` refuses an existing
    ``path`` (``FileExistsError``), checked before and after the block. Take :func:`file_lock` of
    :func:`lock_path` around it where two processes may write ``path``.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    remove_dead_writers_leftovers(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp-dir")
    if tmp.exists():  # left by an earlier process that had this id
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} appeared while it was being written; refusing to replace it")
        replace_directory(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
