"""Token store building blocks (hil.retrieval.store, hil.retrieval.encoding) against slow, obvious references.

``length_blocks`` is checked against its contract and a plain greedy loop; ``gather_documents`` against reading
each document's rows one by one, with empty documents anywhere (the last one included); the document-encoder
view against the training flag it must leave alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.retrieval.encoding import DocumentEncoderView, eval_mode
from hil.retrieval.store import TokenStore, gather_documents, length_blocks


def greedy_blocks(sorted_lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """The reference: grow each block one item at a time while ``count * longest`` (empty items count 1) fits."""
    blocks, start = [], 0
    while start < len(sorted_lengths):
        end = start + 1
        while end < len(sorted_lengths) and (end + 1 - start) * max(1, sorted_lengths[end]) <= budget:
            end += 1
        blocks.append((start, end))
        start = end
    return blocks


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=0, max_size=40), st.integers(1, 100))
def test_length_blocks_contract(lengths, budget):
    sorted_lengths = np.sort(np.array(lengths, dtype=np.int64))
    blocks = length_blocks(sorted_lengths, budget)
    # Contiguous and covering every item once, in order.
    assert [i for start, end in blocks for i in range(start, end)] == list(range(len(lengths)))
    assert all(start < end for start, end in blocks)
    for start, end in blocks:
        count, longest = end - start, max(1, int(sorted_lengths[end - 1]))
        assert count == 1 or count * longest <= budget, "fits the budget unless it is a single item"
        if end < len(lengths):  # maximal: the next item would not have fitted
            assert (count + 1) * max(1, int(sorted_lengths[end])) > budget
    assert blocks == greedy_blocks(sorted_lengths.tolist(), budget)


def random_store(lengths: list[int], dim: int = 3, seed: int = 0) -> TokenStore:
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n_tokens = int(offsets[-1])
    vectors = rng.standard_normal((n_tokens, dim)).astype(np.float16)
    token_ids = rng.integers(1, 1000, size=n_tokens).astype(np.int32)
    return TokenStore([f"d{i}" for i in range(len(lengths))], offsets, {"h": vectors}, token_ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=8), st.data())
def test_gather_documents_matches_reading_each_document(lengths, data):
    store = random_store(lengths)
    rows = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=6))
    batch = gather_documents(store, rows)
    width = max(1, max(lengths[i] for i in rows))
    assert batch.heads["h"].shape == (len(rows), width, 3) and batch.mask.shape == (len(rows), width)
    for b, i in enumerate(rows):
        lo, hi = int(store.doc_offsets[i]), int(store.doc_offsets[i + 1])
        expected = np.zeros((width, 3), dtype=np.float32)
        expected[: hi - lo] = store.embeddings["h"][lo:hi].astype(np.float32)
        np.testing.assert_array_equal(batch.heads["h"][b].numpy(), expected)
        assert batch.mask[b].tolist() == [j < hi - lo for j in range(width)]
        assert batch.input_ids[b].tolist() == store.token_ids[lo:hi].tolist() + [0] * (width - (hi - lo))


def test_gather_documents_reads_an_empty_last_document():
    store = random_store([2, 0, 3, 0])  # the last document starts at n_tokens: there is no row there to read
    batch = gather_documents(store, [3, 2, 1])
    assert batch.mask.tolist() == [[False] * 3, [True] * 3, [False] * 3]
    assert (batch.heads["h"][[0, 2]] == 0).all()


@pytest.mark.parametrize("training", [False, True])
def test_document_encoder_view_leaves_the_encoder_mode_alone(tiny_random_colbert, training):
    encoder = tiny_random_colbert.train(training)
    view = DocumentEncoderView(encoder, {"quantize": "test"})
    with eval_mode(view):
        assert not any(module.training for module in encoder.modules())
        assert torch.is_inference_mode_enabled()
    assert all(module.training == training for module in encoder.modules())
    assert view.head_names == encoder.head_names and view.dim == encoder.dim
