from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HIL_SHARED_DIR", REPO.parent / "shared")).resolve()

# The shared folder is read through the same settings users set.
os.environ.setdefault("HIL_DATA_DIR", str(SHARED / "data"))
os.environ.setdefault("HIL_MODELS_DIR", str(SHARED / "models"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED} (set HIL_SHARED_DIR)")
    return SHARED


@pytest.fixture(scope="session")
def tiny_model_dir(shared_dir: Path) -> Path:
    return shared_dir / "models" / "bert-tiny-splade"


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def random_bert(hidden: int = 32, layers: int = 1, seed: int = 0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=512)
    return BertModel(config, add_pooling_layer=False)


@pytest.fixture
def tiny_random_colbert(hf_tokenizer):
    """A ColBERTEncoder over a random 1-layer BERT with the real uncased vocabulary (fast, deterministic)."""
    from hil.modeling.encoder import ColBERTEncoder

    torch.manual_seed(0)
    return ColBERTEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                          _loaded=(random_bert(), hf_tokenizer)).eval()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_spawned(worker, world: int = 2, timeout: float = 120.0) -> None:
    """torch.multiprocessing spawn with a deadline, so that a collective that hangs fails the test."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=(world, free_port()), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"spawned gloo workers did not finish in {timeout:.0f} s (a collective hung?)")


# Threads of a c10d gloo process group (its worker threads and transport loop) and of the TCPStore server rank 0
# runs for ``init_method="tcp://..."``: all gone once the group is really destroyed.
GROUP_THREAD_PREFIXES = ("pt_gloo", "gloo", "pt_tcpstore")


def group_threads() -> list[str]:
    """Names of this process's threads that belong to a process group or its store (Linux; [] elsewhere)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    names = []
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(GROUP_THREAD_PREFIXES):
            names.append(name)
    return sorted(names)


@contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """The gloo process group of one ``run_spawned`` worker, torn down so that nothing of it outlives the worker.

    Issue 22, item 9 (a rank aborting with "terminate called without an active exception", SIGABRT, in ~1 run of
    3): ``torch.distributed.nn`` binds ``group=group.WORLD`` as a default argument of its functions when first
    imported, and transformers imports it. A worker that imported ``hil.modeling.losses`` after
    ``init_process_group`` left the live group in those defaults, so ``destroy_process_group`` could not free it:
    its gloo threads (and rank 0's TCPStore server) ran on into interpreter shutdown, where a gloo thread dropping
    the tensors of the last collective needs the GIL and aborts the process. Hence, in order:

    - ``torch.distributed.nn`` is imported before the group exists (its defaults stay None);
    - on success every rank meets at a barrier before tearing down, so no rank closes its connections while a peer
      still waits in a collective (a failing rank skips it: it must exit at once, ``run_spawned`` stops the rest);
    - ``destroy_process_group`` always runs, and on success the group's threads must then be gone: a group kept
      alive by some other reference fails the test here, every time, instead of aborting now and then.
    """
    import importlib

    import torch.distributed as dist

    importlib.import_module("torch.distributed.nn")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    left = group_threads()
    assert not left, (f"rank {rank}: the process group outlived destroy_process_group (threads {left} still run): "
                      f"something still references it")


@pytest.fixture
def one_thread():
    """Tiny models' matrices gain nothing from a second thread, and lose much when the cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
