"""Issue 24 item 3: every document tokenized once, in loader workers ahead of the encoder, and each rank of a
multi-process build reading only its own chunks' texts from disk.

References written here, apart from the code under test: ColBERT's document rows built by hand from the Hugging
Face tokenizer; the build before this change (each chunk tokenized to sort it by length, then every batch
tokenized again from its texts through ``encoder.encode_documents``), whose vectors the index must hold byte for
byte; the byte ranges of each rank's chunks, computed from the texts.
"""

from __future__ import annotations

import pickle
import string

import lightning_fabric
import numpy as np
import pytest
import torch

from hil.modeling.loading import load_encoder
from hil.retrieval.builder import build_index
from hil.retrieval.chunks import chunk_ranges
from hil.retrieval.corpus_texts import OFFSETS_NAME, TEXTS_NAME, CorpusTextsFile, write_corpus_texts
from hil.retrieval.encoding import eval_mode, sorted_document_batches
from hil.retrieval.token_loader import TokenizedChunk, tokenized_chunks

from toys import assert_same_index, make_encoder, toy_corpus

N_DOCS, CHUNK_DOCS, BATCH = 45, 10, 4  # 5 chunks (the last of 5 documents); rank 0 of 2 owns 0, 2, 4


def corpus() -> tuple[list[str], list[str]]:
    """Toy texts with commas (punctuation masked from scoring), ties in length, and a few long enough to be cut at
    ``doc_maxlen``; non-ASCII text on the way through the texts file."""
    ids, texts = toy_corpus(N_DOCS, commas=True)
    for i in (3, 17, 30):
        texts[i] = " ".join([texts[i]] * 12)  # far beyond doc_maxlen
    texts[8] = "Ünïcodé naïve café — 3.14, co-operation [x]"
    return ids, texts


@pytest.fixture(scope="module")
def tiny_bert(tiny_model_dir):
    torch.manual_seed(0)  # the untrained ColBERT head
    return load_encoder(tiny_model_dir, doc_maxlen=24)


def hand_rows(hf_tokenizer, texts, doc_maxlen: int) -> list[list[int]]:
    """[CLS] [unused1] body [SEP], the body cut to doc_maxlen - 3 tokens, from the Hugging Face tokenizer alone."""
    marker = hf_tokenizer.convert_tokens_to_ids("[unused1]")
    rows = []
    for text in texts:
        body = hf_tokenizer.encode(text, add_special_tokens=False)[: doc_maxlen - 3]
        rows.append([hf_tokenizer.cls_token_id, marker, *body, hf_tokenizer.sep_token_id])
    return rows


def test_sorted_batches_are_hand_tokenized_rows_longest_first(tiny_bert, hf_tokenizer):
    _, texts = corpus()
    tokenized = sorted_document_batches(tiny_bert.tokenizer, texts, BATCH)
    rows = hand_rows(hf_tokenizer, texts, 24)
    lengths = [len(row) for row in rows]
    expected_order = sorted(range(len(texts)), key=lambda i: (-lengths[i], i))  # longest first, ties in input order
    assert tokenized.order.tolist() == expected_order
    assert max(lengths) == 24 and len(set(lengths)) < len(lengths), "truncation and ties are both exercised"
    punctuation = {hf_tokenizer.convert_tokens_to_ids(c) for c in string.punctuation}
    for number, batch in enumerate(tokenized.batches):
        members = expected_order[number * BATCH: (number + 1) * BATCH]
        width = max(lengths[i] for i in members)
        assert batch.input_ids.shape == (len(members), width) and batch.input_ids.dtype == torch.long
        for row, i in enumerate(members):
            padded = rows[i] + [hf_tokenizer.pad_token_id] * (width - lengths[i])
            assert batch.input_ids[row].tolist() == padded
            assert batch.attention_mask[row].tolist() == [1] * lengths[i] + [0] * (width - lengths[i])
            scored = [j < lengths[i] and padded[j] not in punctuation for j in range(width)]
            assert batch.scoring_mask[row].tolist() == scored
    assert sum(len(b) for b in tokenized.batches) == len(texts)


def test_a_packed_chunk_gives_back_the_same_batches(tiny_bert):
    _, texts = corpus()
    tokenized = sorted_document_batches(tiny_bert.tokenizer, texts[:23], BATCH)
    packed = pickle.loads(pickle.dumps(TokenizedChunk.pack((7, 70, 93), tokenized)))  # what a worker sends
    assert (packed.number, packed.start, packed.end) == (7, 70, 93)
    unpacked = packed.sorted_batches()
    np.testing.assert_array_equal(unpacked.order, tokenized.order)
    assert len(unpacked.batches) == len(tokenized.batches)
    for got, expected in zip(unpacked.batches, tokenized.batches):
        for field in ("input_ids", "attention_mask", "scoring_mask"):
            a, b = getattr(got, field), getattr(expected, field)
            assert a.dtype == b.dtype and torch.equal(a, b), field


def test_workers_yield_the_chunks_in_the_order_given(tiny_bert):
    _, texts = corpus()
    chunks = [(number, start, end) for number, start, end in chunk_ranges(len(texts), CHUNK_DOCS)][::-1]
    for workers in (0, 2):
        got = list(tokenized_chunks(tiny_bert.tokenizer, texts, chunks, batch_size=BATCH, workers=workers))
        assert [(c.number, c.start, c.end) for c in got] == chunks
        for chunk in got:
            expected = sorted_document_batches(tiny_bert.tokenizer, texts[chunk.start: chunk.end], BATCH)
            np.testing.assert_array_equal(chunk.order, expected.order)
            assert all(torch.equal(a.input_ids, b.input_ids)
                       for a, b in zip(chunk.sorted_batches().batches, expected.batches))


class CountingTokenizer:
    """Stands in for the Hugging Face tokenizer and counts the texts it tokenizes."""

    def __init__(self, inner):
        self.inner, self.texts = inner, 0

    def __call__(self, texts, **kwargs):
        self.texts += len(texts)
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def text_path_index_arrays(encoder, texts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The build before tokenizing once, written out: per chunk, every text tokenized to sort the chunk by length
    (stable, longest first), then each batch of texts through ``encode_documents``; scored tokens back in input
    order; fp16. -> (vectors, token ids, doc offsets)."""
    vectors, ids, lengths = [], [], []
    with eval_mode(encoder):
        for _, start, end in chunk_ranges(len(texts), CHUNK_DOCS):
            chunk = texts[start:end]
            order = np.argsort(-encoder.tokenizer.encode_documents(chunk).attention_mask.sum(1).numpy(),
                               kind="stable")
            per_doc = {}
            for first in range(0, len(chunk), BATCH):
                rows = order[first: first + BATCH]
                batch = encoder.encode_documents([chunk[i] for i in rows])
                for row, i in enumerate(rows):
                    mask = batch.mask[row]
                    per_doc[i] = (batch.heads["colbert"][row][mask].float().numpy().astype(np.float16),
                                  batch.input_ids[row][mask].numpy().astype(np.int32))
            for i in range(len(chunk)):
                vectors.append(per_doc[i][0])
                ids.append(per_doc[i][1])
                lengths.append(len(per_doc[i][1]))
    return np.concatenate(vectors), np.concatenate(ids), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def build(encoder, directory, **options):
    ids, texts = corpus()
    return build_index(encoder, ids, texts, directory, chunk_docs=CHUNK_DOCS, batch_size=BATCH, progress=False,
                       **options)


@pytest.fixture(scope="module")
def reference_index(tiny_bert, tmp_path_factory):
    """One process, tokenized in this process (tokenizer_workers=0)."""
    directory = tmp_path_factory.mktemp("reference") / "idx"
    build(tiny_bert, directory)
    return directory


def test_the_index_holds_the_text_path_vectors_byte_for_byte(tiny_bert, reference_index):
    _, texts = corpus()
    vectors, token_ids, offsets = text_path_index_arrays(tiny_bert, texts)
    stored = np.load(reference_index / "colbert.embeddings.npy")
    assert stored.dtype == np.float16 and stored.tobytes() == vectors.tobytes()
    np.testing.assert_array_equal(np.load(reference_index / "token_ids.npy"), token_ids)
    np.testing.assert_array_equal(np.load(reference_index / "doc_offsets.npy"), offsets)


@pytest.mark.parametrize("workers", [1, 2])
def test_loader_workers_write_the_same_index(workers, tiny_bert, reference_index, tmp_path):
    build(tiny_bert, tmp_path / "idx", tokenizer_workers=workers)
    assert_same_index(tmp_path / "idx", reference_index)


def test_every_document_is_tokenized_once(hf_tokenizer, tmp_path):
    encoder = make_encoder(hf_tokenizer)
    counting = CountingTokenizer(encoder.tokenizer.tokenizer)
    encoder.tokenizer.tokenizer = counting
    build(encoder, tmp_path / "idx")
    assert counting.texts == N_DOCS


def test_bad_tokenizer_workers_are_refused_before_any_work(tiny_bert, tmp_path):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="tokenizer_workers must be an integer >= 0"):
            build(tiny_bert, tmp_path / "idx", tokenizer_workers=bad)
    assert not (tmp_path / "idx.tmp-build").exists()


# -- the corpus's texts on disk -----------------------------------------------------------------------------------

def test_texts_come_back_from_disk_as_written(tmp_path):
    texts = ["plain", "", "Ünïcodé — 東京", "line\nbreak\tand tab\r", "lone \ud800 surrogate", "x" * 5000, ""]
    written = write_corpus_texts(iter(texts), tmp_path)
    assert len(written) == len(texts)
    assert written[0:len(texts)] == texts and written[:] == texts
    assert [written[i] for i in range(len(texts))] == texts and written[-3] == texts[-3]
    assert written[2:5] == texts[2:5] and written[5:5] == [] and written[6:100] == texts[6:]
    assert written[::2] == texts[::2]
    with pytest.raises(IndexError):
        written[len(texts)]
    copy = pickle.loads(pickle.dumps(written))
    assert len(pickle.dumps(written)) < 500, "a path on the wire, not the texts"
    assert copy[1:4] == texts[1:4]
    (tmp_path / TEXTS_NAME).write_bytes(b"short")
    with pytest.raises(ValueError, match="does not describe"):
        len(CorpusTextsFile(tmp_path))
    written.remove()
    assert not (tmp_path / TEXTS_NAME).exists() and not (tmp_path / OFFSETS_NAME).exists()


class InProcessFabric:
    """Fabric's ``ddp_spawn`` launch played in this process, rank after rank: each rank gets its own unpickled
    copy of the job, as a spawned process would; the file reads of the rank at work are recorded."""

    sent: list[bytes] = []
    rank: int | None = None

    def __init__(self, accelerator, devices, strategy):
        assert strategy == "ddp_spawn"
        self.world_size, self.device = devices, torch.device(accelerator)

    def launch(self, function, job):
        wire = pickle.dumps(job)
        InProcessFabric.sent.append(wire)
        results = []
        for rank in range(self.world_size):
            self.global_rank = InProcessFabric.rank = rank
            results.append(function(self, pickle.loads(wire)))
        InProcessFabric.rank = None
        return results[0]


@pytest.fixture
def in_process_fabric(monkeypatch):
    threads = torch.get_num_threads()
    InProcessFabric.sent = []
    monkeypatch.setattr(lightning_fabric, "Fabric", InProcessFabric)
    reads: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    original = CorpusTextsFile._read

    def recording(self, begin, end):
        reads[InProcessFabric.rank].append((begin, end))
        return original(self, begin, end)

    monkeypatch.setattr(CorpusTextsFile, "_read", recording)
    yield reads
    torch.set_num_threads(threads)


def test_each_rank_reads_only_its_own_chunks_from_disk(tiny_bert, reference_index, in_process_fabric, tmp_path):
    reads = in_process_fabric
    ids, texts = corpus()
    build(tiny_bert, tmp_path / "idx", processes=2)
    assert_same_index(tmp_path / "idx", reference_index)

    (wire,) = InProcessFabric.sent
    # The ranks get no corpus texts (only the first 32, the calibration documents of a quantized encoding).
    assert not [i for i in range(32, N_DOCS) if texts[i].encode() in wire]
    sizes = np.concatenate([[0], np.cumsum([len(t.encode("utf-8")) for t in texts])])
    for rank in (0, 1):
        expected = [(int(sizes[start]), int(sizes[end]))
                    for number, start, end in chunk_ranges(N_DOCS, CHUNK_DOCS) if number % 2 == rank]
        assert reads[rank] == expected, f"rank {rank} read {reads[rank]}, its chunks are {expected}"


def test_a_failed_rank_leaves_no_texts_file(tiny_bert, in_process_fabric, tmp_path, monkeypatch):
    import hil.retrieval.corpus_encoding as corpus_encoding

    original = corpus_encoding.encode_shard

    def failing(job, device, rank=0, world=1, on_written=None):
        if rank == 1:
            raise MemoryError("rank 1 ran out of memory")
        return original(job, device, rank, world, on_written)

    monkeypatch.setattr(corpus_encoding, "encode_shard", failing)
    with pytest.raises(RuntimeError, match="rank 1 ran out of memory"):
        build(tiny_bert, tmp_path / "idx", processes=2)
    chunks = tmp_path / "idx.tmp-build" / "chunks"
    assert sorted(p.name for p in chunks.glob("chunk-*.json")) == ["chunk-00000.json", "chunk-00002.json",
                                                                  "chunk-00004.json"]
    assert not (chunks / TEXTS_NAME).exists() and not (chunks / OFFSETS_NAME).exists()


@pytest.mark.slow
def test_two_spawned_ranks_with_loader_workers_write_the_one_process_index(tiny_bert, reference_index, tmp_path):
    """The real thing: two CPU ranks started by Fabric, each tokenizing in a loader worker of its own."""
    build(tiny_bert, tmp_path / "idx", processes=2, tokenizer_workers=1)
    assert_same_index(tmp_path / "idx", reference_index)


@pytest.mark.integration
def test_evaluation_settings_pass_tokenizer_workers_to_the_build(tiny_model_dir, tmp_path, monkeypatch):
    """EvaluationSettings(tokenizer_workers=N) reaches build_index (and the index is the 0-worker one); a negative
    count is refused."""
    from hil.data.beir import load_beir
    from hil.errors import UserError
    from hil.evaluation import evaluate as evaluation
    from hil.evaluation.evaluate import EvaluationSettings, document_store
    from hil.modeling.loading import load_encoder

    with pytest.raises(UserError, match="tokenizer_workers"):
        EvaluationSettings(tokenizer_workers=-1)
    seen = []
    original = evaluation.open_or_build_index

    def spy(*args, **kwargs):
        seen.append(kwargs.get("tokenizer_workers"))
        return original(*args, **kwargs)

    monkeypatch.setattr(evaluation, "open_or_build_index", spy)
    torch.manual_seed(0)
    encoder = load_encoder(str(tiny_model_dir), dim=8)
    dataset = load_beir("scifact").subset(3, 40, seed=0)
    indexes = {}
    for workers in (0, 1):
        settings = EvaluationSettings(index_root=str(tmp_path / str(workers)), tokenizer_workers=workers,
                                      progress=False)
        indexes[workers] = document_store(encoder, dataset, settings).directory
    assert seen == [0, 1]
    for path in sorted(indexes[0].glob("*.npy")):
        assert path.read_bytes() == (indexes[1] / path.name).read_bytes(), path.name
