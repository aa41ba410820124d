"""Indexes verify themselves, and a NaN or infinite score is an error, never a ranking (issue 16).

Each test damages an index the way disks, copies and bugs do (a truncated file, bytes altered at the same size, a
missing file, NaN bytes, a model producing NaN) and asserts the one clear error naming the file or the queries,
or, where the index is a cache (``open_or_build_index``), the rebuild and the warning that says so.
"""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np
import pytest

from hil.retrieval import integrity
from hil.retrieval.builder import build_index, open_or_build_index, rebuild_faiss
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.index import INDEX_JSON, TokenIndex
from hil.retrieval.integrity import IndexIntegrityError, NonFiniteError
from hil.retrieval.search import exact_rank, exhaustive_scores, rank_matrix, rerank

from toys import toy_corpus

N_DOCS = 24


@pytest.fixture
def corpus():
    return toy_corpus(N_DOCS, seed=3)


@pytest.fixture
def queries(corpus):
    _, texts = corpus
    return {f"q{i}": " ".join(texts[i].split()[:4]) for i in range(4)}


@pytest.fixture
def built(tiny_random_colbert, corpus, tmp_path):
    ids, texts = corpus
    return build_index(tiny_random_colbert, ids, texts, tmp_path / "idx", chunk_docs=10, batch_size=8,
                       progress=False)


def embeddings_file(index: TokenIndex):
    return index.directory / "colbert.embeddings.npy"


def data_offset(path) -> int:
    """Where a .npy file's array bytes begin (after its header)."""
    with open(path, "rb") as handle:
        version = np.lib.format.read_magic(handle)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(handle)
        return handle.tell()


def alter_bytes(path, at: int | None = None, count: int = 8) -> None:
    """Change ``count`` bytes in the middle of the file (or at ``at``), keeping its size."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 if at is None else at
    data[start:start + count] = bytes(255 - b for b in data[start:start + count])
    path.write_bytes(bytes(data))


def write_nan_rows(path, rows: slice | None = None) -> None:
    """Overwrite the fp16 rows ``rows`` (all by default) of an .npy table with NaN bytes, keeping the file's size."""
    table = np.load(path, mmap_mode="r+")
    table[rows if rows is not None else slice(None)] = np.float16("nan")
    table.flush()
    del table


def strip_records(directory) -> None:
    """Turn an index into one written before indexes recorded their files."""
    meta = json.loads((directory / INDEX_JSON).read_text())
    del meta["files"]
    (directory / INDEX_JSON).write_text(json.dumps(meta))


# -- records ----------------------------------------------------------------------------------------------------

def test_index_json_records_size_and_sha256_of_every_other_file(built):
    records = built.meta["files"]
    on_disk = sorted(p.name for p in built.directory.iterdir() if p.name != INDEX_JSON)
    assert sorted(records) == on_disk and "colbert.embeddings.npy" in records and "doc_ids.json" in records
    for name, record in records.items():
        data = (built.directory / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert TokenIndex.load(built.directory).verified == "full"  # small: "auto" reads every byte


# -- damaged files ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("verify", ["sizes", "auto", "full"])
def test_a_truncated_file_is_named_with_both_sizes_before_any_mmap(built, verify):
    path = embeddings_file(built)
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size - 100)
    with pytest.raises(IndexIntegrityError) as error:
        TokenIndex.load(built.directory, verify=verify)
    message = str(error.value)
    assert str(path) in message and f"{size - 100} bytes on disk, {size} recorded" in message
    assert "rebuild it" in message and "overwrite=True" in message


def test_same_size_damage_is_caught_by_the_checksum(built):
    path = embeddings_file(built)
    alter_bytes(path)
    with pytest.raises(IndexIntegrityError, match="sha256 checksum differs") as error:
        TokenIndex.load(built.directory)  # auto: a small index is read whole
    assert str(path) in str(error.value) and "rebuild it" in str(error.value)
    with pytest.raises(IndexIntegrityError, match="checksum differs"):
        TokenIndex.load(built.directory, verify="full")
    assert TokenIndex.load(built.directory, verify="sizes").verified == "sizes"  # asked not to read the bytes


def test_auto_reads_the_bytes_only_up_to_the_threshold(built, monkeypatch):
    alter_bytes(embeddings_file(built))
    total = sum(record["bytes"] for record in built.meta["files"].values())
    monkeypatch.setattr(integrity, "FULL_CHECK_MAX_BYTES", total - 1)
    assert TokenIndex.load(built.directory).verified == "sizes"
    with pytest.raises(IndexIntegrityError, match="checksum differs"):
        TokenIndex.load(built.directory, verify="full")
    monkeypatch.setattr(integrity, "FULL_CHECK_MAX_BYTES", total)
    with pytest.raises(IndexIntegrityError, match="checksum differs"):
        TokenIndex.load(built.directory)


def test_a_missing_file_and_an_unreadable_index_json_are_named(built):
    (built.directory / "token_ids.npy").unlink()
    with pytest.raises(IndexIntegrityError, match=r"token_ids\.npy: missing"):
        TokenIndex.load(built.directory, verify="sizes")
    (built.directory / INDEX_JSON).write_text('{"format": "hil-tok')
    with pytest.raises(IndexIntegrityError, match=r"index\.json: unreadable"):
        TokenIndex.load(built.directory)


def test_bad_verify_setting_is_refused(built):
    with pytest.raises(ValueError, match="verify must be one of"):
        TokenIndex.load(built.directory, verify="checksums")


def test_an_index_without_records_opens_with_a_warning_and_still_reports_truncation(built, caplog):
    strip_records(built.directory)
    with caplog.at_level(logging.WARNING, logger="hil.retrieval.integrity"):
        index = TokenIndex.load(built.directory)
    assert index.verified == "none" and "cannot be verified" in caplog.text
    del index
    path = embeddings_file(built)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 64)
    with pytest.raises(IndexIntegrityError, match=r"its header .* needs \d+ \(truncated\)") as error:
        TokenIndex.load(built.directory)
    assert str(path) in str(error.value)  # and not numpy's "mmap length is greater than file size"


def test_open_or_build_rebuilds_a_damaged_or_unverifiable_index_and_says_so(tiny_random_colbert, corpus, built,
                                                                            caplog):
    ids, texts = corpus
    reference = np.array(built.embeddings["colbert"])
    alter_bytes(embeddings_file(built))
    with caplog.at_level(logging.WARNING):
        index = open_or_build_index(tiny_random_colbert, ids, texts, built.directory, chunk_docs=10, batch_size=8,
                                    progress=False)
    assert "damaged index, rebuilding it" in caplog.text and "checksum differs" in caplog.text
    np.testing.assert_array_equal(np.array(index.embeddings["colbert"]), reference)
    assert TokenIndex.load(built.directory, verify="full").verified == "full"

    caplog.clear()
    strip_records(built.directory)
    with caplog.at_level(logging.WARNING):
        index = open_or_build_index(tiny_random_colbert, ids, texts, built.directory, chunk_docs=10, batch_size=8,
                                    progress=False)
    assert "rebuilding it so that it records" in caplog.text and "files" in index.meta


def test_search_structure_files_are_recorded_and_checked(built):
    ivf = rebuild_faiss(built, "ivfflat", {"nlist": 2}, progress=False)
    assert "colbert.faiss" in ivf.meta["files"]
    assert TokenIndex.load(ivf.directory, verify="full").verified == "full"  # re-recorded after the rebuild
    alter_bytes(ivf.directory / "colbert.faiss")
    with pytest.raises(IndexIntegrityError, match=r"colbert\.faiss: sha256 checksum differs"):
        TokenIndex.load(ivf.directory)

    plaid = rebuild_faiss(TokenIndex.load(ivf.directory, verify="sizes"), "plaid",
                          {"n_centroids": 4, "residual_bits": 2}, progress=False)
    assert {"colbert.centroids.npy", "colbert.codes.npy", "colbert.residuals.npy"} <= set(plaid.meta["files"])
    assert "colbert.faiss" not in plaid.meta["files"]  # removed with the ivf structure
    alter_bytes(plaid.directory / "colbert.centroids.npy", at=data_offset(plaid.directory / "colbert.centroids.npy"))
    with pytest.raises(IndexIntegrityError, match=r"colbert\.centroids\.npy: sha256 checksum differs"):
        TokenIndex.load(plaid.directory)


# -- non-finite numbers -----------------------------------------------------------------------------------------

def test_the_issue_case_nan_bytes_of_the_same_size(tiny_random_colbert, built, queries):
    """Issue 16: "embedding bytes damaged (same size) ... nDCG@10 0.0000 and nothing warns"."""
    write_nan_rows(embeddings_file(built))
    with pytest.raises(IndexIntegrityError, match="checksum differs"):  # checksums on: found at open
        TokenIndex.load(built.directory)
    index = TokenIndex.load(built.directory, verify="sizes")  # checksums off: the numbers must still refuse it
    with pytest.raises(NonFiniteError, match=r"stored vectors of head colbert: \d+ non-finite vectors \(NaN or inf\), "
                                             r"first at row 0; the index is damaged; rebuild it"):
        full_rank(tiny_random_colbert, index, queries, k=5, progress=False)
    with pytest.raises(NonFiniteError, match=r"non-finite scores .* for 4 queries, e.g. 'q0'") as error:
        exact_rank(tiny_random_colbert, index, queries, k=5, progress=False)
    assert str(built.directory) in str(error.value) and "verify='full'" in str(error.value)


def test_nan_rows_found_by_exact_scoring_name_the_queries(tiny_random_colbert, built, queries, corpus):
    """An IVF index keeps its own copy of the vectors, so candidates come out fine; exact scoring of a damaged
    document must then refuse to rank, naming the queries that reached it."""
    index = rebuild_faiss(built, "ivfflat", {"nlist": 2}, progress=False)
    doc = 5
    write_nan_rows(embeddings_file(index), slice(int(index.doc_offsets[doc]), int(index.doc_offsets[doc + 1])))
    index = TokenIndex.load(index.directory, verify="sizes")
    with pytest.raises(NonFiniteError, match=r"non-finite scores .* for \d+ queries"):
        full_rank(tiny_random_colbert, index, queries, k=5, ncandidates=64, progress=False)
    ids, _ = corpus
    candidates = {qid: [ids[doc], ids[0]] for qid in queries}
    with pytest.raises(NonFiniteError, match=r"for 4 queries, e.g. 'q0', 'q1', 'q2', 'q3'"):
        rerank(tiny_random_colbert, index, queries, candidates, k=5, progress=False)
    with pytest.raises(NonFiniteError, match="non-finite scores"):
        exhaustive_scores(tiny_random_colbert, index, queries)


def nan_queries(encoder, bad_positions=(1,)):
    """Make ``encoder`` encode the queries at ``bad_positions`` of each batch to NaN vectors."""
    original = encoder.encode_queries

    def encode_queries(texts):
        batch = original(texts)
        for row in bad_positions:
            if row < len(texts):
                batch.heads["colbert"][row] = float("nan")
        return batch

    encoder.encode_queries = encode_queries


def test_a_model_producing_nan_queries_is_named(tiny_random_colbert, built, queries):
    nan_queries(tiny_random_colbert)
    for search in (lambda: full_rank(tiny_random_colbert, built, queries, k=5, progress=False),
                   lambda: exact_rank(tiny_random_colbert, built, queries, k=5, progress=False)):
        with pytest.raises(NonFiniteError, match=r"encoded 1 queries to non-finite vectors .* e.g. 'q1'.*model "
                                                 r"produces NaN"):
            search()


def test_a_model_producing_nan_documents_stores_nothing(tiny_random_colbert, corpus, tmp_path):
    ids, texts = corpus
    original = tiny_random_colbert.encode
    poisoned = tiny_random_colbert.tokenizer.document_rows([texts[12]])[0]  # document 12's tokens

    def encode(batch, is_query):
        encoded = original(batch, is_query)
        for row, ids in enumerate(batch.input_ids.tolist()):
            if ids[: int(batch.attention_mask[row].sum())] == poisoned:
                encoded.heads["colbert"][row] = float("nan")
        return encoded

    tiny_random_colbert.encode = encode
    with pytest.raises(NonFiniteError, match=r"document vectors \(head colbert\) of documents 10\.\.19.*model "
                                             "produces NaN"):
        build_index(tiny_random_colbert, ids, texts, tmp_path / "idx", chunk_docs=10, batch_size=8, progress=False)
    assert not (tmp_path / "idx").exists()
    assert not list((tmp_path / "idx.tmp-build" / "chunks").glob("chunk-00001.*")), "nothing of chunk 1 stored"
    candidates = {"q": ids[10:14]}
    with pytest.raises(NonFiniteError, match="candidates' document vectors"):
        rerank(tiny_random_colbert, None, {"q": "a query"}, candidates, {d: t for d, t in zip(ids, texts)},
               progress=False)


def test_a_score_function_producing_nan_is_refused(tiny_random_colbert, built, queries):
    original = tiny_random_colbert.score

    def score(q, d):
        scores = original(q, d)
        scores[0, 0] = float("inf")
        return scores

    tiny_random_colbert.score = score
    with pytest.raises(NonFiniteError, match=r"for 1 queries, e.g. 'q0'"):
        exact_rank(tiny_random_colbert, built, queries, k=5, progress=False)
    matrix = np.zeros((2, 3), dtype=np.float32)
    matrix[1, 2] = np.nan
    assert rank_matrix(matrix, ["a", "b"], ["x", "y", "z"], 2, {"a": ["x"], "b": ["x", "y"]})["b"]  # NaN not asked
    with pytest.raises(NonFiniteError, match=r"for 1 queries, e.g. 'b'"):
        rank_matrix(matrix, ["a", "b"], ["x", "y", "z"], 2)


def test_damaged_plaid_centroids_give_an_error_not_a_ranking(tiny_random_colbert, built, queries):
    plaid = rebuild_faiss(built, "plaid", {"n_centroids": 4}, progress=False)
    write_nan_rows(plaid.directory / "colbert.centroids.npy", slice(0, 1))
    index = TokenIndex.load(plaid.directory, verify="sizes")
    with pytest.raises(NonFiniteError, match=r"colbert\.centroids\.npy: 1 non-finite vectors .* damaged"):
        full_rank(tiny_random_colbert, index, queries, k=5, progress=False)


def test_evaluation_settings_carry_the_verify_setting():
    from hil.evaluation.evaluate import EvaluationSettings

    assert EvaluationSettings().verify_index == "auto"
    assert EvaluationSettings(verify_index="full").verify_index == "full"
    with pytest.raises(ValueError, match="verify must be one of"):
        EvaluationSettings(verify_index="yes")


def test_nan_check_survives_a_two_head_sum(hf_tokenizer, tmp_path):
    """A NaN in one head's vectors reaches the model's sum of heads (ColBERT-HIL adds L and H)."""
    from toys import TwoHeadEncoder, make_encoder

    encoder = make_encoder(hf_tokenizer, TwoHeadEncoder)
    ids, texts = toy_corpus(12, seed=1)
    index = build_index(encoder, ids, texts, tmp_path / "two", chunk_docs=6, progress=False)
    write_nan_rows(index.directory / f"{encoder.head_names[1]}.embeddings.npy", slice(0, 3))
    index = TokenIndex.load(index.directory, verify="sizes")
    with pytest.raises(NonFiniteError, match="non-finite scores .* for 1 queries, e.g. 'q'"):
        exact_rank(encoder, index, {"q": texts[0]}, k=3, progress=False)


def test_a_finished_chunk_whose_bytes_changed_is_encoded_again(tiny_random_colbert, corpus, tmp_path, monkeypatch):
    """Chunks outlive a crash on disk; one altered since it was written (same size) is not reused."""
    from hil.retrieval import chunks

    ids, texts = corpus
    clean = build_index(tiny_random_colbert, ids, texts, tmp_path / "clean", chunk_docs=10, batch_size=8,
                        progress=False)
    original, written = chunks._write_chunk, []

    def dying_after_chunk_1(*args, **kwargs):
        meta = original(*args, **kwargs)
        written.append(meta["chunk"])
        if meta["chunk"] == 1:
            raise KeyboardInterrupt("simulated crash")
        return meta

    monkeypatch.setattr(chunks, "_write_chunk", dying_after_chunk_1)
    with pytest.raises(KeyboardInterrupt):
        build_index(tiny_random_colbert, ids, texts, tmp_path / "idx", chunk_docs=10, batch_size=8, progress=False)
    chunk_file = tmp_path / "idx.tmp-build" / "chunks" / "chunk-00000.colbert.npy"
    alter_bytes(chunk_file, at=data_offset(chunk_file))
    written.clear()
    index = build_index(tiny_random_colbert, ids, texts, tmp_path / "idx", chunk_docs=10, batch_size=8,
                        progress=False)
    assert written == [0, 2], "chunk 0 (altered) encoded again, chunk 1 reused, chunk 2 encoded"
    for name in ("colbert.embeddings.npy", "token_ids.npy", "doc_offsets.npy"):
        assert (index.directory / name).read_bytes() == (clean.directory / name).read_bytes()
