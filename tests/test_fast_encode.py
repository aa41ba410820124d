"""int8 document encoding (hil.retrieval.fast_encode): SmoothQuant is an exact rewrite, quantization stays close,
and an index records how its documents were encoded (and is rebuilt when that changes)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from hil.retrieval.builder import build_index, open_or_build_index
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.fast_encode import compiled_document_encoder, quantized_document_encoder
from hil.retrieval.index import TokenIndex
from hil.retrieval.smoothing import SmoothedLinear, activation_ranges, smooth_backbone

TEXTS = ["the protein binds the receptor in mouse cells", "vaccine dose and trial results, 2020.",
         "brain tumor growth is slowed by the therapy", "insulin signal in the liver",
         "heart and lung risk in older patients", "a short one"] * 2


def vectors(encoder, texts):
    with eval_mode(encoder):
        return encode_document_tokens(encoder, texts, batch_size=4, dtype=np.float32).embeddings["colbert"]


def test_smoothing_is_an_exact_rewrite(tiny_random_colbert):
    smoothed = copy.deepcopy(tiny_random_colbert)
    ranges = activation_ranges(smoothed, TEXTS[:4])
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in tiny_random_colbert.backbone.modules())
    assert len(ranges) == n_linear and all((r >= 0).all() for r in ranges.values())
    smooth_backbone(smoothed, ranges, alpha=0.7)
    assert sum(isinstance(m, SmoothedLinear) for m in smoothed.backbone.modules()) == n_linear
    np.testing.assert_allclose(vectors(smoothed, TEXTS), vectors(tiny_random_colbert, TEXTS), atol=2e-5)


def test_int8_copy_is_close_and_leaves_the_original_alone(tiny_random_colbert):
    before = {k: v.clone() for k, v in tiny_random_colbert.state_dict().items()}
    quantized = quantized_document_encoder(tiny_random_colbert, "int8", calibration_texts=TEXTS[:4])
    assert quantized.document_encoding["quantize"] == "int8"
    assert all(torch.equal(before[k], v) for k, v in tiny_random_colbert.state_dict().items())
    a, b = vectors(tiny_random_colbert, TEXTS), vectors(quantized, TEXTS)
    assert a.shape == b.shape
    cosine = (a * b).sum(axis=1)
    assert cosine.mean() > 0.98 and cosine.min() > 0.9, (cosine.mean(), cosine.min())
    with pytest.raises(ValueError, match="quantize"):
        quantized_document_encoder(tiny_random_colbert, "int4", calibration_texts=TEXTS)
    with pytest.raises(ValueError, match="calibration"):
        quantized_document_encoder(tiny_random_colbert, "int8", calibration_texts=[])


def test_index_records_quantized_documents_and_rebuilds_on_change(tiny_random_colbert, tmp_path):
    ids = [f"d{i}" for i in range(len(TEXTS))]
    texts = [f"{t} {i}" for i, t in enumerate(TEXTS)]
    index = build_index(tiny_random_colbert, ids, texts, tmp_path / "idx", quantize="int8", calibration_docs=4,
                        progress=False)
    assert index.meta["document_encoding"]["quantize"] == "int8"
    assert index.encoder_fingerprint == TokenIndex.load(tmp_path / "idx").encoder_fingerprint
    reused = open_or_build_index(tiny_random_colbert, ids, texts, tmp_path / "idx", quantize="int8",
                                 calibration_docs=4, progress=False)
    assert reused.meta["created"] == index.meta["created"]
    plain = open_or_build_index(tiny_random_colbert, ids, texts, tmp_path / "idx", progress=False)
    assert "document_encoding" not in plain.meta
    np.testing.assert_allclose(np.asarray(plain.embeddings["colbert"], dtype=np.float32),
                               vectors(tiny_random_colbert, texts), atol=2e-3)


def test_compiled_encoder_gives_the_eager_vectors_and_leaves_the_original_alone(tiny_random_colbert, tmp_path):
    backbone = tiny_random_colbert.backbone
    compiled = compiled_document_encoder(tiny_random_colbert)
    assert tiny_random_colbert.backbone is backbone and compiled.encoder.backbone is not backbone
    np.testing.assert_allclose(vectors(compiled, TEXTS), vectors(tiny_random_colbert, TEXTS), atol=1e-4)
    ids = [f"d{i}" for i in range(len(TEXTS))]
    index = build_index(tiny_random_colbert, ids, TEXTS, tmp_path / "idx", quantize="compile", progress=False)
    assert index.meta["document_encoding"]["quantize"] == "compile"
    np.testing.assert_allclose(np.asarray(index.embeddings["colbert"], dtype=np.float32),
                               vectors(tiny_random_colbert, TEXTS), atol=2e-3)
