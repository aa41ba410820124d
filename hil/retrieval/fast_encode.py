"""Cheaper document encoding for indexing: SmoothQuant-balanced dynamic int8 Linear layers.

The backbone's Linear layers are ~90% of the FLOPs of encoding a document, and on CPUs with AVX-512 VNNI int8
matrix products run several times faster than fp32. Plain dynamic quantization (``quantize_dynamic``: weights
int8 per channel, activations int8 per tensor, scale taken per batch) loses too much on BERT-family models,
whose hidden states have a few outlier channels: one per-tensor scale then leaves the other channels a handful of
levels (on MiniLM the document vectors' cosine to fp32 falls to ~0.96 on average, ~0.8 at worst).

SmoothQuant (Xiao et al. 2023, Eq. 4) moves that range from activations to weights with an exact rewrite of each
Linear layer: ``y = (x diag(s)^-1) (diag(s) W^T)`` with ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)`` per input
channel j, ``max|x_j|`` measured on a few calibration documents. The rescaled activations quantize far better;
the per-channel scaled weights are quantized per output channel as before.

Choices: ``alpha = 0.7`` (measured best of 0.5 / 0.7 / 0.85 on MiniLM, SciFact); calibration on the first
``calibration_docs`` documents given; only the backbone is quantized (the ColBERT projection is small and kept in
fp32); queries are still encoded by the caller's fp32 encoder. Because activation scales are taken per batch,
a document's int8 vector depends slightly on the other documents of its batch (batches are deterministic given
the corpus, so an index is still reproducible). Use only where the measured quality is acceptable: ``bench/``
reports nDCG@10 and vector cosines against fp32. On a CPU, ``onnx-int8`` (:mod:`hil.retrieval.onnx_encode`) is both
faster and closer to fp32 than this module's ``int8`` (bench/README): prefer it where ONNX Runtime is installed.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Sequence

import torch
from torch import Tensor, nn

QUANTIZE_MODES = ("int8",)
DEFAULT_ALPHA = 0.7


class SmoothedLinear(nn.Module):
    """``inner(x * inv_scale)``: a Linear whose weights were multiplied by ``1 / inv_scale`` per input channel."""

    def __init__(self, inv_scale: Tensor, inner: nn.Module):
        super().__init__()
        self.register_buffer("inv_scale", inv_scale)
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x * self.inv_scale)


def _linear_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, str]]:
    """(parent, attribute, Linear, dotted name) of every Linear layer inside ``model``."""
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found.append((parent, name, child, f"{parent_name}.{name}" if parent_name else name))
    return found


def activation_ranges(encoder: Any, texts: Sequence[str], batch_size: int = 16) -> dict[str, Tensor]:
    """Per input channel, the largest |activation| entering each backbone Linear layer over ``texts``.

    Only attended (non-padding) positions count: padding rows would otherwise widen the ranges.
    """
    ranges: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    hooks = []
    for _, _, linear, name in _linear_children(encoder.backbone):
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor, name: str = name) -> None:
            x = inputs[0].detach()
            keep = state["mask"].reshape(-1) if x.dim() == 3 and "mask" in state else None
            x = x.reshape(-1, x.shape[-1])
            if keep is not None and keep.numel() == x.shape[0]:
                x = x[keep]
            top = x.abs().amax(dim=0)
            ranges[name] = torch.maximum(ranges[name], top) if name in ranges else top
        hooks.append(linear.register_forward_hook(hook))
    was_training = encoder.training
    encoder.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = encoder.tokenizer.encode_documents(list(texts[start: start + batch_size]))
                state["mask"] = batch.attention_mask.bool()
                encoder.encode(batch, is_query=False)
    finally:
        for handle in hooks:
            handle.remove()
        encoder.train(was_training)
    return ranges


def smooth_backbone(encoder: Any, ranges: dict[str, Tensor], alpha: float = DEFAULT_ALPHA) -> None:
    """Rewrite every backbone Linear in place as :class:`SmoothedLinear` (SmoothQuant Eq. 4; same outputs)."""
    for parent, attribute, linear, name in _linear_children(encoder.backbone):
        if name not in ranges:
            continue
        weight_range = linear.weight.detach().abs().amax(dim=0).clamp(min=1e-5)  # (in,)
        scale = (ranges[name].clamp(min=1e-5) ** alpha / weight_range ** (1.0 - alpha)).clamp(min=1e-5)
        with torch.no_grad():
            linear.weight.mul_(scale[None, :])
        setattr(parent, attribute, SmoothedLinear((1.0 / scale).to(linear.weight.dtype), linear))


def quantized_document_encoder(encoder: Any, mode: str = "int8", *, calibration_texts: Sequence[str],
                               alpha: float = DEFAULT_ALPHA) -> Any:
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
    quantized.document_encoding = {"quantize": mode, "method": "smoothquant+dynamic-int8", "alpha": alpha,
                                   "calibration_docs": len(calibration_texts)}
    return quantized


def compiled_document_encoder(encoder: Any) -> Any:
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
    compiled.document_encoding = {"quantize": "compile", "method": "torch.compile (inductor, dynamic shapes), fp32"}
    return compiled


DOCUMENT_ENCODINGS = ("compile", "int8", "onnx", "onnx-int8")
# Raised when a mode's recipe changes what it writes, so that indexes encoded by an older recipe are rebuilt.
RECIPES = {"compile": 1, "int8": 1, "onnx": 1, "onnx-int8": 2}
CALIBRATED = ("int8", "onnx-int8")


def document_encoding_key(quantize: str | None, calibration_docs: int) -> dict[str, Any]:
    """What an index's recorded ``document_encoding`` must match to be reused for ``quantize`` (empty for None)."""
    if quantize is None:
        return {}
    key = {"quantize": quantize, "recipe": RECIPES.get(quantize)}
    if quantize in CALIBRATED:
        key["calibration_docs"] = calibration_docs
    return key


def document_encoder(encoder: Any, quantize: str | None, *, calibration_texts: Sequence[str] = ()) -> Any:
    """The encoder that indexing runs documents through for ``quantize`` (one of :data:`DOCUMENT_ENCODINGS`).

    None returns ``encoder`` itself. Every other mode returns a view or copy carrying a ``document_encoding``
    dict (recorded in the index); ``encoder`` is not modified. ``calibration_texts`` (a few documents of the
    corpus) are used by ``int8`` and ``onnx-int8``.
    """
    if quantize is None:
        return encoder
    if quantize not in DOCUMENT_ENCODINGS:
        raise ValueError(f"quantize must be one of {DOCUMENT_ENCODINGS} (or None), got {quantize!r}")
    if quantize == "compile":
        view = compiled_document_encoder(encoder)
    elif quantize.startswith("onnx"):
        from hil.retrieval.onnx_encode import onnx_document_encoder

        view = onnx_document_encoder(encoder, quantize, calibration_texts=calibration_texts)
    else:
        view = quantized_document_encoder(encoder, quantize, calibration_texts=calibration_texts)
    view.document_encoding["recipe"] = RECIPES[quantize]
    return view
