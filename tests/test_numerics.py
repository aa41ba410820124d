"""Numerical safety: degenerate inputs give finite scores, losses and gradients; bf16 autocast agrees with fp32.

Degenerate inputs tried: empty strings, all-punctuation text (every document token masked out of scoring), a batch
of one, identical texts (identical embeddings: zero variance for z-scoring and the regularizers' covariances), a
document far longer than every limit -- for ColBERT with every regularizer, pairwise and in-batch, train and eval
mode, and for ColBERT-HIL (running z-score statistics with zero variance).

bf16 (measured with the shared bert-tiny-splade, dim 16, 16 query tokens, 16 MS MARCO queries x 32 passages, three
seeds): late-interaction scores under ``torch.autocast("cpu", torch.bfloat16)`` differ from fp32 by at most
0.085-0.11 (0.005-0.007 per query token; mean 0.02) on scores between 3 and 14.5; token embeddings by at most 0.0063.
The stated tolerance is 0.01 per query token for the max and 0.0025 per query token for the mean (bf16 keeps 8
significant bits: 2^-8 = 0.004 relative). ``16-mixed`` is GPU-only in Lightning (on CPU it falls back to bf16).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hil.isotropy.regularizers import CosRegRegularizer, InterIsoRegularizer, IStarRegularizer
from hil.modeling.losses import InBatchCE, PairwiseCE, in_batch_ce_loss, pairwise_ce_loss
from hil.modeling.scoring import late_interaction, late_interaction_matrix

REPO = Path(__file__).resolve().parents[1]
LONG_DOCUMENT = " ".join(["retrieval"] * 20000)  # ~20k tokens, far past doc_maxlen and BERT's 512 positions

DEGENERATE_BATCHES = {
    "empty": (["", ""], ["", ""], ["", ""]),
    "punctuation": (["?!?!", "..."], ["...,,,", "!!!"], ["?", ";;;"]),
    "one": (["what is a cat"], ["a cat is an animal"], ["dogs bark"]),
    "identical": (["same text"] * 3, ["same text"] * 3, ["same text"] * 3),
    "long": (["long document query " * 50], [LONG_DOCUMENT], ["short"]),
    "mixed": (["", "a real query"], ["a real passage", ""], ["...", "a negative"]),
}


def assert_finite_step(module, batch: tuple[list[str], list[str], list[str]]) -> tuple[float, dict]:
    module.zero_grad()
    queries, positives, negatives = batch
    documents = [list(pair) for pair in zip(positives, negatives)]  # (B, 2)
    loss, parts = module.compute_loss({"queries": queries, "documents": documents})
    loss.backward()
    assert torch.isfinite(loss), float(loss)
    for name, value in parts.items():
        assert math.isfinite(float(value)), (name, float(value))
    grads = [(n, p.grad) for n, p in module.named_parameters() if p.grad is not None]
    assert grads, "no gradient reached the parameters"
    for name, grad in grads:
        assert torch.isfinite(grad).all(), name
    return float(loss.detach()), parts


# -- pure functions ------------------------------------------------------------------------------------------------
def test_scores_of_documents_and_queries_with_no_scoring_token_are_zero_with_finite_gradients():
    q = torch.nn.functional.normalize(torch.randn(2, 3, 4), dim=-1).requires_grad_()
    d = torch.nn.functional.normalize(torch.randn(2, 5, 4), dim=-1).requires_grad_()
    q_mask = torch.tensor([[True, True, True], [False, False, False]])
    d_mask = torch.tensor([[False] * 5, [True, False, True, False, False]])
    matrix = late_interaction_matrix(q, d, q_mask, d_mask)  # (2, 2)
    pairs = late_interaction(q, d, q_mask, d_mask)          # (2,)
    assert torch.equal(matrix[:, 0], torch.zeros(2)) and matrix[1, 1] == 0 and pairs.eq(0).all()
    (matrix.sum() + pairs.sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(d.grad).all()


def test_losses_of_identical_scores_are_log_of_the_candidates():
    assert math.isclose(float(in_batch_ce_loss(torch.full((3, 6), 2.5))), math.log(6), rel_tol=1e-6)
    assert math.isclose(float(pairwise_ce_loss(torch.ones(4), torch.ones(4))), math.log(2), rel_tol=1e-6)
    huge = torch.tensor([1e30, -1e30])  # extreme but finite scores: CE stays finite
    assert torch.isfinite(pairwise_ce_loss(huge, -huge))


# -- ColBERT -------------------------------------------------------------------------------------------------------
REGULARIZERS = {"none": lambda: None, "interiso": lambda: InterIsoRegularizer(0.5),
                "cosreg": lambda: CosRegRegularizer(0.5), "istar": lambda: IStarRegularizer(0.5)}


@pytest.fixture(scope="module")
def colbert_modules(shared_dir):
    from hil.modeling.encoder import ColBERTEncoder
    from hil.modeling.module import RetrieverModule

    modules = {}
    for name, regularizer in REGULARIZERS.items():
        torch.manual_seed(0)
        encoder = ColBERTEncoder(backbone="bert-tiny-splade", dim=16, query_maxlen=8, doc_maxlen=32)
        modules[name] = RetrieverModule(encoder, PairwiseCE(), regularizer())
    return modules


def assert_finite_on_every_degenerate_batch(module) -> None:
    for name, batch in DEGENERATE_BATCHES.items():
        try:
            assert_finite_step(module, batch)
        except AssertionError as error:
            raise AssertionError(f"batch {name!r}: {error}") from error


@pytest.mark.integration
@pytest.mark.parametrize("regularizer", ["none", "interiso", "cosreg", "istar"])
@pytest.mark.parametrize("in_batch, mode", [(False, "train"), (True, "eval")])  # eval: exactly equal embeddings
def test_colbert_loss_is_finite_on_degenerate_batches(colbert_modules, regularizer, in_batch, mode):
    module = colbert_modules[regularizer]
    module.loss = InBatchCE() if in_batch else PairwiseCE()
    module.train(mode == "train")
    assert_finite_on_every_degenerate_batch(module)


@pytest.mark.integration
def test_identical_texts_give_a_uniform_in_batch_loss(colbert_modules):
    module = colbert_modules["none"]
    module.loss = InBatchCE()
    module.eval()  # no dropout: the embeddings are exactly identical
    loss, parts = assert_finite_step(module, DEGENERATE_BATCHES["identical"])
    assert math.isclose(loss, math.log(6), rel_tol=1e-5)  # 3 queries x 6 equally good documents
    assert float(parts["score_margin"]) == 0.0


@pytest.mark.integration
def test_a_document_longer_than_every_limit_is_truncated_not_crashed(colbert_modules):
    encoder = colbert_modules["none"].encoder.eval()
    with torch.inference_mode():
        docs = encoder.encode_documents([LONG_DOCUMENT, "short"])
        queries = encoder.encode_queries([LONG_DOCUMENT])
        scores = encoder.score(queries, docs)
    assert docs.input_ids.shape == (2, 32) and queries.input_ids.shape == (1, 8)
    assert torch.isfinite(scores).all() and docs.heads["colbert"].shape == (2, 32, 16)


@pytest.mark.integration
def test_empty_and_punctuation_only_texts_encode_and_score(colbert_modules):
    encoder = colbert_modules["none"].encoder.eval()
    with torch.inference_mode():
        docs = encoder.encode_documents(["", "?!...", "a passage"])
        queries = encoder.encode_queries(["", "???"])
        scores = encoder.score(queries, docs)  # (2, 3)
    assert torch.isfinite(scores).all()
    assert not docs.mask[1, 2:-1].any()  # the punctuation takes no part in scoring
    norms = docs.heads["colbert"].norm(dim=-1)[docs.mask]
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-5)


# -- ColBERT-HIL -----------------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_hil_loss_is_finite_with_zero_variance_scores(shared_dir, mode):
    from hil.modeling.hil import HILEncoder
    from hil.modeling.losses import HILLoss
    from hil.modeling.module import RetrieverModule

    torch.manual_seed(0)
    module = RetrieverModule(HILEncoder(backbone="bert-tiny-splade", dim=16, query_maxlen=8, doc_maxlen=32), HILLoss())
    module.train(mode == "train")
    assert_finite_on_every_degenerate_batch(module)


# -- bf16 ------------------------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_bf16_autocast_scores_agree_with_fp32(shared_dir):
    from hil.data.triples import read_triples
    from hil.modeling.encoder import ColBERTEncoder
    from hil.paths import resolve_data_file

    triples = read_triples(resolve_data_file("msmarco/triples.train.small.head1000.tsv"), limit=16)
    queries = [t.query for t in triples]
    docs = [t.positive for t in triples] + [t.negative for t in triples]
    torch.manual_seed(0)
    encoder = ColBERTEncoder("bert-tiny-splade", dim=16, query_maxlen=16, doc_maxlen=48).eval()
    with torch.inference_mode():
        q32, d32 = encoder.encode_queries(queries), encoder.encode_documents(docs)
        fp32 = encoder.score(q32, d32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q16, d16 = encoder.encode_queries(queries), encoder.encode_documents(docs)
            bf16 = encoder.score(q16, d16)
    assert q16.heads["colbert"].dtype == torch.bfloat16  # the autocast really ran in bf16
    query_tokens = q32.mask.sum(dim=1).max().item()     # 16
    diff = (fp32 - bf16).abs()
    assert 0 < float(diff.max()) <= 0.01 * query_tokens, float(diff.max())
    assert float(diff.mean()) <= 0.0025 * query_tokens, float(diff.mean())
    assert float((q32.heads["colbert"] - q16.heads["colbert"].float()).abs().max()) <= 0.02
    # the best document per query is the same for nearly all queries
    assert float((fp32.argmax(1) == bf16.argmax(1)).float().mean()) >= 0.85


@pytest.mark.integration
def test_cli_trains_in_bf16_mixed_on_cpu(shared_dir, tmp_path):
    from hil.cli.train import train_main

    cli = train_main(["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config",
                      str(REPO / "configs/presets/smoke.yaml"), "--trainer.default_root_dir", str(tmp_path),
                      "--trainer.logger", "false", "--trainer.max_steps", "2", "--trainer.precision", "bf16-mixed",
                      "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]"])
    assert cli.trainer.global_step == 2 and cli.trainer.precision == "bf16-mixed"
    assert math.isfinite(float(cli.trainer.callback_metrics["train/loss"]))
    weights = [p for p in cli.model.parameters()]
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in weights)  # fp32 master weights
