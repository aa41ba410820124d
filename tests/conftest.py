from __future__ import annotations

import os
import socket
import time
from pathlib import Path

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


@pytest.fixture
def one_thread():
    """Tiny models' matrices gain nothing from a second thread, and lose much when the cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
