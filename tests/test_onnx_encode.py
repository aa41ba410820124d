"""ONNX Runtime document encoding (hil.retrieval.onnx_encode): the fused fp32 graph gives PyTorch's vectors for any
batch and length, int8 stays close, the fusions the speed depends on happen, and indexes record the mode."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("onnxruntime")

from hil.retrieval.builder import build_index  # noqa: E402
from hil.retrieval.encoding import encode_document_tokens, eval_mode  # noqa: E402
from hil.retrieval.fast_encode import DOCUMENT_ENCODINGS, document_encoder  # noqa: E402
from hil.retrieval.index import TokenIndex  # noqa: E402
from hil.retrieval.onnx_encode import onnx_document_encoder  # noqa: E402

from conftest import random_bert  # noqa: E402

TEXTS = ["the protein binds the receptor in mouse cells", "vaccine dose and trial results, 2020.",
         "brain tumor growth is slowed by the therapy and by nothing else at all in this long sentence",
         "insulin signal in the liver", "heart and lung risk in older patients", "a"] * 2
IDS = [f"d{i}" for i in range(len(TEXTS))]
DOCS = [f"{t} {i}" for i, t in enumerate(TEXTS)]  # distinct texts, as a corpus has
WORDS = ["cell", "gene", "the", "of", "protein", "risk", "trial", "2020", ",", "virus", "dose", "liver"]


def vectors(encoder, texts, batch_size=4, head="colbert"):
    with eval_mode(encoder):
        return encode_document_tokens(encoder, texts, batch_size=batch_size, dtype=np.float32).embeddings[head]


@pytest.fixture(scope="module")
def colbert(hf_tokenizer):
    from hil.modeling.encoder import ColBERTEncoder

    torch.manual_seed(0)
    backbone = random_bert(hidden=32, layers=2)
    with torch.no_grad():  # BERT's init (std 0.02) leaves the sublayers ~1e-3 of the residual stream; a trained
        for module in backbone.modules():  # model's are not, and int8 error would otherwise not show at all
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(20)
    return ColBERTEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                          _loaded=(backbone, hf_tokenizer)).eval()


@pytest.fixture(scope="module")
def onnx_fp32(colbert):
    return onnx_document_encoder(colbert, "onnx")


def test_fused_fp32_graph_gives_the_pytorch_vectors(colbert, onnx_fp32):
    fused = onnx_fp32.document_encoding["fused_operators"]
    # The speed comes from these fusions: without them the graph runs op by op.
    assert fused.get("Attention") == 2 and fused.get("SkipLayerNormalization") == 4, fused
    assert onnx_fp32.encoder.backbone is not colbert.backbone and not hasattr(colbert, "document_encoding")
    np.testing.assert_allclose(vectors(onnx_fp32, TEXTS), vectors(colbert, TEXTS), atol=1e-5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(WORDS), min_size=0, max_size=40).map(" ".join), min_size=1, max_size=7),
       st.integers(1, 5))
def test_any_batch_and_length_matches_pytorch(colbert, onnx_fp32, texts, batch_size):
    # Lengths from 2 to doc_maxlen and padded batches, none of them the shape the graph was exported with.
    np.testing.assert_allclose(vectors(onnx_fp32, texts, batch_size), vectors(colbert, texts, batch_size),
                               atol=1e-5)


def test_int8_is_close_smoothed_and_leaves_the_original_alone(colbert):
    before = {k: v.clone() for k, v in colbert.state_dict().items()}
    quantized = onnx_document_encoder(colbert, "onnx-int8", calibration_texts=TEXTS[:4])
    encoding = quantized.document_encoding
    assert encoding["quantize"] == "onnx-int8" and encoding["alpha"] == 0.8 and encoding["calibration_docs"] == 4
    assert encoding["fused_operators"].get("Attention") == 2  # smoothing left the attention fusable
    assert encoding["fp32_modules"] == ["encoder.layer.0.output.dense"]  # first half of the 2 layers
    assert encoding["fp32_nodes"] == ["/backbone/encoder/layer.0/output/dense/MatMul"]
    assert all(torch.equal(before[k], v) for k, v in colbert.state_dict().items())
    a, b = vectors(colbert, TEXTS), vectors(quantized, TEXTS)
    cosine = (a * b).sum(axis=1)
    assert cosine.mean() > 0.995 and cosine.min() > 0.98, (cosine.mean(), cosine.min())  # seen: 0.9993, 0.9957
    assert cosine.mean() < 1 - 1e-5  # the weights really are int8, not the fp32 graph again


def test_module_names_map_to_exported_scopes(colbert):
    from hil.retrieval.onnx_encode import feed_forward_outputs, onnx_scope

    assert onnx_scope("encoder.layer.0.output.dense") == "/encoder/layer.0/output/dense/"
    assert onnx_scope("encoder.layer.11.output.dense") not in "/encoder/layer.1/output/dense/MatMul"
    assert onnx_scope("encoder.layer.1.output.dense") not in "/encoder/layer.1/attention/output/dense/MatMul"
    assert feed_forward_outputs(colbert.backbone) == {0: "encoder.layer.0.output.dense",
                                                      1: "encoder.layer.1.output.dense"}


def test_smoothing_survives_export_exactly(colbert):
    """The smoothed backbone exported in fp32 still gives the original vectors: the rewrite, not the export, is
    the only approximation left for int8 to add."""
    import copy

    from hil.retrieval.onnx_encode import onnx_backbone
    from hil.retrieval.smoothing import activation_ranges, smooth_backbone

    smoothed = copy.deepcopy(colbert)
    ranges = activation_ranges(smoothed, TEXTS[:4])
    smooth_backbone(smoothed, {k: v for k, v in ranges.items() if "attention" not in k}, 0.8)
    view = copy.copy(colbert)
    view._modules = dict(colbert._modules)
    view.backbone = onnx_backbone(colbert.backbone, "onnx", source=smoothed.backbone)
    assert view.backbone.description["fused_operators"].get("Attention") == 2
    np.testing.assert_allclose(vectors(view, TEXTS), vectors(colbert, TEXTS), atol=5e-5)


def test_hil_encoder_runs_both_heads_through_onnx(hf_tokenizer):
    from hil.modeling.hil import HILEncoder

    torch.manual_seed(0)
    hil = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                     _loaded=(random_bert(hidden=32, layers=1), hf_tokenizer)).eval()
    fast = onnx_document_encoder(hil, "onnx")
    for head in ("L", "H"):
        np.testing.assert_allclose(vectors(fast, TEXTS, head=head), vectors(hil, TEXTS, head=head), atol=1e-5)


def test_index_records_the_onnx_encoding(colbert, tmp_path):
    index = build_index(colbert, IDS, DOCS, tmp_path / "idx", quantize="onnx-int8", calibration_docs=4,
                        progress=False)
    assert index.meta["document_encoding"]["quantize"] == "onnx-int8"
    assert TokenIndex.load(tmp_path / "idx").meta["document_encoding"]["method"].startswith("onnxruntime")
    stored = np.asarray(index.embeddings["colbert"], dtype=np.float32)
    reference = vectors(colbert, DOCS, batch_size=32)
    assert stored.shape == reference.shape
    assert (stored * reference).sum(axis=1).mean() > 0.98


def test_bad_modes_and_missing_runtime_are_named(colbert, monkeypatch):
    with pytest.raises(ValueError, match="onnx-int8"):
        document_encoder(colbert, "onnx-int4")
    assert set(DOCUMENT_ENCODINGS) >= {"onnx", "onnx-int8", "int8", "compile"}
    with pytest.raises(ValueError, match="calibration"):
        onnx_document_encoder(colbert, "onnx-int8")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match=r"hil\[onnx\]"):
        onnx_document_encoder(colbert, "onnx")


def test_index_is_rebuilt_when_the_encoding_recipe_or_calibration_changes(colbert, tmp_path, monkeypatch):
    from hil.retrieval import builder as index_module
    from hil.retrieval import fast_encode

    builds = []
    real_build = index_module.build_index
    monkeypatch.setattr(index_module, "build_index", lambda *a, **k: builds.append(k.get("quantize")) or
                        real_build(*a, **k))
    def index(**options):
        return index_module.open_or_build_index(colbert, IDS, DOCS, tmp_path / "idx", progress=False, **options)

    assert index(quantize="onnx").meta["document_encoding"]["recipe"] == fast_encode.RECIPES["onnx"]
    index(quantize="onnx")  # default calibration (32) on a 12-document corpus records 12: still reused
    assert builds == ["onnx"]
    monkeypatch.setitem(fast_encode.RECIPES, "onnx", fast_encode.RECIPES["onnx"] + 1)
    index(quantize="onnx")
    assert builds == ["onnx", "onnx"]
    assert index(quantize="onnx-int8").meta["document_encoding"]["calibration_docs"] == len(DOCS)
    index(quantize="onnx-int8")
    assert builds == ["onnx", "onnx", "onnx-int8"]
    index(quantize="onnx-int8", calibration_docs=4)
    index()
    assert builds == ["onnx", "onnx", "onnx-int8", "onnx-int8", None]
