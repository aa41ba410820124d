"""Document encoding through ONNX Runtime: fused BERT kernels, optionally with int8 matrix products.

Why a second runtime: on a CPU, eager PyTorch runs a BERT layer as ~20 separate kernels, and its dynamic int8
Linear (``torch.ao``) quantizes activations symmetrically, per tensor, which loses a lot on BERT's skewed
activations (after GELU they are almost all >= 0). ONNX Runtime fuses each layer into a few kernels (Attention,
SkipLayerNormalization, BiasGelu) and its dynamic quantization stores activations as asymmetric uint8 (scale and
zero point per tensor, taken per call) against int8 per-channel weights, run with AVX-512 VNNI / AMX where the CPU
has them. bench/README has the speed and nDCG@10 of each mode against fp32 PyTorch and PyLate.

Modes (``build_index(..., quantize=...)``):
- ``onnx``: fused fp32. Same vectors to float rounding, so quality is unchanged.
- ``onnx-int8``: fused, and every MatMul/Attention weight int8 per output channel (``quantize_dynamic``,
  ``per_channel=True``); the embeddings, LayerNorms, softmax and the ColBERT/HIL heads stay fp32 (the heads run
  in PyTorch on the runtime's hidden states). Two measured choices keep it close to fp32:
  1. before export, the feed-forward Linear layers are SmoothQuant-balanced
     (:func:`hil.retrieval.smoothing.smooth_backbone`, ``alpha = 0.8``, ranges from the calibration documents):
     their inputs (LayerNorm and GELU outputs) carry BERT's outlier channels, which one per-tensor activation
     scale serves badly. The attention block's Linear layers are left alone: a smoothing ``Mul`` there stops ONNX
     Runtime from fusing the attention, and smoothing them bought nothing measurable;
  2. the feed-forward output Linear of the first half of the layers stays fp32: with everything else int8,
     those are the largest remaining error (GELU outputs of early layers have a few huge token activations
     that set the per-tensor scale).
  Measured on MiniLM (trained ColBERT export), SciFact, 256 documents, cosine of the hidden states to fp32
  (mean / 0.1th percentile / min) and backbone speed: everything int8, no smoothing: final-vector cosine 0.9901
  mean; with smoothing (alpha 0.5 / 0.7 / 0.8 / 0.9: 0.977 / 0.9958 / 0.9963 / 0.9957 on the final vectors),
  hidden states 0.9924 / 0.971 / 0.928 at 86-89 docs/s; layer 0's feed-forward output fp32: 0.9954 / 0.985 / 0.953
  at 80; layers 0-1: 0.9961 / 0.987 / 0.972 at 75; layers 0-2 (the default here): 0.9976 / 0.994 / 0.989 at 75;
  all six: 0.9984 / 0.995 / 0.990 at 65; the attention's QKV fp32 instead: 0.9931 / 0.973 / 0.954 at 67.
  A document's vector depends slightly on the other documents of its batch, because the activation scale is
  taken per call; batches are deterministic given the corpus, so an index is still reproducible.

Choices: the graph is exported once per index build by the TorchScript exporter (``dynamo=False``: its graph is the
one ONNX Runtime's BERT fusions recognize) from a copy of the backbone switched to eager attention (the SDPA graph
does not fuse), with batch and length dynamic; opset 17. Queries keep the caller's fp32 PyTorch encoder. Only the
CPU execution provider is used (on a GPU, encode with PyTorch in fp16). The layer fusions are applied to BERT
graphs (tested on MiniLM and random BERTs); other model types are exported and quantized but run unfused.
"""

from __future__ import annotations

import copy
import re
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from hil.modeling.encoder import MultiVectorEncoder
from hil.retrieval.choices import QUERY_ENCODINGS
from hil.retrieval.encoding import DocumentEncoderView
from hil.retrieval.smoothing import activation_ranges, smooth_backbone

ONNX_MODES = ("onnx", "onnx-int8")
OPSET = 17
SMOOTHING_ALPHA = 0.8
# Model types whose graphs get ONNX Runtime's BERT fusions; anything else runs unfused (correct, slower).
_FUSION_MODEL_TYPES = {"bert": "bert"}


def _require_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as error:  # an optional dependency
        raise ImportError("quantize='onnx' / 'onnx-int8' need ONNX Runtime: pip install 'hil[onnx]' "
                          "(onnxruntime, onnx)") from error
    return onnxruntime


class _HiddenStates(nn.Module):
    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def export_backbone(backbone: nn.Module, path: Path, sample_length: int = 16) -> None:
    """Write ``backbone``'s last hidden state as an ONNX graph (dynamic batch and length) to ``path``."""
    eager = copy.deepcopy(backbone).cpu().eval().float()
    if hasattr(eager, "set_attn_implementation"):
        eager.set_attn_implementation("eager")
    else:
        eager.config._attn_implementation = "eager"
    ids = torch.full((2, sample_length), 1000, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, sample_length // 2:] = 0  # a padded row, so the mask arithmetic is traced, not constant-folded
    dynamic = {0: "batch", 1: "length"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TorchScript tracer and exporter deprecation notices
        torch.onnx.export(_HiddenStates(eager), (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"], opset_version=OPSET, dynamo=False,
                          dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic,
                                        "last_hidden_state": dynamic})


def fuse(path: Path, out: Path, config: PretrainedConfig) -> dict[str, int]:
    """ONNX Runtime's transformer fusions (Attention, SkipLayerNorm, BiasGelu, ...) -> counts of fused operators."""
    model_type = _FUSION_MODEL_TYPES.get(getattr(config, "model_type", ""))
    if model_type is None:
        out.write_bytes(path.read_bytes())
        return {}
    from onnxruntime.transformers import optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = optimizer.optimize_model(str(path), model_type=model_type, num_heads=config.num_attention_heads,
                                         hidden_size=config.hidden_size, opt_level=1)
    model.save_model_to_file(str(out))
    return {name: int(count) for name, count in model.get_fused_operator_statistics().items() if count}


def onnx_scope(module_name: str) -> str:
    """The scope a PyTorch submodule's nodes are named under by the exporter:
    ``encoder.layer.0.output.dense`` -> ``/encoder/layer.0/output/dense/`` (list indices keep their dot)."""
    scope = ""
    for part in module_name.split("."):
        scope += f".{part}" if part.isdigit() else f"/{part}"
    return scope + "/"


def feed_forward_outputs(backbone: nn.Module) -> dict[int, str]:
    """Layer index -> module name of each layer's feed-forward output Linear (BERT-family naming:
    ``encoder.layer.i.output.dense``); empty for other layouts, which then keep no layer in fp32."""
    found = {}
    for name, module in backbone.named_modules():
        match = re.search(r"\.(\d+)\.output\.dense$", name)
        if match and isinstance(module, nn.Linear) and "attention" not in name:
            found[int(match.group(1))] = name
    return found


def quantize_int8(path: Path, out: Path, keep_fp32: Sequence[str] = ()) -> list[str]:
    """Dynamic quantization: int8 per-channel weights, uint8 per-call activations, for MatMul and Attention only.

    ``keep_fp32``: PyTorch module names whose nodes stay fp32. Returns the names of the nodes kept fp32.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    scopes = [onnx_scope(name) for name in keep_fp32]
    nodes = [node.name for node in onnx.load(str(path)).graph.node if node.op_type in ("MatMul", "Attention")]
    excluded = [node for node in nodes if any(scope in node for scope in scopes)]
    quantize_dynamic(str(path), str(out), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul", "Attention"], nodes_to_exclude=excluded,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return excluded


class OnnxBackbone(nn.Module):
    """A stand-in for a Hugging Face backbone that runs its forward pass in an ONNX Runtime session.

    Keeps what the encoders use besides the forward pass: ``config`` and ``get_input_embeddings()`` (HIL's
    vocabulary head reads the word embeddings, which stay the PyTorch module, shared with the original).
    """

    def __init__(self, session: Any, backbone: nn.Module, description: dict[str, Any]):
        super().__init__()
        self.session = session
        self.config = backbone.config
        self.word_embeddings = backbone.get_input_embeddings()
        self.description = description

    def get_input_embeddings(self) -> nn.Module:
        return self.word_embeddings

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> SimpleNamespace:
        feeds = {"input_ids": input_ids.detach().cpu().to(torch.int64).numpy(),
                 "attention_mask": attention_mask.detach().cpu().to(torch.int64).numpy()}
        (hidden,) = self.session.run(None, feeds)
        return SimpleNamespace(last_hidden_state=torch.from_numpy(hidden))


def onnx_backbone(backbone: nn.Module, mode: str = "onnx-int8", threads: int | None = None,
                  source: nn.Module | None = None, keep_fp32: Sequence[str] = ()) -> OnnxBackbone:
    """Export, fuse and (for ``onnx-int8``) quantize ``source`` (default ``backbone``), leaving the modules named in
    ``keep_fp32`` in fp32; return an :class:`OnnxBackbone` that stands in for ``backbone`` (``source`` may be a
    smoothed copy of it). ``threads``: the session's intra-op threads (default: ``torch.get_num_threads()``)."""
    if mode not in ONNX_MODES:
        raise ValueError(f"ONNX mode must be one of {ONNX_MODES}, got {mode!r}")
    ort = _require_onnxruntime()
    with tempfile.TemporaryDirectory(prefix="hil-onnx-") as folder:
        raw, fused, final = Path(folder, "backbone.onnx"), Path(folder, "fused.onnx"), Path(folder, "int8.onnx")
        export_backbone(source if source is not None else backbone, raw)
        fused_ops = fuse(raw, fused, backbone.config)
        kept = quantize_int8(fused, final, keep_fp32) if mode == "onnx-int8" else []
        final = final if mode == "onnx-int8" else fused
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Idle worker threads sleep instead of spinning: spinning steals time slices from every other process on
        # a shared machine (see bench/README on OMP_WAIT_POLICY) and was no faster here (86 vs 85 docs/s).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(str(final), options, providers=["CPUExecutionProvider"])
    description = {"quantize": mode, "method": f"onnxruntime {ort.__version__}, opset {OPSET}"
                   + (", dynamic int8 (per-channel weights, uint8 activations)" if mode == "onnx-int8" else ", fp32"),
                   "fused_operators": fused_ops, **({"fp32_nodes": kept} if mode == "onnx-int8" else {})}
    return OnnxBackbone(session, backbone, description)


def onnx_document_encoder(encoder: MultiVectorEncoder, mode: str = "onnx-int8", *,
                          calibration_texts: Sequence[str] = (), alpha: float = SMOOTHING_ALPHA) -> DocumentEncoderView:
    """A view of ``encoder`` whose backbone runs in ONNX Runtime (``mode``: ``onnx`` or ``onnx-int8``).

    ``onnx-int8`` needs ``calibration_texts`` (a few documents of the corpus, e.g. 32) for the smoothing ranges.
    ``encoder`` itself is left untouched; its heads and word embeddings are shared, not copied.
    """
    if mode not in ONNX_MODES:
        raise ValueError(f"ONNX mode must be one of {ONNX_MODES}, got {mode!r}")
    if torch.device(encoder.device).type != "cpu":
        raise ValueError("ONNX document encoding runs on the CPU only; move the encoder to the CPU")
    source, settings, keep_fp32 = None, {}, []
    if mode == "onnx-int8":
        if not calibration_texts:
            raise ValueError("quantize='onnx-int8' needs calibration texts (a few documents of the corpus)")
        n_layers = int(getattr(encoder.backbone.config, "num_hidden_layers", 0) or 0)
        keep_fp32 = [name for layer, name in sorted(feed_forward_outputs(encoder.backbone).items())
                     if layer < n_layers // 2]
        smoothed = copy.deepcopy(encoder).cpu().eval()
        ranges = activation_ranges(smoothed, calibration_texts)
        smooth_backbone(smoothed, {name: top for name, top in ranges.items()
                                   if "attention" not in name and name not in keep_fp32}, alpha)
        source = smoothed.backbone
        settings = {"smoothing": "feed-forward Linear layers", "alpha": alpha,
                    "calibration_docs": len(calibration_texts), "fp32_modules": keep_fp32}
    view = copy.copy(encoder)
    view._modules = dict(encoder._modules)  # copy.copy shares the module dict; give the view its own
    backbone = onnx_backbone(encoder.backbone, mode, source=source, keep_fp32=keep_fp32)
    view.backbone = backbone
    return DocumentEncoderView(view, {**backbone.description, **settings})




def onnx_query_encoder(encoder: MultiVectorEncoder) -> MultiVectorEncoder:
    """A view of ``encoder`` that encodes queries through ONNX Runtime's fused fp32 backbone (same vectors to float
    rounding: ~5e-7 here), for search latency on a CPU: one 32-token query goes through eager PyTorch as ~120
    small kernels whose dispatch dominates, where the fused graph runs a few per layer (bench/README.md, search).
    Only fp32: a query is 32 tokens, so int8's per-call activation scale would be set by very few tokens, and
    queries are what every document is scored against. The view shares the encoder's heads, tokenizer and word
    embeddings; it scores exactly as the encoder does, and is only ever used to encode queries."""
    if torch.device(encoder.device).type != "cpu":
        raise ValueError("ONNX query encoding runs on the CPU only; on a GPU queries are encoded by PyTorch")
    view = copy.copy(encoder)
    view._modules = dict(encoder._modules)  # copy.copy shares the module dict; give the view its own
    view.backbone = onnx_backbone(encoder.backbone, "onnx")
    return view


__all__ = ["ONNX_MODES", "OnnxBackbone", "QUERY_ENCODINGS", "onnx_backbone", "onnx_document_encoder",
           "onnx_query_encoder", "export_backbone"]
