"""IDF table (hil.data.idf) against slow, obvious document-frequency counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.data.idf import IDFTable, bm25_idf, count_document_frequency
from hil.data.tokenization import ColBERTTokenizer

DOCS = ["The cat sat on the mat.", "A dog chased the cat!", "Fever and the flu", "", "cat cat cat"]


def slow_idf(df: int, n: int) -> float:
    return math.log(1.0 + (n - df + 0.5) / (df + 0.5))


@given(st.integers(1, 10_000).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n), min_size=1,
                                                                                 max_size=20))))
@settings(max_examples=50, deadline=None)
def test_bm25_idf_formula_positive_and_decreasing(case):
    n, dfs = case
    values = bm25_idf(torch.tensor(dfs), n)
    for df, value in zip(dfs, values.tolist()):
        assert value == pytest.approx(slow_idf(df, n), rel=1e-6)
        assert value > 0
    ordered = bm25_idf(torch.arange(n + 1), n)
    assert (ordered[1:] < ordered[:-1]).all()
    assert ordered[0].item() == pytest.approx(math.log(2 * n + 2), rel=1e-6)  # unseen = the maximum


def test_bm25_idf_rejects_bad_counts():
    with pytest.raises(ValueError, match="at least one document"):
        bm25_idf(torch.tensor([0]), 0)
    with pytest.raises(ValueError, match=r"\[0, N=3\]"):
        bm25_idf(torch.tensor([4]), 3)


def test_document_frequency_matches_a_slow_count(hf_tokenizer):
    df, n = count_document_frequency(hf_tokenizer, DOCS, len(hf_tokenizer), batch_size=2)
    assert n == len(DOCS)
    expected = torch.zeros(len(hf_tokenizer), dtype=torch.long)
    for text in DOCS:
        for token in set(hf_tokenizer.encode(text, add_special_tokens=False)):
            expected[token] += 1
    assert torch.equal(df, expected)
    cat = hf_tokenizer.convert_tokens_to_ids("cat")
    assert df[cat] == 3  # once per document, however often it occurs


def test_long_documents_are_counted_whole(hf_tokenizer):
    text = "alpha " * 600 + "omega"  # far beyond model_max_length (512): counted, not truncated
    df, _ = count_document_frequency(hf_tokenizer, [text], len(hf_tokenizer))
    assert df[hf_tokenizer.convert_tokens_to_ids("omega")] == 1


def test_table_weights_special_tokens_zero_and_unseen_maximum(hf_tokenizer):
    table = IDFTable.from_texts(hf_tokenizer, DOCS, extra_zero_ids=[1, 2], source="toy")
    weights = table.to_tensor()
    n = len(DOCS)
    for special in hf_tokenizer.all_special_ids + [1, 2]:
        assert weights[special] == 0.0
    cat = hf_tokenizer.convert_tokens_to_ids("cat")
    unseen = hf_tokenizer.convert_tokens_to_ids("zebra")
    assert weights[cat].item() == pytest.approx(slow_idf(3, n), rel=1e-6)
    assert weights[unseen].item() == pytest.approx(math.log(2 * n + 2), rel=1e-6)
    assert weights[unseen].item() == pytest.approx(table.unseen_idf)
    assert weights.max().item() == pytest.approx(table.unseen_idf)
    ids = torch.tensor([[101, cat, unseen, 103], [cat, cat, 0, 0]])
    looked_up = table.weights(ids)
    assert looked_up.shape == (2, 4)
    for i in range(2):
        for j in range(4):
            assert looked_up[i, j].item() == weights[ids[i, j]].item()
    assert "toy" in table.describe() and "5 documents" in table.describe()


def test_colbert_tokenizer_adds_its_markers_to_zero_ids(hf_tokenizer):
    colbert = ColBERTTokenizer(hf_tokenizer, query_maxlen=8, doc_maxlen=16)
    table = IDFTable.from_texts(colbert, DOCS)
    assert {colbert.query_marker_id, colbert.doc_marker_id} <= set(table.zero_ids)
    assert set(hf_tokenizer.all_special_ids) <= set(table.zero_ids)


def test_padding_save_load_and_errors(hf_tokenizer, tmp_path):
    table = IDFTable.from_texts(hf_tokenizer, DOCS, source="toy")
    padded = table.to_tensor(len(hf_tokenizer) + 3)
    assert torch.equal(padded[: len(hf_tokenizer)], table.to_tensor())
    assert torch.allclose(padded[-3:], torch.full((3,), table.unseen_idf))
    with pytest.raises(ValueError, match="vocabularies differ"):
        table.to_tensor(10)
    loaded = IDFTable.load(table.save(tmp_path / "idf.pt"))
    assert torch.equal(loaded.to_tensor(), table.to_tensor())
    assert loaded.n_documents == 5 and loaded.zero_ids == table.zero_ids and loaded.source == "toy"
    with pytest.raises(ValueError, match="no documents"):
        IDFTable.from_texts(hf_tokenizer, [])
    with pytest.raises(TypeError, match="document 1"):
        IDFTable.from_texts(hf_tokenizer, ["ok", None])
    with pytest.raises(FileNotFoundError):
        IDFTable.load(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IDFTable(torch.zeros(4, dtype=torch.long), 1, zero_ids=(7,))
