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


def test_token_ids_are_read_only_when_asked():
    store = random_store([3, 1, 5, 2])
    read = gather_documents(store, [2, 0, 3])
    unread = gather_documents(store, [2, 0, 3], token_ids=False)
    assert torch.equal(read.heads["colbert"], unread.heads["colbert"]) and torch.equal(read.mask, unread.mask)
    assert unread.input_ids.shape == read.input_ids.shape and int(unread.input_ids.abs().sum()) == 0
    for row, (start, end) in enumerate([(4, 9), (0, 3), (9, 11)]):  # documents 2, 0, 3 of offsets 0 3 4 9 11
        assert read.input_ids[row, : end - start].tolist() == store.token_ids[start:end].tolist()


@pytest.mark.parametrize("pure", [True, False], ids=["pure MaxSim", "a score of its own"])
def test_search_reads_token_ids_only_for_a_score_that_may_need_them(colbert, monkeypatch, pure):
    import hil.retrieval.search as search

    asked: list[bool] = []

    def spy(*args, **kwargs):
        asked.append(kwargs["token_ids"])
        return gather_documents(*args, **kwargs)

    monkeypatch.setattr(search, "gather_documents", spy)
    monkeypatch.setattr(type(colbert), "scores_repeated_padding", property(lambda self: pure))
    with torch.inference_mode():
        queries = colbert.encode_queries(["a query"])
        score_documents(colbert, queries, random_store([4, 2, 6], dim=8), np.arange(3))
    assert asked and all(flag is (not pure) for flag in asked)
