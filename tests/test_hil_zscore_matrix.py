"""ColBERT-HIL's z-score settings in combination (issue 22, item 8), against a slow reference written out here.

Every combination of ``zscore_eval`` (running / per_query) x ``zscore_std`` (population / unbiased) x
``zscore_temperature`` (off / on) x train / eval mode is checked on every path the setting reaches: ``score``,
``score_heads``, ``score_pairs``, ``training_pair_scores`` (and the running estimates it updates), the retrieval
paths ``hil.retrieval.search.score_documents`` and ``raw_head_scores`` + ``normalize_per_query``, and the losses
``HILLoss`` / ``HILAuthorsLoss``. The reference loops over queries, documents and tokens in float64 (numpy) and
takes every mean / std by hand; what each path should use is the module docstring of ``hil.modeling.hil``:

- training mode: ``training_pair_scores`` z-scores with the moments of all its token scores (ddof 0 or 1,
  ``sqrt(var + eps)``) and updates the running estimates with them; ``score`` / ``score_pairs`` use the running ones.
- eval mode, "running": every path uses the running estimates.
- eval mode, "per_query": ``score`` takes each query's moments over all the documents of the call; the paired paths
  (``score_pairs``, ``training_pair_scores``, so the losses) take one set of moments over the call's pairs.
- ``zscore_temperature`` T replaces the std wherever a std is used (the mean is still subtracted, n times for a
  query of n tokens); the running std itself keeps being estimated.
``raw_head_scores`` + ``normalize_per_query`` always z-score per query (retrieval calls them for "per_query" only).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hil.modeling.contracts import EncodedBatch
from hil.modeling.hil import HILEncoder
from hil.modeling.losses import HILAuthorsLoss, HILLoss, TripleBatch
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.search import score_documents

from conftest import random_bert

QUERIES = ["what is sleep", "how do cells divide in the body", "sleep"]
DOCS = ["sleep is a state of rest.", "cells divide by mitosis, a process of the body.", "a body at rest",
        "mitosis and meiosis", "the state of the art in sleep research", "rest"]
RUNNING = {"L": (0.4, 0.7), "H": (0.6, 0.2)}  # running (mean, std) set before every check
MOMENTUM = 0.5
EPS = 0.05        # large enough that dropping it moves every std by far more than the tolerance
TEMPERATURE = 0.5
HEADS = ("L", "H")

SETTINGS = list(itertools.product(("running", "per_query"), ("population", "unbiased"), (None, TEMPERATURE)))
MODES = ("train", "eval")


def setting_id(value: object) -> str:
    return "T=off" if value is None else (f"T={value}" if isinstance(value, float) else str(value))


matrix = pytest.mark.parametrize("zscore_eval,zscore_std,temperature", SETTINGS, ids=lambda v: setting_id(v))
modes = pytest.mark.parametrize("mode", MODES)


# -- the slow reference ---------------------------------------------------------------------------------------------

@dataclass
class Setting:
    zscore_eval: str
    unbiased: bool
    temperature: float | None
    lexical_all: bool
    training: bool


@dataclass
class Tokens:
    """The embeddings as float64 numpy arrays: queries q[head] (Bq, Lq, D), documents d[head] (Bd, Ld, D)."""

    q: dict[str, np.ndarray]
    q_mask: np.ndarray
    q_idf: np.ndarray  # (Bq, Lq) IDF weight of each query token
    d: dict[str, np.ndarray]
    d_mask: np.ndarray

    @classmethod
    def of(cls, encoder: HILEncoder, queries: EncodedBatch, docs: EncodedBatch) -> "Tokens":
        def arrays(batch: EncodedBatch) -> dict[str, np.ndarray]:
            return {h: batch.heads[h].detach().double().numpy() for h in HEADS}
        idf = encoder.idf.detach().double().numpy()[queries.input_ids.numpy()]
        return cls(arrays(queries), queries.mask.numpy(), idf, arrays(docs), docs.mask.numpy())


def token_score(t: Tokens, head: str, a: int, b: int, i: int) -> float:
    """S_L = IDF(q_i) max_j L_qi . L_dj, S_H = max_j H_qi . H_dj over the document's tokens; 0 without any."""
    sims = [float(np.dot(t.q[head][a, i], t.d[head][b, j])) for j in range(t.d_mask.shape[1]) if t.d_mask[b, j]]
    best = max(sims) if sims else 0.0
    return t.q_idf[a, i] * best if head == "L" else best


def scored_tokens(t: Tokens, s: Setting, head: str, a: int) -> list[int]:
    """H: every scored query token; L: those with a non-zero IDF weight ("weighted") or all of them ("all")."""
    return [i for i in range(t.q_mask.shape[1])
            if t.q_mask[a, i] and (head == "H" or s.lexical_all or t.q_idf[a, i] != 0.0)]


def moments(values: list[float], unbiased: bool) -> tuple[float, float]:
    """Mean and sqrt(var + eps), var with ddof 0 or 1 (the divisor at least 1)."""
    n = len(values)
    mean = sum(values) / n if n else 0.0
    variance = sum((v - mean) ** 2 for v in values) / max(n - int(unbiased), 1)
    return mean, math.sqrt(variance + EPS)


def with_temperature(s: Setting, mean: float, std: float) -> tuple[float, float]:
    return mean, (std if s.temperature is None else s.temperature)


def zsum(values: list[float], mean: float, std: float) -> float:
    return sum((v - mean) / std for v in values)


def ref_score_matrix(t: Tokens, s: Setting, docs: list[int]) -> dict[str, np.ndarray]:
    """What ``score_heads(all_pairs=True)`` gives over the documents ``docs`` (in that order). head -> (Bq, C)"""
    out = {}
    for head in HEADS:
        out[head] = np.zeros((t.q_mask.shape[0], len(docs)))
        for a in range(t.q_mask.shape[0]):
            tokens = scored_tokens(t, s, head, a)
            values = [[token_score(t, head, a, b, i) for i in tokens] for b in docs]
            if s.zscore_eval == "per_query" and not s.training:
                mean, std = moments([v for row in values for v in row], s.unbiased)
            else:
                mean, std = RUNNING[head]
            mean, std = with_temperature(s, mean, std)
            for c, row in enumerate(values):
                out[head][a, c] = zsum(row, mean, std)
    return out


def ref_per_query_sums(t: Tokens, s: Setting, docs: list[int]) -> dict[str, np.ndarray]:
    """What ``normalize_per_query`` gives: per-query moments over ``docs``, in any mode. head -> (Bq, C)"""
    return ref_score_matrix(t, Setting("per_query", s.unbiased, s.temperature, s.lexical_all, False), docs)


def ref_pair_scores(t: Tokens, s: Setting, pairs: list[tuple[int, int]], batch_moments: bool
                    ) -> tuple[dict[str, np.ndarray], dict[str, tuple[float, float]]]:
    """score_late of each (query, document) pair with one set of moments over all the pairs' token scores
    (``batch_moments``) or the running ones. -> head -> (P,), and head -> the batch's own (mean, std)."""
    out, batch = {}, {}
    for head in HEADS:
        values = [[token_score(t, head, a, b, i) for i in scored_tokens(t, s, head, a)] for a, b in pairs]
        batch[head] = moments([v for row in values for v in row], s.unbiased)
        mean, std = with_temperature(s, *(batch[head] if batch_moments else RUNNING[head]))
        out[head] = np.array([zsum(row, mean, std) for row in values])
    return out, batch


def ref_training_pair_scores(t: Tokens, s: Setting, pairs: list[tuple[int, int]]
                             ) -> tuple[dict[str, np.ndarray], dict[str, tuple[float, float]]]:
    """``training_pair_scores``: batch moments in training or under "per_query", else the running ones; and the
    running (mean, std) after the call (training: blended with the batch's true moments, momentum 0.5)."""
    late, batch = ref_pair_scores(t, s, pairs, batch_moments=s.training or s.zscore_eval == "per_query")
    running = {}
    for head in HEADS:
        old = RUNNING[head]
        running[head] = (tuple((1 - MOMENTUM) * o + MOMENTUM * n for o, n in zip(old, batch[head]))
                         if s.training else old)
    return late, running


def pairwise_ce(positive: np.ndarray, negative: np.ndarray) -> float:
    """mean over pairs of -log softmax(pos, neg)[0] = log(1 + exp(neg - pos))."""
    return float(np.mean([math.log1p(math.exp(n - p)) for p, n in zip(positive, negative)]))


# -- the encoder under test -----------------------------------------------------------------------------------------

def make_encoder(tokenizer, s: Setting) -> HILEncoder:
    torch.manual_seed(0)
    encoder = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, zscore_eval=s.zscore_eval,
                         zscore_std="unbiased" if s.unbiased else "population", zscore_temperature=s.temperature,
                         lexical_query_tokens="all" if s.lexical_all else "weighted", zscore_momentum=MOMENTUM,
                         zscore_eps=EPS, _loaded=(random_bert(), tokenizer))
    encoder.set_idf_from_texts(DOCS + ["the the the", "sleep well"])
    return encoder


def reset_running(encoder: HILEncoder) -> None:
    """Running estimates RUNNING, one update already seen (the next one blends with MOMENTUM)."""
    with torch.no_grad():
        for head in HEADS:
            stats = encoder.zscore[head]
            stats.mean.fill_(RUNNING[head][0])
            stats.std.fill_(RUNNING[head][1])
            stats.updates.fill_(1)


def assert_running(encoder: HILEncoder, expected: dict[str, tuple[float, float]], what: str) -> None:
    for head in HEADS:
        got = (encoder.zscore[head].mean.item(), encoder.zscore[head].std.item())
        np.testing.assert_allclose(got, expected[head], rtol=1e-5, atol=1e-6, err_msg=f"{what} ({head})")


def setup(tokenizer, zscore_eval: str, zscore_std: str, temperature: float | None, mode: str,
          lexical_all: bool = False) -> tuple[HILEncoder, Setting, EncodedBatch, EncodedBatch, Tokens]:
    s = Setting(zscore_eval, zscore_std == "unbiased", temperature, lexical_all, mode == "train")
    encoder = make_encoder(tokenizer, s)
    encoder.eval()  # encoded without dropout (and with autograd): only the z-scoring depends on the mode below
    queries, docs = encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS)
    encoder.train(s.training)
    reset_running(encoder)
    return encoder, s, queries, docs, Tokens.of(encoder, queries, docs)


def close(actual: torch.Tensor | np.ndarray | float, expected: np.ndarray | float, what: str) -> None:
    actual = actual.detach().double().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4, err_msg=what)


# -- the tests ------------------------------------------------------------------------------------------------------

@matrix
@modes
@pytest.mark.parametrize("lexical", ("weighted", "all"))
def test_encoder_scores_match_the_reference(hf_tokenizer, zscore_eval, zscore_std, temperature, mode, lexical):
    encoder, s, queries, docs, t = setup(hf_tokenizer, zscore_eval, zscore_std, temperature, mode,
                                         lexical_all=lexical == "all")
    every = list(range(len(DOCS)))
    expected = ref_score_matrix(t, s, every)
    with torch.no_grad():
        close(encoder.score(queries, docs), expected["L"] + expected["H"], "score")
        heads = encoder.score_heads(queries, docs)
        for head in HEADS:
            close(heads[head], expected[head], f"score_heads {head}")
        # the candidate set matters under per_query in eval mode only
        subset = [4, 1, 2]
        expected_subset = ref_score_matrix(t, s, subset)
        close(encoder.score(queries, docs.select(torch.tensor(subset))),
              expected_subset["L"] + expected_subset["H"], "score over a subset")
        pairs = [(0, 0), (1, 1), (2, 2), (0, 3), (1, 4), (2, 5)]
        rows, cols = (torch.tensor(x) for x in zip(*pairs))
        paired, _ = ref_pair_scores(t, s, pairs, batch_moments=s.zscore_eval == "per_query" and not s.training)
        close(encoder.score_pairs(queries.select(rows), docs.select(cols)), paired["L"] + paired["H"], "score_pairs")
    assert_running(encoder, RUNNING, "scoring must not touch the running estimates")

    late, running = ref_training_pair_scores(t, s, pairs)
    got, masks = encoder.training_pair_scores(queries, docs.select(cols), rows)
    assert_running(encoder, running, "running estimates after training_pair_scores")
    for head in HEADS:
        close(got[head], late[head], f"training_pair_scores {head}")
        assert masks[head].shape == (len(pairs), queries.mask.shape[1])
    if s.training:  # gradients flow through the batch moments (or through the mean alone with a temperature)
        (got["L"] + got["H"]).sum().backward()
        assert torch.isfinite(encoder.linear_H.weight.grad).all()


@matrix
@modes
@pytest.mark.parametrize("loss_class", (HILLoss, HILAuthorsLoss))
def test_losses_match_the_reference(hf_tokenizer, zscore_eval, zscore_std, temperature, mode, loss_class):
    encoder, s, queries, docs, t = setup(hf_tokenizer, zscore_eval, zscore_std, temperature, mode)
    n = len(QUERIES)
    pairs = [(a, b) for b, a in enumerate(list(range(n)) * 2)]  # [positives; negatives] = DOCS[:3], DOCS[3:]
    late, running = ref_training_pair_scores(t, s, pairs)
    batch = TripleBatch(queries, docs)
    if loss_class is HILLoss:
        out = HILLoss(reg_weight=-0.3)(encoder, batch)
        expected = {head: pairwise_ce(late[head][:n], late[head][n:]) for head in HEADS}
        for head in HEADS:
            close(out.parts[f"loss_late_{head}"], expected[head], f"HILLoss CE_{head}")
        regularizer = out.parts["loss_reg_L"] + out.parts["loss_reg_H"]
        close(out.loss, expected["L"] + expected["H"] - 0.3 * float(regularizer), "HILLoss total")
        total = late["L"] + late["H"]
    else:
        out = HILAuthorsLoss(reg_weight=-0.3)(encoder, batch)
        total = (late["L"] + late["H"]) / 2
        expected_ce = pairwise_ce(total[:n], total[n:])
        close(out.parts["loss_late"], expected_ce, "HILAuthorsLoss CE")
        close(out.loss, expected_ce - 0.3 * float(out.parts["loss_reg"]), "HILAuthorsLoss total")
    close(out.parts["score_margin"], float(np.mean(total[:n] - total[n:])), "score margin")
    close(out.parts["pair_accuracy"], float(np.mean(total[:n] > total[n:])), "pair accuracy")
    for head in HEADS:
        logged_std = running[head][1] if temperature is None else temperature
        close(out.parts[f"zscore_mean_{head}"], running[head][0], f"logged running mean {head}")
        close(out.parts[f"zscore_std_{head}"], logged_std, f"logged running std {head}")
    assert_running(encoder, running, "running estimates after the loss")
    if s.training:
        out.loss.backward()
        assert torch.isfinite(encoder.linear_L.weight.grad).all()


@matrix
@modes
def test_retrieval_paths_agree_with_score_and_the_reference(hf_tokenizer, zscore_eval, zscore_std, temperature,
                                                            mode):
    """``score_documents`` (documents in several blocks, in any order), ``score`` and the reference agree; the
    per-query sums accumulated over blocks of documents give the per-query reference over all of them."""
    encoder, s, queries, docs, t = setup(hf_tokenizer, zscore_eval, zscore_std, temperature, mode)
    ids = [f"d{i}" for i in range(len(DOCS))]
    with eval_mode(encoder):
        store = encode_document_tokens(encoder, DOCS, batch_size=2, dtype=np.float32).to_store(ids)
    assert encoder.training == s.training
    chosen = [5, 0, 3, 2, 4]
    expected = ref_score_matrix(t, s, chosen)
    with torch.no_grad():
        direct = encoder.score(queries, docs.select(torch.tensor(chosen))).numpy()
        blocked = score_documents(encoder, queries, store, np.array(chosen), block_tokens=30)
        by_head = score_documents(encoder, queries, store, np.array(chosen), block_tokens=30, by_head=True)
    close(blocked, expected["L"] + expected["H"], "score_documents")
    close(blocked, direct, "score_documents against score")
    for head in HEADS:
        close(by_head[head], expected[head], f"score_documents by head {head}")
    if zscore_eval == "per_query":
        with torch.no_grad():
            first, second = (encoder.raw_head_scores(queries, docs.select(torch.tensor(part)))
                             for part in (chosen[:2], chosen[2:]))
        sums = {head: (torch.cat([first[head][0], second[head][0]], dim=1),
                       torch.cat([first[head][1], second[head][1]], dim=1), first[head][2]) for head in HEADS}
        assert torch.equal(first["L"][2], second["L"][2])
        normalized = encoder.normalize_per_query(sums)
        reference = ref_per_query_sums(t, s, chosen)
        for head in HEADS:
            close(normalized[head], reference[head], f"normalize_per_query {head}")
    assert_running(encoder, RUNNING, "retrieval must not touch the running estimates")


def test_the_settings_change_the_scores(hf_tokenizer):
    """The matrix above is not vacuous: each setting moves the scores by more than its tolerance."""
    def scores(**settings) -> np.ndarray:
        args = {"zscore_eval": "per_query", "zscore_std": "population", "temperature": None, "mode": "eval", **settings}
        encoder, _, queries, docs, _ = setup(hf_tokenizer, **args)
        with torch.no_grad():
            return encoder.score(queries, docs).numpy()
    base = scores()
    for changed in ({"zscore_std": "unbiased"}, {"temperature": TEMPERATURE}, {"zscore_eval": "running"},
                    {"mode": "train"}, {"lexical_all": True}):
        assert np.abs(scores(**changed) - base).max() > 1e-2, changed
