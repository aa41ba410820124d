"""MS MARCO text triples (reading, writing, bad input) and BM25 hard-negative mining."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hil.data.beir import BeirDataset, load_beir
from hil.data.bm25 import BM25Index
from hil.data.triples import Triple, iter_triples, mine_bm25_triples, read_triples, write_triples
from hil.errors import DataFormatError

SHARED = Path(os.environ.get("HIL_SHARED_DIR", Path(__file__).resolve().parents[1].parent / "shared"))
ROWS = "what is a cat\tA cat is a small feline.\tDogs bark.\nhow tall is k2\tK2 is 8,611 m.\tEverest is higher.\n"
EXPECTED = [Triple("what is a cat", "A cat is a small feline.", "Dogs bark."),
            Triple("how tall is k2", "K2 is 8,611 m.", "Everest is higher.")]


def write(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "triples.tsv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def test_read_clean_and_limit(tmp_path):
    path = write(tmp_path, ROWS)
    assert read_triples(path) == EXPECTED
    assert read_triples(path, limit=1) == EXPECTED[:1]
    assert read_triples(path, limit=0) == []
    assert [line for line, _ in iter_triples(path)] == [1, 2]
    with pytest.raises(ValueError):
        read_triples(path, limit=-1)


def test_bom_crlf_and_blank_lines_read_identically(tmp_path):
    noisy = b"\xef\xbb\xbf\r\n" + ROWS.replace("\n", "\r\n\r\n").encode()
    assert read_triples(write(tmp_path, noisy)) == EXPECTED


def test_mojibake_is_kept_as_written(tmp_path):
    text = "whatâ\x80\x99s up\tdonâ\x80\x99t 1Â½\tno\n"  # valid UTF-8 of mis-decoded text, as in MS MARCO
    assert read_triples(write(tmp_path, text)) == [Triple("whatâ\x80\x99s up", "donâ\x80\x99t 1Â½", "no")]


@pytest.mark.parametrize("bad_line, reason", [
    (b"query\tpositive only", "expected 3 tab-separated columns .* found 2"),
    (b"q\tp\tn\textra", "found 4"),
    (b"no tabs at all", "found 1"),
    (b"q\t\tn", "empty positive column"),
    (b" \tp\tn", "empty query column"),
    (b"q\tp\t  ", "empty negative column"),
    (b"q\tcaf\xe9\tn", "invalid UTF-8"),
])
def test_bad_line_is_named(tmp_path, bad_line, reason):
    path = write(tmp_path, ROWS.encode() + b"\n" + bad_line + b"\r\n")
    with pytest.raises(DataFormatError, match=reason) as err:
        read_triples(path)
    assert err.value.path == str(path) and err.value.line == 4
    assert str(err.value).startswith(f"{path}:4: ")


@pytest.mark.parametrize("content", ["", "\n \n", "\ufeff"])
def test_empty_file(tmp_path, content):
    path = write(tmp_path, content)
    with pytest.raises(DataFormatError, match="no triples") as err:
        read_triples(path)
    assert str(err.value) == f"{path}: no triples"


def test_write_round_trip_and_atomicity(tmp_path):
    path = tmp_path / "cache" / "mined.tsv"
    write_triples(path, EXPECTED)
    assert read_triples(path) == EXPECTED
    with pytest.raises(ValueError, match="triple 2: negative"):
        write_triples(path, [EXPECTED[0], Triple("q", "p", "has\ta tab")])
    assert read_triples(path) == EXPECTED  # the old file is untouched
    assert [p.name for p in path.parent.iterdir()] == ["mined.tsv"]  # no temporary left behind


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
field = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\t\n\r"), max_size=15).filter(
    lambda text: text.strip())


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_parse_or_raise_data_format_error(content):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.tsv"
        path.write_bytes(content)
        try:
            read_triples(path)
        except DataFormatError as err:
            assert err.path == str(path)


@FUZZ
@given(st.lists(st.lists(st.sampled_from(["q", "p", "n", "", " ", "â\x80\x99", "\r", "\ufeff"]), max_size=5)
                .map("\t".join), max_size=5).map("\n".join))
def test_random_lines_parse_or_raise_data_format_error(text):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.tsv"
        path.write_text(text, encoding="utf-8")
        try:
            triples = read_triples(path)
        except DataFormatError as err:
            assert err.path == str(path)
        else:
            assert all(isinstance(triple, Triple) for triple in triples)


@FUZZ
@given(st.lists(st.builds(Triple, field, field, field), min_size=1, max_size=6))
def test_write_then_read_is_identity(triples):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.tsv"
        write_triples(path, triples)
        assert read_triples(path) == triples


# ---------------------------------------------------------------------------------------------------------------------
# Mining


def toy_dataset() -> BeirDataset:
    topics = ["cat feline purr", "dog bark leash", "fish water swim", "bird wing fly", "tree leaf root"]
    corpus = {}
    for t, words in enumerate(topics):
        for j in range(6):  # six documents a topic, sharing its words in different amounts
            corpus[f"t{t}d{j}"] = {"title": "", "text": " ".join(words.split()[: 1 + j % 3]) + f" filler{j}"}
    corpus["empty"] = {"title": "", "text": ""}
    queries = {f"q{t}": words for t, words in enumerate(topics)}
    queries["q_stop"] = "the of and"
    qrels = {f"q{t}": {f"t{t}d0": 1, f"t{t}d1": 2, f"t{t}d2": 0} for t in range(len(topics))}
    qrels["q_stop"] = {"t0d0": 1}
    qrels["q_none"] = {"t1d0": 0}  # no positive: no triple
    queries["q_none"] = "dog"
    return BeirDataset("toy", corpus, queries, qrels, "train", "memory")


def test_mined_negatives_follow_the_rules():
    data = toy_dataset()
    index = BM25Index.from_dataset(data)
    triples = mine_bm25_triples(data, negatives_per_query=2, depth=8, seed=3, skip_top=1, index=index)
    text_to_id = {data.doc_text(doc_id): doc_id for doc_id in data.corpus}
    by_query = {data.queries[query_id]: query_id for query_id in data.queries}
    for t in range(5):  # two positives (scores 1 and 2, not 0) x two negatives each
        query_id = f"q{t}"
        mined = [triple for triple in triples if by_query[triple.query] == query_id]
        assert sorted(text_to_id[triple.positive] for triple in mined) == sorted([f"t{t}d0"] * 2 + [f"t{t}d1"] * 2)
        ranking = [doc_id for doc_id, _ in index.search([data.queries[query_id]], 8)[0]]
        allowed = [doc_id for doc_id in ranking[1:] if data.qrels[query_id].get(doc_id, 0) <= 0]
        for triple in mined:
            negative = text_to_id[triple.negative]
            assert negative in allowed  # from the top 8 after the first rank, never judged relevant
        for positive in (f"t{t}d0", f"t{t}d1"):
            negatives = [text_to_id[tr.negative] for tr in mined if text_to_id[tr.positive] == positive]
            assert len(set(negatives)) == 2  # without replacement
    assert not {by_query[triple.query] for triple in triples} & {"q_stop", "q_none"}
    assert triples == mine_bm25_triples(data, negatives_per_query=2, depth=8, seed=3, skip_top=1)
    assert triples != mine_bm25_triples(data, negatives_per_query=2, depth=8, seed=4, skip_top=1)


def test_mining_uses_fewer_candidates_when_short_and_validates_arguments():
    data = toy_dataset()
    triples = mine_bm25_triples(data, negatives_per_query=50, depth=100)
    per_pair = {}
    for triple in triples:
        per_pair.setdefault((triple.query, triple.positive), []).append(triple.negative)
    assert all(len(set(negatives)) == len(negatives) for negatives in per_pair.values())
    for bad in ({"negatives_per_query": 0}, {"depth": 0}, {"depth": 5, "skip_top": 5}, {"skip_top": -1}):
        with pytest.raises(ValueError):
            mine_bm25_triples(data, **bad)


def test_mining_flattens_tabs_and_newlines_for_caching(tmp_path):
    data = BeirDataset("tabs", {"p": {"title": "Cat\tfacts", "text": "a cat\nsits"},
                                "n": {"title": "", "text": "cat\tdog"},
                                "x": {"title": "", "text": "bird"}},
                       {"q": "cat?"}, {"q": {"p": 1}}, "train", "memory")
    triples = mine_bm25_triples(data)
    assert triples == [Triple("cat?", "Cat facts a cat sits", "cat dog")]
    write_triples(tmp_path / "t.tsv", triples)
    assert read_triples(tmp_path / "t.tsv") == triples


# ---------------------------------------------------------------------------------------------------------------------
# Real data


@pytest.mark.integration
def test_real_msmarco_triples():
    path = SHARED / "data" / "msmarco" / "triples.train.small.head1000.tsv"
    if not path.is_file():
        pytest.skip(f"no MS MARCO triples at {path}")
    triples = read_triples(path)
    assert len(triples) == 1000
    assert triples[0].query == "is a little caffeine ok during pregnancy"
    assert "donâ\x80\x99t" in triples[0].positive  # the file's own encoding glitch, kept
    assert read_triples(path, limit=10) == triples[:10]


@pytest.mark.integration
def test_mine_scifact_train():
    folder = SHARED / "data" / "beir" / "scifact"
    if not folder.is_dir():
        pytest.skip(f"no SciFact at {folder}")
    data = load_beir(folder, split="train")
    subset = data.subset(n_queries=150, seed=0)  # all 5,183 documents, fewer queries: fast
    triples = mine_bm25_triples(subset, negatives_per_query=2, depth=50, seed=0)
    text_to_ids: dict[str, set[str]] = {}
    for doc_id in subset.corpus:
        text_to_ids.setdefault(" ".join(subset.doc_text(doc_id).split()), set()).add(doc_id)
    query_ids = {text: query_id for query_id, text in subset.queries.items()}
    pairs = sum(score > 0 for judged in subset.qrels.values() for score in judged.values())
    assert 2 * pairs * 0.95 <= len(triples) <= 2 * pairs
    for triple in triples:
        relevant = {doc_id for doc_id, score in subset.qrels[query_ids[triple.query]].items() if score > 0}
        negative_ids = text_to_ids[" ".join(triple.negative.split())]
        assert not negative_ids & relevant
        assert text_to_ids[" ".join(triple.positive.split())] & relevant
