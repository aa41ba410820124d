"""Corpus encoding on several processes (Lightning Fabric, ``ddp_spawn``; gloo on CPU) and in reduced precision.

The reference everywhere is a one-process fp32 build of the same corpus: a multi-process build must write the same
index (every array byte for byte, ``index.json`` apart from provenance), a build whose rank is killed must leave
only finished chunks and no index, and its rerun must give the uninterrupted index. Each spawn costs ~15 s on two
busy cores (every rank imports torch, transformers and Lightning), so the module spawns three times in all.
"""

from __future__ import annotations

import copy
import json
import os
import re

import numpy as np
import pytest
import torch

import hil.retrieval.chunks as chunks_module
from hil.modeling.loading import load_encoder
from hil.retrieval.builder import build_index, open_or_build_index
from hil.retrieval.chunks import chunk_paths, discard_unfinished_chunks
from hil.retrieval.corpus_encoding import KILL_RANK_AFTER_FIRST_CHUNK_ENV, check_processes
from hil.retrieval.encoding import eval_mode
from hil.retrieval.index import INDEX_JSON, TokenIndex

from toys import TwoHeadEncoder, assert_same_index, make_encoder, toy_corpus

N_DOCS, CHUNK_DOCS, BATCH = 40, 6, 4  # 7 chunks: ranks 0 / 1 of 2 own chunks 0, 2, 4, 6 / 1, 3, 5
HEADS = ("a", "b")


def build(encoder, directory, **options):
    ids, texts = toy_corpus(N_DOCS)
    return build_index(encoder, ids, texts, directory, chunk_docs=CHUNK_DOCS, batch_size=BATCH, progress=False,
                       **options)


def index_meta(directory) -> dict:
    return json.loads((directory / INDEX_JSON).read_text())


def assert_documents_in_corpus_order(index: TokenIndex, encoder, texts) -> None:
    """Independent of any build: document i's stored tokens are the encoder's output for text i, encoded alone."""
    for i, text in enumerate(texts):
        with eval_mode(encoder):
            batch = encoder.encode_documents([text])
        lo, hi = index.doc_offsets[i], index.doc_offsets[i + 1]
        mask = batch.mask[0]
        np.testing.assert_array_equal(index.token_ids[lo:hi], batch.input_ids[0][mask].numpy())
        for head in HEADS:
            np.testing.assert_allclose(index.embeddings[head][lo:hi].astype(np.float32),
                                       batch.heads[head][0][mask].numpy(), atol=2e-3)


def finished_chunk_numbers(chunks) -> list[int]:
    return sorted(int(re.match(r"chunk-(\d+)\.json$", p.name).group(1)) for p in chunks.glob("chunk-*.json"))


def assert_only_complete_chunks(chunks) -> None:
    """Every file under ``chunks`` belongs to a chunk with metadata, and that chunk's arrays are all there, whole."""
    finished = finished_chunk_numbers(chunks)
    for number in finished:
        paths = chunk_paths(chunks, number, HEADS)
        meta = json.loads(paths["meta"].read_text())
        lengths = np.load(paths["lengths"])
        assert len(lengths) == meta["doc_end"] - meta["doc_start"] and lengths.sum() == meta["n_tokens"]
        assert np.load(paths["token_ids"]).shape == (meta["n_tokens"],)
        for head in HEADS:
            assert np.load(paths[f"emb:{head}"]).shape == (meta["n_tokens"], meta["dims"][head])
    expected = {path.name for number in finished for path in chunk_paths(chunks, number, HEADS).values()}
    assert {p.name for p in chunks.iterdir()} == expected, "files of unfinished chunks were left behind"


@pytest.fixture(scope="module")
def two_heads(hf_tokenizer):
    return make_encoder(hf_tokenizer, TwoHeadEncoder)


@pytest.fixture(scope="module")
def one_process_index(two_heads, tmp_path_factory):
    """The reference: one process, fp32."""
    directory = tmp_path_factory.mktemp("reference") / "idx"
    build(two_heads, directory)
    return directory


# -- several processes ------------------------------------------------------------------------------------------

def test_two_cpu_processes_write_the_one_process_index(two_heads, one_process_index, tmp_path):
    port_before = os.environ.get("MASTER_PORT")
    index = build(two_heads, tmp_path / "idx", processes=2)
    assert_same_index(tmp_path / "idx", one_process_index)
    assert_documents_in_corpus_order(index, two_heads, toy_corpus(N_DOCS)[1])
    assert index_meta(tmp_path / "idx")["encoded_on"] == {"device": "cpu", "processes": 2}
    assert index.n_docs == N_DOCS and not (tmp_path / "idx.tmp-build").exists()
    assert os.environ.get("MASTER_PORT") == port_before, "the launcher's port must not stick to this process"


def test_a_killed_rank_fails_cleanly_and_its_rerun_reuses_finished_chunks(two_heads, one_process_index, tmp_path,
                                                                          monkeypatch):
    """A rank killed hard: one clear error, no index folder, only whole chunks left; the rerun (here on one
    process, checked to encode only what is missing) writes the uninterrupted index."""
    directory = tmp_path / "idx"
    chunks = tmp_path / "idx.tmp-build" / "chunks"
    chunks.mkdir(parents=True)  # what an earlier attempt may have left half written: must be gone after a failure
    (chunks / "chunk-00005.a.npy").write_bytes(b"arrays of a chunk without metadata")
    (chunks / ".chunk-00003.b.npy.999.tmp").write_bytes(b"a temporary file")
    monkeypatch.setenv(KILL_RANK_AFTER_FIRST_CHUNK_ENV, "1")  # rank 1 dies (SIGKILL) right after chunk 1
    with pytest.raises(RuntimeError, match=r"2 cpu processes failed: .*process 1 terminated with signal SIGKILL"):
        build(two_heads, directory, processes=2)
    monkeypatch.delenv(KILL_RANK_AFTER_FIRST_CHUNK_ENV)
    assert not directory.exists(), "no index (finished or half) under the final name"
    assert_only_complete_chunks(chunks)
    finished = finished_chunk_numbers(chunks)
    assert 1 in finished and 3 not in finished and 5 not in finished, finished
    for number in finished:  # round robin: chunk n is rank n % 2's, and no other rank wrote it
        assert json.loads(chunk_paths(chunks, number, HEADS)["meta"].read_text())["rank"] == number % 2

    written = []
    original = chunks_module._write_chunk

    def counting(encoder, texts, paths, *args, **kwargs):
        written.append(int(paths["meta"].name[6:11]))
        return original(encoder, texts, paths, *args, **kwargs)

    monkeypatch.setattr(chunks_module, "_write_chunk", counting)
    build(two_heads, directory)  # the rerun may use any number of processes: chunks do not depend on it
    assert sorted(written) == sorted(set(range(7)) - set(finished)), "finished chunks are reused, the rest encoded"
    assert_same_index(directory, one_process_index)
    assert not (tmp_path / "idx.tmp-build").exists()


def test_a_chunk_interrupted_while_written_is_not_finished(two_heads, tmp_path, monkeypatch):
    """The metadata is written last: a writer dying between a chunk's files leaves it unfinished, and the files
    of unfinished chunks are what a failed multi-process build removes."""
    saved = []
    original = chunks_module.save_npy_atomic

    def dying_in_chunk_1(path, array):
        if path.name.startswith("chunk-00001."):
            if saved:
                raise KeyboardInterrupt("simulated death between two files of chunk 1")
            saved.append(path.name)
        return original(path, array)

    monkeypatch.setattr(chunks_module, "save_npy_atomic", dying_in_chunk_1)
    with pytest.raises(KeyboardInterrupt):
        build(two_heads, tmp_path / "idx")
    chunks = tmp_path / "idx.tmp-build" / "chunks"
    assert finished_chunk_numbers(chunks) == [0] and (chunks / saved[0]).is_file()
    (chunks / ".chunk-00001.b.npy.123.tmp").write_bytes(b"half")
    assert sorted(discard_unfinished_chunks(chunks)) == sorted([saved[0], ".chunk-00001.b.npy.123.tmp"])
    assert_only_complete_chunks(chunks)


def test_quantized_views_are_built_in_every_rank(two_heads, tmp_path):
    """Each rank builds the ``quantize`` view from its own copy (ONNX sessions and compiled graphs cannot be
    pickled); int8 is the cheap mode to check: the same index as one process."""
    build(two_heads, tmp_path / "one", quantize="int8")
    build(two_heads, tmp_path / "two", quantize="int8", processes=2)
    assert_same_index(tmp_path / "two", tmp_path / "one")
    assert index_meta(tmp_path / "two")["document_encoding"]["quantize"] == "int8"


def test_impossible_requests_are_refused_before_any_work(two_heads, tmp_path):
    for options, message in [({"processes": 0}, "processes must be >= 1"),
                             ({"precision": "fp16"}, "needs a GPU"),
                             ({"precision": "fp64"}, "not one of fp32, fp16, bf16"),
                             ({"precision": "bf16", "quantize": "int8"}, "pass precision='fp32'"),
                             ({"quantize": "int4"}, "quantize must be one of")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            build(two_heads, tmp_path / "idx", **options)
    with pytest.raises(ValueError, match="one process per GPU"):
        check_processes(64, torch.device("cuda"))
    with pytest.raises(ValueError, match="runs on"):
        check_processes(2, torch.device("mps"))
    assert not (tmp_path / "idx.tmp-build").exists() and not (tmp_path / "idx").exists()


# -- precision --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bert(tiny_model_dir):
    torch.manual_seed(0)  # the untrained ColBERT head
    return load_encoder(tiny_model_dir)


def test_bf16_is_recorded_close_to_fp32_and_rebuilds(tiny_bert, tmp_path):
    ids, texts = toy_corpus(N_DOCS)
    fp32 = open_or_build_index(tiny_bert, ids, texts, tmp_path / "idx", chunk_docs=CHUNK_DOCS, progress=False)
    assert index_meta(tmp_path / "idx")["encoding_precision"] == "fp32"
    vectors32 = np.array(fp32.embeddings["colbert"], dtype=np.float32)

    bf16 = open_or_build_index(tiny_bert, ids, texts, tmp_path / "idx", chunk_docs=CHUNK_DOCS, progress=False,
                               precision="bf16")
    assert index_meta(tmp_path / "idx")["encoding_precision"] == "bf16"
    vectors16 = np.array(bf16.embeddings["colbert"], dtype=np.float32)
    np.testing.assert_array_equal(bf16.doc_offsets, fp32.doc_offsets)
    cosine = (vectors16 * vectors32).sum(1) / np.linalg.norm(vectors16, axis=1) / np.linalg.norm(vectors32, axis=1)
    assert not np.array_equal(vectors16, vectors32), "bf16 autocast did not change the arithmetic"
    assert cosine.min() > 0.99, cosine.min()

    meta = index_meta(tmp_path / "idx")
    open_or_build_index(tiny_bert, ids, texts, tmp_path / "idx", progress=False, precision="bf16")
    assert index_meta(tmp_path / "idx") == meta, "same precision: reused"

    meta.pop("encoding_precision")  # an index from before precision was recorded: fp32
    meta["created"] = "before precision was recorded"
    (tmp_path / "idx" / INDEX_JSON).write_text(json.dumps(meta))
    open_or_build_index(tiny_bert, ids, texts, tmp_path / "idx", progress=False)
    assert index_meta(tmp_path / "idx") == meta, "a key-less index counts as fp32: reused for fp32"
    open_or_build_index(tiny_bert, ids, texts, tmp_path / "idx", progress=False, precision="bf16")
    assert index_meta(tmp_path / "idx")["encoding_precision"] == "bf16", "a key-less index counts as fp32"


def test_chunks_of_another_precision_are_not_reused(tiny_bert, tmp_path, monkeypatch):
    ids, texts = toy_corpus(N_DOCS)
    clean = build_index(tiny_bert, ids, texts, tmp_path / "clean", chunk_docs=CHUNK_DOCS, progress=False,
                        precision="bf16")
    original = chunks_module._write_chunk

    def dying_after_chunk_0(encoder, chunk_texts, paths, *args, **kwargs):
        if not paths["meta"].name.startswith("chunk-00000"):
            raise KeyboardInterrupt("simulated crash")
        return original(encoder, chunk_texts, paths, *args, **kwargs)

    monkeypatch.setattr(chunks_module, "_write_chunk", dying_after_chunk_0)
    with pytest.raises(KeyboardInterrupt):
        build_index(tiny_bert, ids, texts, tmp_path / "idx", chunk_docs=CHUNK_DOCS, progress=False)  # fp32
    monkeypatch.setattr(chunks_module, "_write_chunk", original)
    mixed = build_index(tiny_bert, ids, texts, tmp_path / "idx", chunk_docs=CHUNK_DOCS, progress=False,
                        precision="bf16")
    np.testing.assert_array_equal(mixed.embeddings["colbert"], clean.embeddings["colbert"])


# -- GPUs -------------------------------------------------------------------------------------------------------

def assert_close_index(index: TokenIndex, reference: TokenIndex, min_cosine: float) -> None:
    assert index.doc_ids == reference.doc_ids
    np.testing.assert_array_equal(index.doc_offsets, reference.doc_offsets)
    np.testing.assert_array_equal(index.token_ids, reference.token_ids)
    for head, vectors in reference.embeddings.items():
        a, b = np.asarray(index.embeddings[head], np.float32), np.asarray(vectors, np.float32)
        cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        assert cosine.min() > min_cosine, (head, cosine.min())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_build_equals_the_cpu_build(tiny_bert, tmp_path):
    ids, texts = toy_corpus(N_DOCS)
    cpu = build_index(tiny_bert, ids, texts, tmp_path / "cpu", chunk_docs=CHUNK_DOCS, progress=False)
    gpu_encoder = copy.deepcopy(tiny_bert).to("cuda")
    gpu = build_index(gpu_encoder, ids, texts, tmp_path / "gpu", chunk_docs=CHUNK_DOCS, progress=False)
    assert index_meta(tmp_path / "gpu")["encoded_on"] == {"device": "cuda:0", "processes": 1}
    assert_close_index(gpu, cpu, 0.999)
    fp16 = build_index(gpu_encoder, ids, texts, tmp_path / "fp16", chunk_docs=CHUNK_DOCS, progress=False,
                       precision="fp16")
    assert_close_index(fp16, cpu, 0.99)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_equal_the_cpu_build(tiny_bert, tmp_path):
    ids, texts = toy_corpus(N_DOCS)
    cpu = build_index(tiny_bert, ids, texts, tmp_path / "cpu", chunk_docs=CHUNK_DOCS, progress=False)
    gpu_encoder = copy.deepcopy(tiny_bert).to("cuda")
    gpus = build_index(gpu_encoder, ids, texts, tmp_path / "gpus", chunk_docs=CHUNK_DOCS, progress=False,
                       processes=2)
    assert index_meta(tmp_path / "gpus")["encoded_on"] == {"device": "cuda", "processes": 2}
    assert_close_index(gpus, cpu, 0.999)
    assert next(gpu_encoder.parameters()).device.type == "cuda", "the caller's encoder stays on its GPU"
