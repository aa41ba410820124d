"""InterIso per backbone layer (HIL Figure 5): how isotropic the query-document interaction is at each layer.

For paired (query, document) texts the backbone is run with ``output_hidden_states=True`` on the retriever's own
tokenization (markers, ``[MASK]`` query augmentation); each layer's hidden states are L2-normalized per token and
InterIso (HIL Eq. 2: the mean cosine over all scored query-token x document-token pairs) is averaged over the
pairs. Layer 0 is the embedding output, layer i the output of transformer block i.

HIL Fig. 5 plots "differences in the log-scale of InterIso compared to ColBERT": ``log10(InterIso_model) -
log10(InterIso_reference)`` per layer (:func:`log_difference`); a layer where either value is <= 0 has no log and
gives NaN (reported, not hidden).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hil.data.tokenization import ColBERTTokenizer
from hil.isotropy.metrics import inter_iso
from hil.modeling.contracts import Encoder
from hil.modeling.encoder import MultiVectorEncoder
from hil.modeling.ensemble import EnsembleEncoder
from hil.retrieval.transformed import TransformedEncoder


def backbone_models(encoder: Encoder) -> dict[str, MultiVectorEncoder]:
    """The model(s) holding a transformer backbone behind an encoder: ``{"": model}``, or ``{"iso": ...,
    "aniso": ...}`` for a ColBERT-lambda ensemble. A post-hoc transform does not change the backbone."""
    if isinstance(encoder, TransformedEncoder):
        encoder = encoder.inner
    if isinstance(encoder, EnsembleEncoder):
        return dict(encoder.members.items())
    if not isinstance(encoder, MultiVectorEncoder):
        raise TypeError(f"{type(encoder).__name__} has no backbone to analyse")
    return {"": encoder}


def backbones(encoder: Encoder) -> dict[str, tuple[torch.nn.Module, ColBERTTokenizer]]:
    """The transformer backbone(s) of an encoder and the tokenizer feeding each (see :func:`backbone_models`)."""
    return {name: (model.backbone, model.tokenizer) for name, model in backbone_models(encoder).items()}


def layer_inter_iso(backbone: torch.nn.Module, tokenizer: ColBERTTokenizer, query_texts: Sequence[str],
                    doc_texts: Sequence[str], *, batch_size: int = 16) -> np.ndarray:
    """Mean InterIso of normalized hidden states at every layer over the paired texts. -> (n_layers + 1,)"""
    if len(query_texts) != len(doc_texts) or not query_texts:
        raise ValueError(f"layer_inter_iso: need equally many (>= 1) queries and documents, got "
                         f"{len(query_texts)} and {len(doc_texts)}")
    device = next(backbone.parameters()).device
    totals: np.ndarray | None = None
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(query_texts), batch_size):
                q = tokenizer.encode_queries(list(query_texts[start: start + batch_size])).to(device)
                d = tokenizer.encode_documents(list(doc_texts[start: start + batch_size])).to(device)
                hq = backbone(input_ids=q.input_ids, attention_mask=q.attention_mask, output_hidden_states=True)
                hd = backbone(input_ids=d.input_ids, attention_mask=d.attention_mask, output_hidden_states=True)
                values = np.array([float(inter_iso(F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1),
                                                   q.scoring_mask, d.scoring_mask).sum())
                                   for a, b in zip(hq.hidden_states, hd.hidden_states)])  # (n_layers + 1,)
                totals = values if totals is None else totals + values
    finally:
        backbone.train(was_training)
    return totals / len(query_texts)


def encoder_layer_inter_iso(encoder: Encoder, query_texts: Sequence[str], doc_texts: Sequence[str], *,
                            label: str = "model", batch_size: int = 16) -> dict[str, np.ndarray]:
    """:func:`layer_inter_iso` of every backbone of ``encoder``: ``{label: curve}`` or ``{label/iso: ..., ...}``."""
    return {(f"{label}/{name}" if name else label): layer_inter_iso(backbone, tokenizer, query_texts, doc_texts,
                                                                    batch_size=batch_size)
            for name, (backbone, tokenizer) in backbones(encoder).items()}


def log_difference(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """HIL Fig. 5: ``log10(values) - log10(reference)`` per layer, NaN where either is <= 0 or lengths differ."""
    values, reference = np.asarray(values, float), np.asarray(reference, float)
    n = min(len(values), len(reference))
    out = np.full(max(len(values), len(reference)), np.nan)
    a, b = values[:n], reference[:n]
    ok = (a > 0) & (b > 0)
    out[:n][ok] = np.log10(a[ok]) - np.log10(b[ok])
    return out
