"""What made an artifact: package versions, settings and content fingerprints.

Every checkpoint, exported model, index and results file records these (DESIGN: settings travel with artifacts).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Iterator

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
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """JSON (indented, ``default=str`` for anything else) written through :func:`atomic_output`."""
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=False, default=str)
        handle.write("\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
