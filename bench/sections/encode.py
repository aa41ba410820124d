"""encode: documents/s and tokens/s of document encoding for each ``--encode-variants`` (fp32; int8 = PyTorch
SmoothQuant + dynamic int8 Linear layers; onnx / onnx-int8 = ONNX Runtime fp32 / int8; compile = torch.compile),
the GFLOP/s achieved and its fraction of the peak, and how far each variant's vectors are from fp32 (cosine)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sections.common import document_encoder, fmt, load_dataset, load_model
from sections.options import Job, comma_list, option

if TYPE_CHECKING:
    from sections.config import BenchConfig


@dataclass(frozen=True)
class Config:
    """Document encoding speed per variant (peer encodes the same documents)."""

    docs: int = option("--encode-docs", 512, "documents timed in encode / peer")
    repeats: int = option("--encode-repeats", 2)
    variants: tuple[str, ...] = option("--encode-variants", ("fp32", "int8", "onnx-int8"), type=comma_list)


def jobs(config: BenchConfig) -> list[Job]:
    return [Job("encode", "encode")]


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    import torch

    from hil.retrieval.encoding import document_token_lengths, encode_document_tokens, eval_mode
    from measure import encoder_flops, linear_parameters, matmul_peak_gflops, peak_rss_mb

    common, settings = config.common, config.encode
    dataset = load_dataset(config)
    texts = dataset.documents()[: settings.docs]
    encoder = load_model(config)
    peak = matmul_peak_gflops(config.peak.size, repeats=config.peak.repeats)
    lengths = document_token_lengths(encoder, texts)
    backbone_config = encoder.backbone.config
    flops = encoder_flops(lengths, linear_parameters(encoder.backbone) + linear_parameters(
        torch.nn.ModuleList([m for n, m in encoder.named_children() if n != "backbone"])),
        backbone_config.num_hidden_layers, backbone_config.hidden_size)
    calibration = dataset.documents()[: common.calibration_docs]
    variants, vectors = {}, {}
    encoders = {mode: document_encoder(encoder, mode, calibration) for mode in settings.variants}
    for repeat in range(settings.repeats):
        for mode, model in encoders.items():  # interleaved: load changes hit every variant alike
            with eval_mode(model):
                encode_document_tokens(model, texts[:8], batch_size=common.batch_size)  # warm-up
                tick = time.perf_counter()
                out = encode_document_tokens(model, texts, batch_size=common.batch_size, dtype=np.float32)
                seconds = time.perf_counter() - tick
            best = variants.get(mode, {}).get("seconds")
            if best is None or seconds < best:
                variants[mode] = {"seconds": seconds, "docs_per_s": len(texts) / seconds,
                                  "tokens_per_s": float(lengths.sum()) / seconds,
                                  "gflops": flops / seconds / 1e9,
                                  "fraction_of_peak": flops / seconds / 1e9 / peak["best"]}
            vectors[mode] = out.embeddings[encoder.head_names[0]]
    for mode in variants:
        cosine = (vectors[mode] * vectors["fp32"]).sum(axis=1) if "fp32" in vectors else None
        if cosine is not None:
            variants[mode]["cosine_to_fp32_mean"] = float(cosine.mean())
            variants[mode]["cosine_to_fp32_min"] = float(cosine.min())
        if "fp32" in variants:
            variants[mode]["speedup_vs_fp32"] = variants["fp32"]["seconds"] / variants[mode]["seconds"]
    return {"docs": len(texts), "attended_tokens": int(lengths.sum()), "mean_doc_tokens": float(lengths.mean()),
            "flops": flops, "matmul_fp32_gflops": peak, "variants": variants, "peak_rss_mb": peak_rss_mb(),
            "settings": {"batch_size": common.batch_size, "doc_maxlen": common.doc_maxlen,
                         "repeats": settings.repeats, "calibration_docs": common.calibration_docs,
                         "attn_implementation": getattr(encoder.backbone.config, "_attn_implementation", None)}}


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(f"encode {mode}", f"{v['docs_per_s']:.1f} docs/s, {v['tokens_per_s']:.0f} tok/s",
             f"{v['gflops']:.1f} GFLOP/s = {100 * v['fraction_of_peak']:.0f}% of peak; "
             f"x{v.get('speedup_vs_fp32', 1):.2f} vs fp32; cos>={fmt(v.get('cosine_to_fp32_min'), 3)}"
             f" mean {fmt(v.get('cosine_to_fp32_mean'), 4)}; {result['docs']} docs")
            for mode, v in result["variants"].items()]
