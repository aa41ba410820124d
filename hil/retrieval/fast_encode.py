"""Cheaper document encoding for indexing: the ``quantize`` modes of ``build_index`` and their dispatcher.

The backbone's Linear layers are ~90% of the FLOPs of encoding a document, and on CPUs with AVX-512 VNNI int8
matrix products run several times faster than fp32. Plain dynamic quantization (``quantize_dynamic``: weights
int8 per channel, activations int8 per tensor, scale taken per batch) loses too much on BERT-family models,
whose hidden states have a few outlier channels: one per-tensor scale then leaves the other channels a handful of
levels (on MiniLM the document vectors' cosine to fp32 falls to ~0.96 on average, ~0.8 at worst). The ``int8``
mode here first balances every backbone Linear with SmoothQuant (:mod:`hil.retrieval.smoothing`), whose rescaled
activations quantize far better; the per-channel scaled weights are quantized per output channel as before.

Choices: ``alpha = 0.7`` (measured best of 0.5 / 0.7 / 0.85 on MiniLM, SciFact); calibration on the first
``calibration_docs`` documents given; only the backbone is quantized (the ColBERT projection is small and kept in
fp32); queries are still encoded by the caller's fp32 encoder. Because activation scales are taken per batch,
a document's int8 vector depends slightly on the other documents of its batch (batches are deterministic given
the corpus, so an index is still reproducible). Use only where the measured quality is acceptable: ``bench/``
reports nDCG@10 and vector cosines against fp32. On a CPU, ``onnx-int8`` (:mod:`hil.retrieval.onnx_encode`) is both
faster and closer to fp32 than this module's ``int8`` (bench/README): prefer it where ONNX Runtime is installed.

Every mode swaps the backbone of a single model (:class:`~hil.modeling.encoder.MultiVectorEncoder`) and returns a
:class:`~hil.retrieval.encoding.DocumentEncoderView` carrying the ``document_encoding`` an index records.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from hil.modeling.contracts import Encoder
from hil.modeling.encoder import MultiVectorEncoder
from hil.retrieval.choices import DOCUMENT_ENCODINGS
from hil.retrieval.encoding import DocumentEncoderView
from hil.retrieval.onnx_encode import ONNX_MODES, onnx_document_encoder
from hil.retrieval.smoothing import DEFAULT_ALPHA, activation_ranges, smooth_backbone

QUANTIZE_MODES = ("int8",)
# Raised when a mode's recipe changes what it writes, so that indexes encoded by an older recipe are rebuilt.
RECIPES = {"compile": 1, "int8": 1, "onnx": 1, "onnx-int8": 2}
CALIBRATED = ("int8", "onnx-int8")


def quantized_document_encoder(encoder: MultiVectorEncoder, mode: str = "int8", *, calibration_texts: Sequence[str],
                               alpha: float = DEFAULT_ALPHA) -> DocumentEncoderView:
    """A copy of ``encoder`` whose backbone Linear layers run in int8 (SmoothQuant + dynamic quantization).

    ``encoder`` itself is left untouched. ``calibration_texts``: a few documents (e.g. 32) of the corpus.
    """
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES} (or None), got {mode!r}")
    if not calibration_texts:
        raise ValueError("quantized_document_encoder needs calibration texts (a few documents of the corpus)")
    if torch.device(encoder.device).type != "cpu":
        raise ValueError("int8 dynamic quantization runs on the CPU only; move the encoder to the CPU")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    quantized = copy.deepcopy(encoder).cpu().eval()
    smooth_backbone(quantized, activation_ranges(quantized, calibration_texts), alpha)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao deprecation notices
        quantized.backbone = quantize_dynamic(quantized.backbone, {nn.Linear: per_channel_dynamic_qconfig},
                                              dtype=torch.qint8)
    return DocumentEncoderView(quantized, {"quantize": mode, "method": "smoothquant+dynamic-int8", "alpha": alpha,
                                           "calibration_docs": len(calibration_texts)})


def compiled_document_encoder(encoder: MultiVectorEncoder) -> DocumentEncoderView:
    """A view of ``encoder`` whose backbone runs through ``torch.compile`` (inductor, dynamic shapes); fp32 kept.

    No quantization: the vectors equal the eager ones to float rounding (~1e-4), so quality is unchanged. Measured
    on SciFact with MiniLM and 2 threads after a one-off compilation of ~30 s: the backbone alone ran 1.35x eager on
    256 documents, but whole-pipeline encoding of 512 documents ran 1.00x and 1.23x eager in two sections of one
    benchmark run (bench/results/scifact-minilm-compile.json): an opt-in to try, not a default.
    ``encoder`` itself is left untouched (its modules are shared, not copied).
    """
    compiled = copy.copy(encoder)
    compiled._modules = dict(encoder._modules)  # copy.copy shares the module dict; give the view its own
    compiled.backbone = torch.compile(encoder.backbone, dynamic=True)
    return DocumentEncoderView(compiled, {"quantize": "compile",
                                          "method": "torch.compile (inductor, dynamic shapes), fp32"})


def document_encoding_key(quantize: str | None, calibration_docs: int) -> dict[str, Any]:
    """What an index's recorded ``document_encoding`` must match to be reused for ``quantize`` (empty for None)."""
    if quantize is None:
        return {}
    key = {"quantize": quantize, "recipe": RECIPES.get(quantize)}
    if quantize in CALIBRATED:
        key["calibration_docs"] = calibration_docs
    return key


def document_encoder(encoder: Encoder, quantize: str | None, *,
                     calibration_texts: Sequence[str] = ()) -> DocumentEncoderView:
    """The encoder that indexing runs documents through for ``quantize`` (one of :data:`DOCUMENT_ENCODINGS`).

    None wraps ``encoder`` itself (an empty ``document_encoding``). Every other mode wraps a view or copy of a
    single model's encoder and describes it (recorded in the index); ``encoder`` is not modified.
    ``calibration_texts`` (a few documents of the corpus) are used by ``int8`` and ``onnx-int8``.
    """
    if quantize is None:
        return DocumentEncoderView(encoder)
    if quantize not in DOCUMENT_ENCODINGS:
        raise ValueError(f"quantize must be one of {DOCUMENT_ENCODINGS} (or None), got {quantize!r}")
    if not isinstance(encoder, MultiVectorEncoder):
        raise TypeError(f"quantize={quantize!r} swaps the backbone of a single model; a {type(encoder).__name__} "
                        "has none of its own: index without quantize")
    if quantize == "compile":
        view = compiled_document_encoder(encoder)
    elif quantize in ONNX_MODES:
        view = onnx_document_encoder(encoder, quantize, calibration_texts=calibration_texts)
    else:
        view = quantized_document_encoder(encoder, quantize, calibration_texts=calibration_texts)
    view.document_encoding["recipe"] = RECIPES[quantize]
    return view
