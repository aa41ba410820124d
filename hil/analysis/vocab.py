"""Vocabulary projections of query and passage representations and "token amnesia" (Ram et al., paper 003).

003 Section 3 feeds a retriever's pooled representation through the MLM head of the model it was initialized
from (Eq. 1: ``MLM-Head(h)[i] = softmax(v_i^T g(h))``), giving distributions Q and P over the vocabulary (Eq. 3).
Section 5.1 measures how many tokens shared by a query and its gold passage appear in the top-k of Q and P;
Section 5.2 the token-level MRR of shared vs other passage tokens in P (Table 2); Section 6.1 "token amnesia":
the maximum (worst) rank of the shared tokens in P and Q, which is higher when the retriever fails (Fig. 5).

Choices:
- **Representation.** A late-interaction model has no single vector; as 003 does for mean-pooling retrievers,
  the backbone's last hidden states are mean-pooled over the tokens the retriever scores (its own tokenization,
  markers and a query's ``[MASK]`` augmentation tokens included) and the pooled vector is projected
  (``pooling="cls"`` takes the ``[CLS]`` state instead). The linear ColBERT head is not used: the MLM head reads
  hidden states, not projected ones. For an ensemble the first member's backbone is used.
- **MLM head.** Loaded with ``AutoModelForMaskedLM`` from the backbone's source (for an exported model, also the
  backbone it was trained from); used only when its weights are really in the checkpoint (no freshly initialized
  head: then the projection is skipped with a note). BERT's ``cls`` and RoBERTa-style ``lm_head`` are supported.
- **Shared tokens** T: vocabulary ids present in both the query and the passage (WordPiece, without special
  tokens), minus punctuation and English stop words (NLTK's list, as shipped with bm25s), as 003 excludes them.
- Ranks are 1-based (rank 1 = the most probable token).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from hil.analysis.layers import backbone_models
from hil.modeling.contracts import Encoder
from hil.modeling.encoder import MultiVectorEncoder
from hil.paths import resolve_model

COVERAGE_KS = (1, 5, 10, 20, 100)
_HEAD_ATTRIBUTES = ("cls", "lm_head")


def _stopwords() -> frozenset[str]:
    try:
        from bm25s.stopwords import STOPWORDS_EN_PLUS
        return frozenset(STOPWORDS_EN_PLUS)
    except ImportError:  # bm25s is a dependency; keep a minimal list if its layout changes
        return frozenset("a an and are as at be but by for if in into is it no not of on or such that the their "
                         "then there these they this to was will with".split())


STOPWORDS = _stopwords()


@dataclass
class MLMHead:
    """An MLM head (``g`` and the vocabulary matrix of 003 Eq. 1) and where it came from."""

    head: nn.Module
    source: str
    vocab_size: int


def _candidate_sources(model: MultiVectorEncoder) -> list[str]:
    """Where the backbone's MLM head may be: the backbone source, then (for an export) the backbone it came from."""
    sources = [str(model.backbone_name)]
    config = Path(sources[0]) / "hil_config.json"
    if config.is_file():
        import json

        with open(config, encoding="utf-8") as handle:
            original = json.load(handle).get("settings", {}).get("backbone")
        if isinstance(original, str):
            sources.append(original)
    return [s for s in dict.fromkeys(sources) if s]


def load_mlm_head(encoder: Encoder) -> tuple[MLMHead | None, str]:
    """The MLM head of the model the encoder's backbone was initialized from (an ensemble's first member's), or
    (None, why not)."""
    from transformers import AutoModelForMaskedLM
    from transformers.utils import logging as hf_logging

    model = next(iter(backbone_models(encoder).values()))
    hidden = int(model.backbone.config.hidden_size)
    reasons = []
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        for source in _candidate_sources(model):
            try:
                model, info = AutoModelForMaskedLM.from_pretrained(resolve_model(source), output_loading_info=True)
            except (OSError, ValueError, KeyError) as error:
                reasons.append(f"{source}: no masked-LM model ({error.__class__.__name__})")
                continue
            name = next((a for a in _HEAD_ATTRIBUTES if hasattr(model, a)), None)
            if name is None:
                reasons.append(f"{source}: {type(model).__name__} has no 'cls' or 'lm_head' module")
                continue
            missing = [k for k in (info.get("missing_keys") or ()) if k.startswith(f"{name}.")]
            if missing:
                reasons.append(f"{source}: the checkpoint has no MLM head weights (missing {sorted(missing)[:2]}...)")
                continue
            if int(model.config.hidden_size) != hidden:
                reasons.append(f"{source}: MLM head takes {model.config.hidden_size}-d states, backbone gives {hidden}")
                continue
            head = getattr(model, name).eval()
            return MLMHead(head, source, int(model.config.vocab_size)), f"MLM head from {source}"
    finally:
        hf_logging.set_verbosity(previous)
    return None, "no MLM head: " + "; ".join(reasons)


def pooled_states(backbone: nn.Module, tokenizer: Any, texts: Sequence[str], is_query: bool,
                  pooling: str = "mean", batch_size: int = 32) -> Tensor:
    """Last hidden states pooled per text (mean over scored tokens, or [CLS]). -> (B, H) fp32"""
    if pooling not in ("mean", "cls"):
        raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
    device = next(backbone.parameters()).device
    parts = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            chunk = list(texts[start: start + batch_size])
            batch = (tokenizer.encode_queries(chunk) if is_query else tokenizer.encode_documents(chunk)).to(device)
            hidden = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            if pooling == "cls":
                parts.append(hidden[:, 0].float())
                continue
            weights = batch.scoring_mask.unsqueeze(-1).float()                         # (B, L, 1)
            parts.append((hidden.float() * weights).sum(1) / weights.sum(1).clamp_min(1))  # (B, H)
    return torch.cat(parts).cpu()


def project(head: MLMHead, states: Tensor) -> Tensor:
    """003 Eq. 1 on pooled states (B, H): log-probabilities over the vocabulary. -> (B, V)"""
    parameter = next(head.head.parameters())
    with torch.inference_mode():
        logits = head.head(states.to(device=parameter.device, dtype=parameter.dtype)).float()
    return torch.log_softmax(logits, dim=-1).cpu()


def ranks_of(log_probs: Tensor) -> Tensor:
    """1-based rank of every vocabulary entry in each distribution (rank 1 = most probable). (B, V) -> (B, V)"""
    order = torch.argsort(log_probs, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    positions = torch.arange(1, log_probs.shape[-1] + 1).expand_as(order)
    ranks.scatter_(-1, order, positions)
    return ranks


def content_token_ids(hf_tokenizer: Any, text: str, max_length: int | None = None) -> set[int]:
    """Vocabulary ids of ``text`` (no special tokens; the first ``max_length``) minus punctuation and stop words."""
    ids = hf_tokenizer(text, add_special_tokens=False, truncation=max_length is not None,
                       max_length=max_length)["input_ids"]
    special = set(hf_tokenizer.all_special_ids)
    out = set()
    for token_id, token in zip(ids, hf_tokenizer.convert_ids_to_tokens(ids)):
        word = token.removeprefix("##")
        if token_id in special or word.lower() in STOPWORDS or all(c in string.punctuation for c in word):
            continue
        out.add(int(token_id))
    return out


@dataclass
class PairProjection:
    """One (query, passage) pair: top tokens of Q and P, and the ranks of their shared tokens."""

    qid: str
    docid: str
    query: str
    top_query: list[str]
    top_passage: list[str]
    shared: dict[str, tuple[int, int]]  # token -> (rank in Q, rank in P)
    max_rank_query: int | None           # token amnesia (003 Sec. 6.1): the worst rank of a shared token
    max_rank_passage: int | None
    passage_token_mrr: float | None      # 003 Table 2: mean reciprocal rank in P of the passage's other tokens
    retrieved_rank: int | None = None    # rank of the passage in the model's run (None: not retrieved)


def project_pairs(head: MLMHead, backbone: nn.Module, tokenizer: Any, pairs: Sequence[tuple[str, str]],
                  query_texts: Sequence[str], doc_texts: Sequence[str], *, top_k: int = 20,
                  pooling: str = "mean", batch_size: int = 32) -> list[PairProjection]:
    """Vocabulary projections of paired queries and passages (pairs[i] names them; texts are aligned with pairs)."""
    hf = tokenizer.tokenizer
    q_ranks = ranks_of(project(head, pooled_states(backbone, tokenizer, query_texts, True, pooling, batch_size)))
    p_log = project(head, pooled_states(backbone, tokenizer, doc_texts, False, pooling, batch_size))
    p_ranks = ranks_of(p_log)
    q_order = torch.argsort(q_ranks, dim=-1)[:, :top_k]  # ranks 1..k -> ids
    p_order = torch.argsort(p_ranks, dim=-1)[:, :top_k]
    out = []
    for i, ((qid, docid), query, passage) in enumerate(zip(pairs, query_texts, doc_texts)):
        # only the tokens the retriever sees (its length limits, minus [CLS], marker and [SEP])
        q_ids = content_token_ids(hf, query, tokenizer.query_maxlen - 3)
        p_ids = content_token_ids(hf, passage, tokenizer.doc_maxlen - 3)
        shared_ids = sorted(q_ids & p_ids)
        shared = {hf.convert_ids_to_tokens(t): (int(q_ranks[i, t]), int(p_ranks[i, t])) for t in shared_ids
                  if t < q_ranks.shape[1]}
        others = [t for t in p_ids - q_ids if t < p_ranks.shape[1]]
        out.append(PairProjection(
            qid, docid, query, hf.convert_ids_to_tokens(q_order[i].tolist()),
            hf.convert_ids_to_tokens(p_order[i].tolist()), shared,
            max((r[0] for r in shared.values()), default=None), max((r[1] for r in shared.values()), default=None),
            float(np.mean([1.0 / int(p_ranks[i, t]) for t in others])) if others else None))
    return out


def summarize_projections(projections: Sequence[PairProjection], ks: Sequence[int] = COVERAGE_KS,
                          success_depth: int = 5) -> dict[str, Any]:
    """003's aggregates: shared-token coverage of the top-k of Q and P (Sec. 5.1), MRR of shared vs other passage
    tokens in P (Table 2), and the median token-amnesia max-rank for pairs the model retrieved in its top
    ``success_depth`` vs the others (Fig. 5)."""
    shared = [r for p in projections for r in p.shared.values()]
    out: dict[str, Any] = {"n_pairs": len(projections), "n_shared_tokens": len(shared)}
    if shared:
        q_ranks, p_ranks = np.array([r[0] for r in shared]), np.array([r[1] for r in shared])
        out["coverage_query"] = {int(k): float(np.mean(q_ranks <= k)) for k in ks}
        out["coverage_passage"] = {int(k): float(np.mean(p_ranks <= k)) for k in ks}
        out["mrr_shared_in_passage"] = float(np.mean(1.0 / p_ranks))
    other = [p.passage_token_mrr for p in projections if p.passage_token_mrr is not None]
    out["mrr_other_passage_tokens"] = float(np.mean(other)) if other else None
    groups: dict[str, list[int]] = {"retrieved": [], "missed": []}
    for p in projections:
        if p.max_rank_passage is None:
            continue
        hit = p.retrieved_rank is not None and p.retrieved_rank <= success_depth
        groups["retrieved" if hit else "missed"].append(p.max_rank_passage)
    out["amnesia_median_max_rank_passage"] = {
        f"{name}_top{success_depth}": (float(np.median(v)) if v else None) for name, v in groups.items()}
    out["amnesia_counts"] = {name: len(v) for name, v in groups.items()}
    return out
