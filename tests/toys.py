"""Small deterministic inputs shared by the retrieval tests: a toy corpus, queries and random-BERT encoders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.scoring import late_interaction_matrix
from hil.retrieval.plaid import CentroidPlan, assign_codes, build_ivf

WORDS = ("cell protein gene tumor vaccine virus dose trial mouse brain heart blood lung risk insulin "
         "signal receptor growth therapy patient model effect rate level study").split()
QUERIES = {"q1": "protein gene therapy", "q2": "tumor growth in the mouse brain", "q3": "vaccine dose trial",
           "q10": "insulin signal receptor", "q4": "heart and lung risk", "q5": "what is a cell?"}


def toy_corpus(n: int = 50, seed: int = 0, commas: bool = False) -> tuple[list[str], list[str]]:
    """``n`` distinct short texts (1..14 words, a period on every third, with ``commas`` a lone comma on every
    fourth), ids deliberately not in sorted order."""
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(n):
        words = list(rng.choice(WORDS, size=int(rng.integers(1, 15))))
        words.insert(int(rng.integers(0, len(words) + 1)), f"{i}")
        if i % 3 == 0:
            words[-1] += "."
        if commas and i % 4 == 0:
            words.insert(1, ",")
        texts.append(" ".join(words))
    return [f"d{(7 * i) % n:03d}" for i in range(n)], texts


class TwoHeadEncoder(ColBERTEncoder):
    """Two projections of the same hidden states, relevance = the sum of both heads' Eq. 1 scores."""

    architecture = "two-head-test"
    head_names = ("a", "b")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.linear_b = nn.Linear(self.hidden_size, self.dim, bias=False)

    def embed(self, batch, is_query):
        hidden = self.hidden_states(batch)
        return {"a": F.normalize(self.linear(hidden), dim=-1), "b": F.normalize(self.linear_b(hidden), dim=-1)}

    def score(self, queries, docs):
        return sum(late_interaction_matrix(queries.heads[h].float(), docs.heads[h].float(), queries.mask, docs.mask)
                   for h in self.head_names)


def make_encoder(hf_tokenizer, cls=ColBERTEncoder, seed: int = 0):
    """A one-layer random BERT (hidden 32) under ``cls``, 16-d heads, lengths 12/24, in eval mode."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=hf_tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    model = BertModel(config, add_pooling_layer=False)
    return cls("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=(model, hf_tokenizer)).eval()


# -- PLAID plans of random unit vectors ----------------------------------------------------------------------------

def unit(rows: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def random_plan(n_docs: int, dim: int, n_centroids: int, max_len: int, seed: int) -> CentroidPlan:
    """Documents of 0..max_len - 1 random unit tokens; few centroids and short documents make many exact ties."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, max_len, size=n_docs))]).astype(np.int64)
    centroids = unit(n_centroids, dim, seed + 2)
    codes = assign_codes(unit(int(offsets[-1]), dim, seed + 1), centroids)
    ivf_offsets, ivf_docs = build_ivf(codes, offsets, n_centroids)
    return CentroidPlan(centroids, codes, ivf_offsets, ivf_docs, offsets)


# index.json keys that say when, where and how an index was made, not what it holds
INDEX_PROVENANCE_KEYS = frozenset({"created", "versions", "git_commit", "host", "encoded_on",
                                   "build_seconds"})


def assert_same_index(directory: Path, reference: Path, ignore: frozenset[str] = INDEX_PROVENANCE_KEYS) -> None:
    """Every file byte for byte; ``index.json`` equal but for the keys in ``ignore`` (provenance)."""
    from hil.retrieval.index import INDEX_JSON

    names = sorted(p.name for p in Path(directory).iterdir())
    assert names == sorted(p.name for p in Path(reference).iterdir())
    for name in names:
        if name != INDEX_JSON:
            assert (Path(directory) / name).read_bytes() == (Path(reference) / name).read_bytes(), f"{name} differs"

    def comparable(folder: Path) -> dict:
        meta = json.loads((Path(folder) / INDEX_JSON).read_text())
        return {k: v for k, v in meta.items() if k not in ignore}

    assert comparable(directory) == comparable(reference)
