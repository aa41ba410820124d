"""The host-side work of an index build that a GPU build waits for (issue 29): the inverted file, the join of the
chunks, the finite check of stored vectors, and read-only arrays handed to torch. Each against an obvious reference
(loops, ``np.concatenate``, ``np.isfinite``), on the fast path and on every fallback.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.retrieval import chunks as chunks_module
from hil.retrieval import integrity
from hil.retrieval.chunks import chunk_paths, join_chunks
from hil.retrieval.devices import host_tensor, upload_rows
from hil.retrieval.index import DOC_OFFSETS_NPY, TOKEN_IDS_NPY, embeddings_path
from hil.retrieval.integrity import NonFiniteError, _all_finite, check_finite_vectors
from hil.retrieval.plaid import build_ivf

# -- the inverted file ---------------------------------------------------------------------------------------------

def ivf_by_loops(codes: np.ndarray, doc_offsets: np.ndarray, n_centroids: int) -> list[list[int]]:
    return [sorted({d for d in range(len(doc_offsets) - 1)
                    for t in range(doc_offsets[d], doc_offsets[d + 1]) if codes[t] == c})
            for c in range(n_centroids)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=25), st.integers(1, 12), st.integers(0, 10_000),
       st.sampled_from([np.uint16, np.int32]))
def test_ivf_equals_loops_for_both_code_types(lengths, n_centroids, seed, code_type):
    """uint16 codes (up to 65,536 centroids: a radix sort) and int32 codes (MS MARCO's 2^18), empty documents,
    centroids without tokens, a document repeating a centroid."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    codes = np.random.default_rng(seed).integers(0, n_centroids, size=int(offsets[-1])).astype(code_type)
    ivf_offsets, ivf_docs = build_ivf(codes, offsets, n_centroids)
    assert ivf_offsets.dtype == np.int64 and ivf_docs.dtype == np.int32
    assert ivf_offsets[0] == 0 and ivf_offsets[-1] == len(ivf_docs)
    got = [ivf_docs[ivf_offsets[c]: ivf_offsets[c + 1]].tolist() for c in range(n_centroids)]
    assert got == ivf_by_loops(codes, offsets, n_centroids)


def test_ivf_of_a_document_that_repeats_a_centroid_lists_it_once():
    codes = np.array([2, 0, 2, 2, 1, 2], dtype=np.uint16)  # doc 0: tokens 0..3, doc 1: tokens 4..5
    ivf_offsets, ivf_docs = build_ivf(codes, np.array([0, 4, 6]), 3)
    assert ivf_offsets.tolist() == [0, 1, 2, 4]
    assert ivf_docs.tolist() == [0, 1, 0, 1]


# -- joining the chunks --------------------------------------------------------------------------------------------

def write_chunks(folder, heads=("colbert",), dim=4, sizes=((0, 3, 5), (1, 2, 0), (2, 4, 7)), vector_type=np.float16,
                 seed=0):
    """Chunks as encoding writes them: per chunk, (number, documents, tokens); -> the metas and the arrays."""
    rng = np.random.default_rng(seed)
    metas, arrays = [], {f"emb:{h}": [] for h in heads} | {"token_ids": [], "lengths": []}
    start = 0
    for number, n_docs, n_tokens in sizes:
        cut = np.sort(rng.integers(0, n_tokens + 1, size=n_docs - 1)) if n_docs else np.zeros(0, dtype=int)
        lengths = np.diff(np.concatenate([[0], cut, [n_tokens]])).astype(np.int64) if n_docs else np.zeros(0, np.int64)
        paths = chunk_paths(folder, number, heads)
        for head in heads:
            vectors = rng.standard_normal((n_tokens, dim)).astype(vector_type)
            np.save(paths[f"emb:{head}"], vectors)
            arrays[f"emb:{head}"].append(vectors)
        ids = rng.integers(0, 30_000, size=n_tokens).astype(np.int32)
        np.save(paths["token_ids"], ids)
        np.save(paths["lengths"], lengths)
        arrays["token_ids"].append(ids)
        arrays["lengths"].append(lengths)
        metas.append({"chunk": number, "doc_start": start, "doc_end": start + n_docs, "n_tokens": n_tokens,
                      "dims": {h: dim for h in heads}})
        start += n_docs
    return metas, arrays


def assert_joined(target, heads, arrays):
    for head in heads:
        joined = np.load(embeddings_path(target, head))
        assert joined.dtype == np.float16
        np.testing.assert_array_equal(joined, np.concatenate(arrays[f"emb:{head}"]).astype(np.float16))
    ids = np.load(target / TOKEN_IDS_NPY)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, np.concatenate(arrays["token_ids"]))
    lengths = np.concatenate(arrays["lengths"])
    np.testing.assert_array_equal(np.load(target / DOC_OFFSETS_NPY), np.concatenate([[0], np.cumsum(lengths)]))


@pytest.mark.parametrize("heads", [("colbert",), ("colbert", "lexical")])
def test_joined_files_are_the_chunks_one_after_another(tmp_path, heads):
    (tmp_path / "chunks").mkdir()
    metas, arrays = write_chunks(tmp_path / "chunks", heads=heads)
    (tmp_path / "index").mkdir()
    assert join_chunks(tmp_path / "chunks", tmp_path / "index", heads, metas) == 12
    assert_joined(tmp_path / "index", heads, arrays)


def test_join_without_copy_file_range(tmp_path, monkeypatch):
    """Systems without the call (macOS) write through numpy: the same files."""
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    (tmp_path / "chunks").mkdir()
    metas, arrays = write_chunks(tmp_path / "chunks")
    (tmp_path / "index").mkdir()
    join_chunks(tmp_path / "chunks", tmp_path / "index", ("colbert",), metas)
    assert_joined(tmp_path / "index", ("colbert",), arrays)


@pytest.mark.parametrize("failure", ["refused", "part-way", "short"])
def test_join_when_the_kernel_copy_fails(tmp_path, monkeypatch, failure):
    """A file system refusing the call at once, after copying part of a chunk, or reporting end of file early:
    the chunk is written again through numpy from its start, and no byte of another chunk moves."""
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range on this system")
    real = os.copy_file_range
    calls = []

    def flaky(src, dst, count, offset_src, offset_dst):
        calls.append(count)
        if failure == "refused":
            raise OSError(95, "Operation not supported")
        if failure == "short" and len(calls) % 2 == 0:
            return 0
        if len(calls) % 2 == 0:
            raise OSError(18, "Invalid cross-device link")
        return real(src, dst, max(1, count // 2), offset_src, offset_dst)  # half, then the caller asks again

    monkeypatch.setattr(os, "copy_file_range", flaky)
    (tmp_path / "chunks").mkdir()
    metas, arrays = write_chunks(tmp_path / "chunks", dim=16, sizes=((0, 3, 50), (1, 4, 70)))
    (tmp_path / "index").mkdir()
    join_chunks(tmp_path / "chunks", tmp_path / "index", ("colbert",), metas)
    assert calls
    assert_joined(tmp_path / "index", ("colbert",), arrays)


def test_join_converts_chunks_of_another_type(tmp_path, monkeypatch):
    """Chunk vectors in fp32 (another writer) are converted, not copied as bytes."""
    copies = []
    if hasattr(os, "copy_file_range"):
        real = os.copy_file_range
        monkeypatch.setattr(os, "copy_file_range", lambda *args: copies.append(args) or real(*args))
    (tmp_path / "chunks").mkdir()
    metas, arrays = write_chunks(tmp_path / "chunks", vector_type=np.float32)
    (tmp_path / "index").mkdir()
    join_chunks(tmp_path / "chunks", tmp_path / "index", ("colbert",), metas)
    assert_joined(tmp_path / "index", ("colbert",), arrays)
    assert len(copies) <= len(metas)  # token ids only: the vectors went through numpy


def test_join_takes_the_kernel_path_here(tmp_path, monkeypatch):
    """On Linux the fp16 vectors and token ids move by ``copy_file_range``, not through numpy (the speed-up)."""
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range on this system")
    through_numpy = []
    real = np.ascontiguousarray
    monkeypatch.setattr(chunks_module.np, "ascontiguousarray",
                        lambda *args, **kwargs: through_numpy.append(1) or real(*args, **kwargs))
    (tmp_path / "chunks").mkdir()
    metas, arrays = write_chunks(tmp_path / "chunks")
    (tmp_path / "index").mkdir()
    join_chunks(tmp_path / "chunks", tmp_path / "index", ("colbert",), metas)
    monkeypatch.undo()
    assert through_numpy == []
    assert_joined(tmp_path / "index", ("colbert",), arrays)


# -- the finite check of fp16 vectors ------------------------------------------------------------------------------

def test_fp16_bit_test_agrees_with_isfinite_on_every_bit_pattern():
    """The fast test on its own (``check_finite_vectors`` re-checks a table it calls non-finite, so a test that is
    wrong that way would only be slow; one wrong the other way would let a NaN through): all 65,536 patterns."""
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    expected = np.isfinite(patterns.astype(np.float32))
    got = np.array([_all_finite(patterns[i: i + 1]) for i in range(len(patterns))])
    np.testing.assert_array_equal(got, expected)
    assert _all_finite(patterns[expected]) and not _all_finite(patterns[~expected])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=64), st.integers(1, 4))
def test_finite_check_of_fp16_bits_agrees_with_isfinite(bits, dim):
    """Every fp16 bit pattern (NaNs of any payload, +-inf, +-65504, subnormals, -0): refused exactly when
    ``np.isfinite`` says a row is not finite, naming the first such row."""
    rows = len(bits) // dim or 1
    values = np.array((bits * dim)[: rows * dim], dtype=np.uint16).view(np.float16).reshape(rows, dim)
    bad_rows = np.flatnonzero(~np.isfinite(values.astype(np.float32)).all(axis=1))
    if len(bad_rows) == 0:
        check_finite_vectors(values, "v", "advice", first_row=10)
    else:
        with pytest.raises(NonFiniteError, match=rf"{len(bad_rows)} non-finite vectors .* first at row "
                                                 rf"{10 + bad_rows[0]};"):
            check_finite_vectors(values, "v", "advice", first_row=10)


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.parametrize("position", [(0, 0), (1, 31), (3217, 31), (4999, 31)])
def test_finite_check_finds_one_bad_value_in_a_large_fp16_table(special, block, position, monkeypatch):
    """Wherever the bad value sits: first or last of a block of the bit test (blocks of 64 values: row 1's last
    value ends the fourth), or of the table."""
    if block:
        monkeypatch.setattr(integrity, "_FINITE_BLOCK", block)
    values = np.random.default_rng(0).standard_normal((5000, 32)).astype(np.float16)
    values[0, 1], values[-1, 0] = 65504, -65504  # the largest finite fp16 values
    check_finite_vectors(values, "v", "a")
    check_finite_vectors(values[:, ::2], "v", "a")  # a strided view
    values[position] = special
    with pytest.raises(NonFiniteError, match=f"1 non-finite vectors .* first at row {position[0]};"):
        check_finite_vectors(values, "v", "a")
    if position[1] % 2 == 0:
        with pytest.raises(NonFiniteError, match=f"first at row {position[0]};"):
            check_finite_vectors(values[:, ::2], "v", "a")


# -- read-only arrays into torch -----------------------------------------------------------------------------------

def test_host_tensor_of_a_read_only_memmap_shares_it_without_a_warning(tmp_path):
    array = np.arange(24, dtype=np.float16).reshape(6, 4)
    np.save(tmp_path / "a.npy", array)
    mapped = np.load(tmp_path / "a.npy", mmap_mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = host_tensor(mapped)
        uploaded = upload_rows(mapped, np.float32, "cpu", block=4)
        block = host_tensor(mapped[2:5])
    assert tensor.data_ptr() == mapped.ctypes.data  # shared, not copied
    np.testing.assert_array_equal(tensor.numpy(), array)
    np.testing.assert_array_equal(block.numpy(), array[2:5])
    assert str(uploaded.dtype) == "torch.float32"
    np.testing.assert_array_equal(uploaded.numpy(), array.astype(np.float32))
    converted = host_tensor(mapped[:, ::2], np.float32)  # strided and converted: a C-ordered copy
    np.testing.assert_array_equal(converted.numpy(), array[:, ::2].astype(np.float32))
    assert converted.is_contiguous()


# -- where a build's time went ---------------------------------------------------------------------------------------

def test_index_json_records_the_seconds_of_each_build_stage(tmp_path, monkeypatch, hf_tokenizer):
    """Each stage slowed by a known amount shows in its own entry, and the entries add up to at most the build."""
    import time

    from hil.retrieval import builder, structures
    from hil.retrieval.builder import build_index, rebuild_search_structures

    from toys import make_encoder, toy_corpus

    def slowed(function, seconds):
        def run(*args, **kwargs):
            time.sleep(seconds)
            return function(*args, **kwargs)
        return run

    monkeypatch.setattr(builder, "encode_corpus", slowed(builder.encode_corpus, 0.4))
    monkeypatch.setattr(builder, "join_chunks", slowed(builder.join_chunks, 0.2))
    monkeypatch.setattr(builder, "write_search_files", slowed(builder.write_search_files, 0.3))
    monkeypatch.setattr(structures, "write_search_files", slowed(structures.write_search_files, 0.3))
    ids, texts = toy_corpus(30)
    tick = time.perf_counter()
    index = build_index(make_encoder(hf_tokenizer), ids, texts, tmp_path / "idx", backend="plaid", progress=False)
    wall = time.perf_counter() - tick
    stages = index.meta["build_seconds"]
    assert list(stages) == ["encode", "join", "search_structures"]
    assert 0.4 <= stages["encode"] < 0.4 + wall - 0.9
    assert 0.2 <= stages["join"] < 0.2 + wall - 0.9
    assert 0.3 <= stages["search_structures"] < 0.3 + wall - 0.9
    assert sum(stages.values()) <= wall
    rebuilt = rebuild_search_structures(index, "flat", progress=False)
    assert list(rebuilt.meta["build_seconds"]) == ["search_structures"]  # encoding and join were the earlier build's
    assert rebuilt.meta["build_seconds"]["search_structures"] >= 0.3


def test_a_batch_sent_to_a_gpu_keeps_what_the_host_knows_of_its_padding(monkeypatch):
    """An index build's batches go up to a GPU pinned and without waiting, and keep ``has_padding``: without it the
    backbone reads its mask back from the device (a sync per batch). No GPU here: pinning and the copy are
    recorded instead of made."""
    from hil.data.tokenization import TokenizedBatch
    from hil.retrieval.encoding import _on_device

    calls = []
    monkeypatch.setattr(TokenizedBatch, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(TokenizedBatch, "to", lambda self, device, non_blocking=None:
                        calls.append(("to", str(device), non_blocking)) or self)
    for padded in (True, False):
        batch = TokenizedBatch(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                               torch.ones(2, 3, dtype=torch.bool), has_padding=padded)
        calls.clear()
        moved = _on_device(batch, torch.device("cuda", 0))
        assert moved.has_padding is padded and torch.equal(moved.input_ids, batch.input_ids)
        assert calls == ["pin", ("to", "cuda:0", True)]
        assert _on_device(batch, torch.device("cpu")) is batch


@pytest.mark.parametrize("kind", ["flat", "muvera"])
def test_faiss_structures_opened_for_the_cpu_and_for_gpu_0_are_cached_apart(tmp_path, hf_tokenizer, kind):
    """The cache key of an opened FAISS structure said ``use_gpu and gpu_device``: for GPU 0 that is 0, equal to
    False, so a search asking for GPU 0 got the CPU's structure (and the reverse). Here no GPU exists, so both are
    CPU objects: what is checked is that each placement opens its own."""
    from hil.retrieval.backends.registry import open_backend
    from hil.retrieval.builder import build_index

    from toys import make_encoder, toy_corpus

    ids, texts = toy_corpus(30)
    index = build_index(make_encoder(hf_tokenizer), ids, texts, tmp_path / "idx", backend=kind, progress=False)
    on_cpu, on_gpu0 = open_backend(index, use_gpu=False), open_backend(index, use_gpu=True, gpu_device=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "FAISS sees 0 GPU(s)"
        first = on_cpu.faiss_index("colbert") if kind == "flat" else on_cpu.structures("colbert")[0]
        second = on_gpu0.faiss_index("colbert") if kind == "flat" else on_gpu0.structures("colbert")[0]
    assert first is not second
    assert len(index.search_structures) == 2
