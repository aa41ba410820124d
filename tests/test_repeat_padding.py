"""Exact scoring without a mask (gather_documents(repeat_padding=True)): padding repeats each document's own first
token, so MaxSim is unchanged; empty documents fall back to zeros and a mask; only a pure MaxSim encoder opts in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hil.modeling.contracts import EncodedBatch
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.loading import load_encoder
from hil.retrieval.search import score_documents
from hil.retrieval.store import TokenStore, gather_documents


def random_store(lengths: list[int], dim: int = 8, seed: int = 0) -> TokenStore:
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    vectors = rng.standard_normal((int(offsets[-1]), dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    token_ids = rng.integers(1, 100, size=int(offsets[-1])).astype(np.int32)
    return TokenStore([f"d{i}" for i in range(len(lengths))], offsets, {"colbert": vectors.astype(np.float16)},
                      token_ids)


def test_padding_repeats_each_documents_first_token():
    store = random_store([3, 1, 5, 2])
    docs = gather_documents(store, [0, 1, 2, 3], repeat_padding=True)
    assert docs.padding_repeats_tokens and docs.select(slice(1, 3)).padding_repeats_tokens  # a part still repeats
    vectors, lengths = docs.heads["colbert"], [3, 1, 5, 2]
    for row, length in enumerate(lengths):
        for position in range(length, vectors.shape[1]):
            assert torch.equal(vectors[row, position], vectors[row, 0])
    assert int(docs.input_ids[~docs.mask].abs().sum()) == 0  # token ids are zeroed either way
    plain = gather_documents(store, [0, 1, 2, 3])
    assert not plain.padding_repeats_tokens and float(plain.heads["colbert"][~plain.mask].abs().sum()) == 0
    assert torch.equal(plain.heads["colbert"][plain.mask], vectors[docs.mask])


def test_an_empty_document_keeps_zeros_and_the_mask():
    store = random_store([3, 0, 2])
    docs = gather_documents(store, [0, 1, 2], repeat_padding=True)
    assert not docs.padding_repeats_tokens and float(docs.heads["colbert"][~docs.mask].abs().sum()) == 0


@pytest.fixture(scope="module")
def colbert(tiny_model_dir):
    torch.manual_seed(0)
    return load_encoder(str(tiny_model_dir), dim=8).eval()


def test_scores_without_a_mask_equal_the_masked_scores_and_a_loop(colbert):
    store = random_store([7, 1, 12, 3, 9, 2], dim=8, seed=3)
    with torch.inference_mode():
        queries = colbert.encode_queries(["a query", "another, longer query about p53"])
        masked = colbert.score(queries, gather_documents(store, range(6)))
        repeated_docs = gather_documents(store, range(6), repeat_padding=True)
        repeated = colbert.score(queries, repeated_docs)
    assert repeated_docs.padding_repeats_tokens and torch.equal(repeated, masked)
    offsets, vectors = store.doc_offsets, store.embeddings["colbert"].astype(np.float32)
    for qi in range(len(queries)):
        q = queries.heads["colbert"][qi][queries.mask[qi]].numpy()
        for d in range(6):
            expected = (q @ vectors[offsets[d]: offsets[d + 1]].T).max(axis=1).sum()
            assert repeated[qi, d].item() == pytest.approx(expected, abs=1e-5)
    assert np.array_equal(score_documents(colbert, queries, store, np.arange(6)), masked.numpy())


def test_only_a_pure_maxsim_encoder_takes_repeated_padding(colbert, tiny_model_dir):
    class Reweighted(ColBERTEncoder):  # a score of its own: it must not be handed unmasked documents
        def score(self, queries: EncodedBatch, docs: EncodedBatch) -> torch.Tensor:
            return super().score(queries, docs) * 2

    assert colbert.scores_repeated_padding
    assert Reweighted.scores_repeated_padding.fget(object.__new__(Reweighted)) is False
    from hil.modeling.hil import HILEncoder

    assert HILEncoder.scores_repeated_padding.fget(object.__new__(HILEncoder)) is False
