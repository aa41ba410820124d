"""The training batch: one (B, N) ``documents`` field, each query's N texts in its example's order, tokenized column by
column (document j of query i at row j B + i, ``RankingBatch``'s layout); and the one id check every reader shares.

Expectations are written out by hand (or read from the files by hand), never produced by the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hil.data.datamodule import TokenizedCollate, TrainingDataModule, collate_examples, collate_triples
from hil.data.examples import ScoredExample
from hil.data.triples import Triple
from hil.errors import DataFormatError
from hil.modeling.module import ranking_texts

from nway_examples import nway_settings, write_nway_examples

EXAMPLES = [ScoredExample("q1", ("a1", "b1", "c1"), (3.0, 1.0, 2.0)),
            ScoredExample("q2", ("a2", "b2", "c2"), (0.5, 0.0, -1.0)),
            ScoredExample("q3", ("a3", "b3", "c3"), (1.0, 2.0, 3.0))]


class TextsTokenizer:
    """Stands in for ``ColBERTTokenizer``: gives back the texts it was handed, in the order handed."""

    def encode_queries(self, texts: list[str]) -> list[str]:
        return list(texts)

    def encode_documents(self, texts: list[str]) -> list[str]:
        return list(texts)


def test_the_batch_holds_each_querys_documents_in_order_and_tokenizes_them_column_by_column():
    batch = TokenizedCollate(TextsTokenizer())(EXAMPLES)
    assert batch["queries"] == ["q1", "q2", "q3"]
    assert batch["documents"] == [["a1", "b1", "c1"], ["a2", "b2", "c2"], ["a3", "b3", "c3"]]  # (B, N)
    assert batch["teacher_scores"].tolist() == [[3.0, 1.0, 2.0], [0.5, 0.0, -1.0], [1.0, 2.0, 3.0]]  # (B, N)
    assert batch["tokenized"]["queries"] == ["q1", "q2", "q3"]
    assert batch["tokenized"]["documents"] == ["a1", "a2", "a3", "b1", "b2", "b3", "c1", "c2", "c3"]  # (N B)
    queries, documents, scores = ranking_texts(collate_examples(EXAMPLES))  # the strings path, the same layout
    assert queries == ["q1", "q2", "q3"] and documents == ["a1", "a2", "a3", "b1", "b2", "b3", "c1", "c2", "c3"]
    assert scores.tolist() == batch["teacher_scores"].tolist()


def test_triples_are_two_documents_a_query_positives_then_negatives():
    triples = [Triple("q1", "p1", "n1"), Triple("q2", "p2", "n2")]
    batch = TokenizedCollate(TextsTokenizer())(triples)
    assert batch["documents"] == [["p1", "n1"], ["p2", "n2"]] == collate_triples(triples)["documents"]
    assert "teacher_scores" not in batch
    assert batch["tokenized"]["documents"] == ["p1", "p2", "n1", "n2"]
    assert ranking_texts(collate_triples(triples))[1] == ["p1", "p2", "n1", "n2"]


def test_a_batch_whose_queries_have_different_numbers_of_documents_is_refused():
    with pytest.raises(ValueError, match=r"N documents for each query; got \[2, 3\]"):
        ranking_texts({"queries": ["q1", "q2"], "documents": [["a1", "b1", "c1"], ["a2", "b2"]]})
    with pytest.raises(ValueError, match="got 2 queries and documents for 1"):
        ranking_texts({"queries": ["q1", "q2"], "documents": [["a1", "b1"]]})


def test_progress_counts_triples_for_two_documents_a_query_else_queries():
    from hil.modeling.callbacks import _unit

    assert _unit(collate_triples([Triple("q1", "p1", "n1"), Triple("q2", "p2", "n2")])) == "triples"
    assert _unit(collate_examples(EXAMPLES)) == "queries"


@pytest.mark.integration
def test_the_loader_tokenizes_an_nway_file_column_by_column(shared_dir, tmp_path, hf_tokenizer):
    """Through the data module and the real tokenizer: the first batch of an n-way file (no shuffling) holds the
    file's first B lines, each with its N texts as written, and its tokens are those of the texts laid out column by
    column by hand."""
    from hil.data.tokenization import ColBERTTokenizer

    b, n = 3, 4
    write_nway_examples(tmp_path, n_queries=6, nway=n)
    data = TrainingDataModule(**nway_settings(tmp_path), nway=n, batch_size=b, shuffle=False)
    tokenizer = ColBERTTokenizer(hf_tokenizer, query_maxlen=16, doc_maxlen=24)
    data.tokenize_with(tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))

    texts = dict(line.split("\t", 1) for line in (tmp_path / "collection.tsv").read_text().splitlines())
    queries = dict(line.split("\t", 1) for line in (tmp_path / "queries.tsv").read_text().splitlines())
    lines = [json.loads(line) for line in (tmp_path / "examples.jsonl").read_text().splitlines()[:b]]
    rows = [[texts[pid] for pid, _ in line[1:]] for line in lines]  # (B, N) as the file lists them
    assert batch["queries"] == [queries[line[0]] for line in lines]
    assert batch["documents"] == rows
    assert batch["teacher_scores"].tolist() == [[score for _, score in line[1:]] for line in lines]
    by_hand = []
    for j in range(n):
        for i in range(b):
            by_hand.append(rows[i][j])
    expected = tokenizer.encode_documents(by_hand)
    got = batch["tokenized"]["documents"]
    assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.attention_mask, expected.attention_mask)
    assert torch.equal(got.scoring_mask, expected.scoring_mask)


# -- one id check for every reader (hil.data.beir_files.checked_id) ------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_id_files_and_id_triples_name_file_line_and_field_of_a_bad_id(tmp_path):
    from hil.data.id_texts import IdTextFile
    from hil.data.triples_file import IdTriplesFile

    with pytest.raises(DataFormatError, match=r"c\.tsv:2: id 'a b' contains whitespace"):
        IdTextFile(write(tmp_path / "c.tsv", "x\tfirst\na b\tsecond\n"))
    with pytest.raises(DataFormatError, match=r"c2\.tsv:2: field 'id' is empty"):
        IdTextFile(write(tmp_path / "c2.tsv", "x\tfirst\n \tsecond\n"))
    table = IdTextFile(write(tmp_path / "c3.tsv", " x \tfirst\ny\tsecond\n"))  # ids are stripped, as always
    assert table.text("x") == "first" and table.text("y") == "second"
    queries = write(tmp_path / "queries.tsv", "1\twhat is a cat\n")
    collection = write(tmp_path / "collection.tsv", "0\ta cat\n1\ta dog\n")
    assert IdTriplesFile(write(tmp_path / "t.tsv", " 1 \t0\t 1\n"), queries, collection)[0] == \
        Triple("what is a cat", "a cat", "a dog")
    with pytest.raises(DataFormatError, match=r"t2\.tsv:1: field 'positive id' is empty"):
        IdTriplesFile(write(tmp_path / "t2.tsv", "1\t \t1\n"), queries, collection)[0]
    with pytest.raises(DataFormatError, match=r"t3\.tsv:1: negative id '1 1' contains whitespace"):
        IdTriplesFile(write(tmp_path / "t3.tsv", "1\t0\t1 1\n"), queries, collection)[0]
