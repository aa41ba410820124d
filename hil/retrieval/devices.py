"""Where encoding and search run: ``--device auto|cpu|cuda[:N]`` and ``--precision fp32|fp16|bf16``.

One place turns what a user writes into a ``torch.device`` (with a one-line error for what cannot be), picks the
autocast context of a reduced-precision encoding, and tells FAISS which GPU to use. Choices:

- ``auto`` is the current CUDA device when torch sees a GPU, else the CPU (what a user of a GPU machine expects
  without typing anything).
- Reduced precision is autocast over the encoder's forward pass (weights stay fp32, matrix products run in
  fp16/bf16), as ``Trainer(precision="16-mixed")`` does in training; the stored vectors are fp16 either way.
  On a CPU, ``fp16`` is refused (CPU autocast supports bf16 only) and ``bf16`` is allowed.
- FAISS runs on the GPU only where the installed FAISS has GPU support (the ``faiss-gpu`` wheels); otherwise it
  stays on the CPU with one notice (the flat and IVF back-ends are correct either way).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Iterator

import numpy as np
import torch

from hil.retrieval.choices import PRECISIONS  # noqa: F401  (re-exported: the autocasts this module applies)

logger = logging.getLogger(__name__)

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_warned_faiss_cpu: list[bool] = []  # the faiss-cpu notice is given once per process
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``auto`` (or None) -> the GPU when torch sees one, else the CPU; ``cpu``, ``cuda``, ``cuda:N`` as written.

    Raises ``ValueError`` (one line, naming what was asked and what exists) for an unknown spelling, a CUDA device
    on a machine without one, or a GPU index beyond the machine's count.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = "auto" if spec is None else str(spec).strip().lower()
    if not _DEVICE.match(spec):
        raise ValueError(f"device {spec!r} is not one of {DEVICE_CHOICES}")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: torch sees no CUDA GPU on this machine (use cpu or auto)")
        count = torch.cuda.device_count()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= count:
            raise ValueError(f"device {spec!r}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
        device = torch.device("cuda", index)
    return device


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision the device cannot autocast to (one line)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type == "cpu":
        raise ValueError("precision 'fp16' needs a GPU (CPU autocast supports bf16 only); use fp32 or bf16")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision 'bf16': {torch.cuda.get_device_name(device)} does not support bfloat16; "
                         "use fp16")


@contextlib.contextmanager
def autocast(device: torch.device, precision: str = "fp32") -> Iterator[None]:
    """The encoder's forward passes in ``precision`` on ``device`` (fp32: no change)."""
    if precision == "fp32":
        yield
        return
    check_precision(precision, device)
    with torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision]):
        yield


def faiss_gpu_count() -> int:
    """GPUs the installed FAISS can use (0 with faiss-cpu)."""
    import faiss

    return int(faiss.get_num_gpus()) if hasattr(faiss, "StandardGpuResources") else 0


def faiss_gpu_for(device: torch.device) -> int | None:
    """The FAISS GPU that searches for an encoder on ``device``: its CUDA index where faiss-gpu sees that GPU, else
    None (FAISS on the CPU; a CUDA ``device`` with faiss-cpu installed says so once)."""
    if device.type != "cuda":
        return None
    count = faiss_gpu_count()
    index = device.index or 0
    if index < count:
        return index
    if not _warned_faiss_cpu:
        _warned_faiss_cpu.append(True)
        logger.warning("FAISS sees %d GPU(s) (faiss-cpu installed?): ivfflat / ivfpq indexes are searched by FAISS "
                       "on the CPU; flat and plaid search in torch on %s, where the encoder stays", count, device)
    return None


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in (``cuda`` -> ``cuda:<current>``): a GPU has one spelling, so tables cached
    per device are uploaded once per GPU, and a tensor's ``.device`` (always indexed) compares equal to it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def host_tensor(array: np.ndarray, dtype: type[np.generic] | None = None) -> torch.Tensor:
    """``array`` as a CPU tensor, C-ordered and of ``dtype`` (None: its own), sharing its memory where no conversion
    is needed. A read-only array (an index opened as memory maps) gives a tensor backed by read-only memory without
    torch's warning about it: every caller only reads it (copies it to a device, or computes from it)."""
    array = np.ascontiguousarray(array, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        return torch.from_numpy(array)


# Rows copied to a device at once: bounds the host temporary (256 MiB of fp16 vectors at D = 128, 4 MiB of codes).
UPLOAD_ROWS = 1 << 20


def upload_rows(array: np.ndarray, dtype: type[np.generic] | None, device: torch.device,
                block: int = UPLOAD_ROWS) -> torch.Tensor:
    """``array`` (a memmap is fine) as a tensor of ``dtype`` (None: its own) on ``device``, converted and copied in
    blocks of ``block`` rows: no whole-table temporary on the host (the codes or vectors of a large corpus take
    gigabytes). On the CPU an array already of ``dtype`` is shared, not copied (a memmap stays file pages, which the
    kernel may drop, instead of becoming the process's own memory)."""
    dtype = np.dtype(dtype or array.dtype)
    if torch.device(device).type == "cpu" and array.dtype == dtype:
        return host_tensor(array)
    out = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype, device=device)
    for start in range(0, len(array), block):
        part = host_tensor(array[start: start + block], dtype)
        out[start: start + len(part)] = part.to(device)
    return out
