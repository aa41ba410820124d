"""Document encoding without a host sync per batch (hil.retrieval.encoding.encode_sorted_batches): the vectors
against the per-batch loop it replaced (byte for byte on the CPU), the number of reads from the device against the
number of batches, pinned token batches, and (on a GPU, skipped here) the same on CUDA and a GPU-built index."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import pytest
import torch

from hil.modeling.encoder import ColBERTEncoder
from hil.retrieval.devices import autocast
from hil.retrieval.encoding import SortedBatches, encode_sorted_batches, eval_mode, sorted_document_batches
from hil.retrieval.token_loader import TokenizedChunk

from toys import QUERIES, TwoHeadEncoder, make_encoder, toy_corpus  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def per_batch_reference(encoder, tokenized: SortedBatches) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The loop this replaced, written the obvious way: per batch, boolean-mask the outputs, copy them to the host
    in fp32 and round to fp16 in numpy; then put the documents back in input order one by one."""
    per_doc: dict[str, list[np.ndarray]] = {head: [None] * len(tokenized.order) for head in encoder.head_names}
    ids: list[np.ndarray] = [None] * len(tokenized.order)
    position = 0
    for tokens in tokenized.batches:
        batch = encoder.encode(tokens, is_query=False)
        for row in range(len(tokens)):
            keep = batch.mask[row].bool()
            doc = int(tokenized.order[position + row])
            for head in encoder.head_names:
                per_doc[head][doc] = batch.heads[head][row][keep].to("cpu", torch.float32).numpy().astype(np.float16)
            ids[doc] = batch.input_ids[row][keep].cpu().numpy().astype(np.int32)
        position += len(tokens)
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    return {head: np.concatenate(parts) for head, parts in per_doc.items()}, np.concatenate(ids), lengths


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("two_heads", [False, True])
def test_encoding_equals_the_per_batch_loop_byte_for_byte(hf_tokenizer, precision, two_heads):
    encoder = make_encoder(hf_tokenizer, cls=TwoHeadEncoder if two_heads else ColBERTEncoder)
    _, texts = toy_corpus(45, commas=True)
    tokenized = sorted_document_batches(encoder.tokenizer, texts, batch_size=7)
    with eval_mode(encoder), autocast(torch.device("cpu"), precision):
        encoded = encode_sorted_batches(encoder, tokenized)
        vectors, token_ids, lengths = per_batch_reference(encoder, tokenized)
    for head in encoder.head_names:
        assert encoded.embeddings[head].dtype == np.float16
        assert encoded.embeddings[head].tobytes() == vectors[head].tobytes(), head
    np.testing.assert_array_equal(encoded.token_ids, token_ids)
    np.testing.assert_array_equal(encoded.lengths, lengths)


class _HostReads:
    """Counts the calls that read a tensor back to the host (on a GPU each one waits for the device) made while
    ``active``; what the encoder does itself is not counted (the model is not this module's business)."""

    NAMES = ("cpu", "numpy", "item", "tolist", "__bool__", "nonzero")

    def __init__(self, monkeypatch):
        self.count, self.active = 0, True
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))
        original_getitem = torch.Tensor.__getitem__

        def getitem(tensor, index):  # boolean-mask indexing: the result's size is read from the device
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool and self.active:
                self.count += 1
            return original_getitem(tensor, index)

        monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)

    def _counted(self, original):
        def counted(*args, **kwargs):
            if self.active:
                self.count += 1
            return original(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.active = False
        try:
            yield
        finally:
            self.active = True


class _UncountedEncoder:
    """``encoder`` whose own ``encode`` is not counted by ``reads``."""

    def __init__(self, encoder, reads: _HostReads):
        self.encoder, self.reads = encoder, reads
        self.head_names, self.dim, self.tokenizer, self.device = (encoder.head_names, encoder.dim, encoder.tokenizer,
                                                                  encoder.device)

    def encode(self, batch, is_query):
        with self.reads.paused():
            return self.encoder.encode(batch, is_query)


def test_host_reads_do_not_grow_with_the_number_of_batches(hf_tokenizer, monkeypatch):
    """The loop over batches reads nothing back (no ``.cpu()``, no boolean-mask indexing per batch): 2 batches and
    12 batches cost the same number of reads, a handful at the end."""
    encoder = make_encoder(hf_tokenizer, cls=TwoHeadEncoder)
    _, texts = toy_corpus(48)
    few, many = (sorted_document_batches(encoder.tokenizer, texts, batch_size=size) for size in (24, 4))
    assert (len(few.batches), len(many.batches)) == (2, 12)
    counts = []
    with eval_mode(encoder):
        for tokenized in (few, many):
            reads = _HostReads(monkeypatch)
            encode_sorted_batches(_UncountedEncoder(encoder, reads), tokenized)
            counts.append(reads.count)
            monkeypatch.undo()
    assert counts[0] == counts[1] <= 8


def test_tokenized_chunk_batches_from_tensors_equal_those_from_arrays(hf_tokenizer):
    """A pinned chunk holds torch tensors instead of numpy arrays; its batches must be the same views."""
    encoder = make_encoder(hf_tokenizer)
    _, texts = toy_corpus(30)
    chunk = TokenizedChunk.pack((0, 0, 30), sorted_document_batches(encoder.tokenizer, texts, 8))
    as_tensors = TokenizedChunk(chunk.number, chunk.start, chunk.end, chunk.order, chunk.shapes,
                                *(torch.from_numpy(a) for a in (chunk.input_ids, chunk.attention_mask,
                                                                chunk.scoring_mask)))
    for a, b in zip(chunk.sorted_batches().batches, as_tensors.sorted_batches().batches):
        for field in ("input_ids", "attention_mask", "scoring_mask"):
            assert torch.equal(getattr(a, field), getattr(b, field))


def test_a_chunk_keeps_what_the_host_knows_about_padding(hf_tokenizer):
    """Each batch's ``has_padding`` survives packing (so the backbone's mask needs no device read), and equals what
    the attention mask shows; the same for GradCache's row chunks (an upper bound: the whole batch's)."""
    from hil.modeling.gradcache import select_rows

    encoder = make_encoder(hf_tokenizer)
    _, texts = toy_corpus(30)
    texts[:8] = ["cell protein gene"] * 8  # a first batch of equal lengths: no padding
    sorted_batches = sorted_document_batches(encoder.tokenizer, texts, 8)
    unpacked = TokenizedChunk.pack((0, 0, 30), sorted_batches).sorted_batches().batches
    flags = [batch.has_padding for batch in unpacked]
    assert flags == [bool((batch.attention_mask == 0).any()) for batch in unpacked]
    assert flags == [batch.has_padding for batch in sorted_batches.batches] and True in flags and False in flags
    assert [select_rows(batch, slice(0, 2)).has_padding for batch in unpacked] == flags


# -- on a GPU (skipped here) --------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
def test_pinned_chunk_equals_the_unpinned_one(hf_tokenizer):
    encoder = make_encoder(hf_tokenizer)
    _, texts = toy_corpus(30)
    chunk = TokenizedChunk.pack((0, 0, 30), sorted_document_batches(encoder.tokenizer, texts, 8))
    pinned = chunk.pin_memory()
    assert pinned.input_ids.is_pinned() and pinned.scoring_mask.is_pinned()
    for a, b in zip(chunk.sorted_batches().batches, pinned.sorted_batches().batches):
        assert b.input_ids.is_pinned() and torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.scoring_mask, b.scoring_mask)


class _SyncCountingEncoder(_UncountedEncoder):
    """``encoder`` on CUDA with torch's sync debug mode on everywhere but in its own ``encode``."""

    def encode(self, batch, is_query):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return self.encoder.encode(batch, is_query)
        finally:
            torch.cuda.set_sync_debug_mode(1)


def _count_syncs(encoder, tokenized) -> tuple[object, int]:
    """(encode_sorted_batches' result, how many synchronizing CUDA operations it made outside the model)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)  # "warn": every synchronizing operation warns
        try:
            result = encode_sorted_batches(_SyncCountingEncoder(encoder, None), tokenized)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return result, sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_encoding_equals_the_cpu_and_waits_for_the_device_a_fixed_number_of_times(hf_tokenizer, precision):
    encoder = make_encoder(hf_tokenizer, cls=TwoHeadEncoder)
    _, texts = toy_corpus(60, commas=True)
    few, tokenized = (sorted_document_batches(encoder.tokenizer, texts, batch_size=size) for size in (30, 6))
    with eval_mode(encoder):
        on_cpu = encode_sorted_batches(encoder, tokenized)
    encoder.cuda()
    try:
        with eval_mode(encoder), autocast(encoder.device, precision):
            on_gpu, syncs = _count_syncs(encoder, tokenized)  # 10 batches
            _, syncs_few = _count_syncs(encoder, few)  # 2 batches
    finally:
        encoder.cpu()
    assert syncs == syncs_few <= 6, (syncs, syncs_few)  # a few at the end, none per batch
    np.testing.assert_array_equal(on_gpu.token_ids, on_cpu.token_ids)
    np.testing.assert_array_equal(on_gpu.lengths, on_cpu.lengths)
    tolerance = 2e-3 if precision == "fp32" else 2e-2
    for head in encoder.head_names:
        np.testing.assert_allclose(on_gpu.embeddings[head].astype(np.float32),
                                   on_cpu.embeddings[head].astype(np.float32), atol=tolerance)


@pytest.mark.gpu
@needs_gpu
def test_cuda_build_runs_kmeans_in_torch_and_ranks_as_the_cpu_build(hf_tokenizer, tmp_path):
    from hil.retrieval.backends.configs import PlaidIndexConfig, PlaidSearchConfig
    from hil.retrieval.builder import build_index
    from hil.retrieval.devices import faiss_gpu_count
    from hil.retrieval.full_ranking import full_rank

    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus(80)
    config = PlaidIndexConfig(n_centroids=16, niter=5)
    cpu = build_index(encoder, ids, texts, tmp_path / "cpu", backend=config, progress=False)
    encoder.cuda()
    try:
        gpu = build_index(encoder, ids, texts, tmp_path / "gpu", backend=config, progress=False,
                          tokenizer_workers=1)
        every = PlaidSearchConfig(nprobe=16, ndocs=80, stage2_docs=80)
        ranked = {name: full_rank(encoder, index, QUERIES, k=10, search=every, progress=False)
                  for name, index in (("cpu", cpu), ("gpu", gpu))}
    finally:
        encoder.cpu()
    assert gpu.backend_settings["params"]["kmeans"] == ("faiss" if faiss_gpu_count() else "torch")
    assert gpu.meta["encoding_batch_size"] == 128
    # fp32 products on another device: the same documents but for near-ties at the cut
    overlap = [len(set(ranked["gpu"].run[q]) & set(ranked["cpu"].run[q])) / 10 for q in QUERIES]
    assert np.mean(overlap) >= 0.9
