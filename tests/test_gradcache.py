"""GradCache: the objective of a whole batch computed chunk by chunk gives the whole batch's gradients."""

from __future__ import annotations

from functools import partial

import pytest
import pytorch_lightning as pl
import torch
from transformers import BertConfig, BertModel

from hil.data.errors import UserError
from hil.isotropy.regularizers import CosRegRegularizer, InterIsoRegularizer
from hil.modeling import gradcache
from hil.modeling.batch import RankingBatch
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.gradcache import concat, select_rows
from hil.modeling.hil import HILEncoder
from hil.modeling.losses import InBatchCE, KLDistillation, NWayCE
from hil.modeling.module import RetrieverModule
from hil.modeling.terms import HILIsotropy

QUERIES = ["what causes fever", "is coffee bad for sleep", "cats", "where is paris", "stock markets today"]
COLUMNS = [["Fever is caused by infection.", "Coffee delays sleep.", "Cats are small carnivores.",
            "Paris is in France.", "Markets fell on Monday."],
           ["Paris is in France.", "The cat sat on the mat.", "Stock markets fell.", "Fever can follow a vaccine.",
            "Tea has less caffeine."],
           ["Dogs bark at cats.", "Infection spreads fast.", "Sleep is restful.", "A lion is a big cat.",
            "The Seine flows through Paris."]]
TEACHER = torch.tensor([[3.0, 0.0, 1.0], [2.0, 1.0, -1.0], [0.5, 2.0, 1.0], [4.0, 0.0, 0.0], [1.0, 1.5, 0.2]])
STRINGS = {"queries": QUERIES, "positives": COLUMNS[0], "negatives": COLUMNS[1] + COLUMNS[2],
           "teacher_scores": TEACHER}


def backbone(hf_tokenizer, dropout: float):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertModel(config, add_pooling_layer=False), hf_tokenizer


def gradients(module: RetrieverModule, scale: float = 1.0) -> tuple[float, list[torch.Tensor]]:
    module.zero_grad()
    loss, _ = module.compute_loss(STRINGS)
    (loss * scale).backward()
    return loss.item(), [p.grad.clone() for p in module.encoder.parameters() if p.grad is not None]


def assert_same_gradients(full: list[torch.Tensor], cached: list[torch.Tensor], atol: float = 1e-6) -> None:
    """Equal up to float32 reordering (scores are float32): 1e-6 absolute, 1e-4 relative."""
    assert len(full) == len(cached) > 0
    for a, b in zip(full, cached):
        torch.testing.assert_close(b, a, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 2, 4, 64])
@pytest.mark.parametrize("objective", ["nway+ib+interiso", "kl+cosreg"])
def test_cached_gradients_equal_the_whole_batch(hf_tokenizer, chunk, objective):
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=backbone(hf_tokenizer, 0.1))
    if objective == "nway+ib+interiso":
        loss, regularizer, terms = NWayCE(), InterIsoRegularizer(0.4), [InBatchCE(weight=0.5)]
    else:
        loss, regularizer, terms = KLDistillation(teacher_temperature=0.5), CosRegRegularizer(-0.2), []
    full = RetrieverModule(encoder, loss, regularizer, terms=terms)
    cached = RetrieverModule(encoder, loss, regularizer, terms=terms, gradcache_chunk_size=chunk)
    encoder.eval()  # no dropout: the whole batch and its chunks encode the same
    full_loss, full_grads = gradients(full)
    cached_loss, cached_grads = gradients(cached)
    assert cached_loss == pytest.approx(full_loss, rel=1e-6)
    assert_same_gradients(full_grads, cached_grads)


def test_cached_gradients_on_colbert_hil_in_training_mode(hf_tokenizer):
    """Batch z-score moments over the whole batch (and the running estimates updated once, alike)."""
    states = []
    grads = []
    for chunk in (None, 2):
        encoder = HILEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=backbone(hf_tokenizer, 0.0))
        encoder.set_idf_from_texts([d for column in COLUMNS for d in column], source="toy")
        module = RetrieverModule(encoder, KLDistillation(heads="each"), terms=[HILIsotropy(-0.3)],
                                 gradcache_chunk_size=chunk)
        encoder.train()
        grads.append(gradients(module)[1])
        states.append({k: v.clone() for k, v in encoder.zscore.state_dict().items()})
    assert_same_gradients(*grads)
    for name in states[0]:
        torch.testing.assert_close(states[1][name], states[0][name], atol=1e-6, rtol=1e-6)
    assert int(states[1]["L.updates"]) == 1


def test_dropout_is_replayed_chunk_by_chunk(hf_tokenizer):
    """With dropout on, GradCache's gradients are those of the same chunks encoded with a graph under the same
    random states: the second pass draws the masks of the first."""
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=backbone(hf_tokenizer, 0.3))
    objective = RetrieverModule(encoder, NWayCE(), terms=[InBatchCE()])
    cached = RetrieverModule(encoder, NWayCE(), terms=[InBatchCE()], gradcache_chunk_size=2)
    encoder.train()
    torch.manual_seed(7)
    _, cached_grads = gradients(cached)

    torch.manual_seed(7)  # the reference: the same chunks in the same order, kept in one graph
    encoder.zero_grad()
    tokens = {"queries": encoder.tokenizer.encode_queries(QUERIES),
              "docs": encoder.tokenizer.encode_documents(COLUMNS[0] + COLUMNS[1] + COLUMNS[2])}
    encoded = {side: concat([encoder.encode(select_rows(batch, slice(s, s + 2)), side == "queries")
                             for s in range(0, len(batch), 2)]) for side, batch in tokens.items()}
    loss, _ = objective.objective_value(RankingBatch(encoded["queries"], encoded["docs"]))
    loss.backward()
    reference = [p.grad.clone() for p in encoder.parameters() if p.grad is not None]
    assert_same_gradients(reference, cached_grads)
    encoder.eval()
    _, no_dropout = gradients(cached)
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(no_dropout, cached_grads))  # dropout mattered


def test_the_gradient_reaching_the_loss_scales_the_replay(hf_tokenizer):
    """Loss scaling (fp16) and gradient accumulation multiply the loss before backward: so must the replay."""
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=backbone(hf_tokenizer, 0.0))
    module = RetrieverModule(encoder, NWayCE(), gradcache_chunk_size=3)
    _, once = gradients(module)
    _, scaled = gradients(module, scale=0.25)
    assert_same_gradients([g * 0.25 for g in once], scaled, atol=1e-8)


def test_the_replay_runs_under_the_autocast_of_the_first_pass(hf_tokenizer, monkeypatch):
    """Lightning calls backward outside the autocast of the step: the replay must re-enter it (CPU bf16 here)."""
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=backbone(hf_tokenizer, 0.0))
    module = RetrieverModule(encoder, NWayCE(), gradcache_chunk_size=4)
    seen: list[tuple[bool, bool]] = []
    encode = encoder.encode

    def recording(batch, is_query):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        return encode(batch, is_query)

    monkeypatch.setattr(encoder, "encode", recording)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = module.compute_loss(STRINGS)
    assert seen and all(state == (False, True) for state in seen)  # the first pass: no graph, autocast on
    first = len(seen)
    loss.backward()  # outside autocast, as Lightning's backward
    assert seen[first:] == [(True, True)] * first  # the replay: a graph, autocast on again, every chunk once


def test_gradcache_refuses_ddp(hf_tokenizer, monkeypatch):
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=backbone(hf_tokenizer, 0.0))
    module = RetrieverModule(encoder, NWayCE(), gradcache_chunk_size=2)
    monkeypatch.setattr(gradcache, "is_distributed", lambda: True)
    with pytest.raises(UserError, match="one process"):
        module.compute_loss(STRINGS)


@pytest.mark.integration
def test_lightning_trains_with_gradcache_as_without(shared_dir, tmp_path, one_thread):
    """Two optimizer steps through Lightning (automatic optimization, gradient clipping at 2.0) with and without
    GradCache end at the same weights (dropout off: the chunks then encode as the whole batch; SGD, whose step is
    proportional to the gradient, where Adam's first step would magnify float noise in near-zero gradients)."""
    from hil.data.datamodule import TriplesDataModule

    weights, before = [], {}
    for chunk in (None, 3):
        pl.seed_everything(0)
        encoder = ColBERTEncoder("bert-tiny-splade", dim=16, query_maxlen=16, doc_maxlen=32)
        for layer in encoder.modules():
            if isinstance(layer, torch.nn.Dropout):
                layer.p = 0.0
        before = {k: v.clone() for k, v in encoder.state_dict().items()}
        module = RetrieverModule(encoder, NWayCE(), terms=[InBatchCE(weight=0.5)],
                                 optimizer=partial(torch.optim.SGD, lr=0.5), gradcache_chunk_size=chunk)
        data = TriplesDataModule(triples="msmarco/triples.train.small.head1000.tsv", max_triples=16, batch_size=8,
                                 shuffle=False)
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=2.0,
                             default_root_dir=tmp_path)
        trainer.fit(module, data)
        weights.append({k: v.clone() for k, v in encoder.state_dict().items()})
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], atol=1e-6, rtol=1e-5)
    assert not all(torch.equal(weights[0][k], before[k]) for k in before)  # it did train


# -- on a GPU (skipped here): the device's random state and autocast are replayed -----------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cached_gradients_replay_cuda_dropout_and_autocast(hf_tokenizer, precision):
    """On CUDA with dropout on (the CUDA generator's state replayed) and under autocast (re-entered by the replay):
    GradCache's gradients equal those of the same chunks kept in one graph under the same seeds."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24,
                             _loaded=backbone(hf_tokenizer, 0.3)).cuda()
    objective = RetrieverModule(encoder, NWayCE(), terms=[InBatchCE()])
    cached = RetrieverModule(encoder, NWayCE(), terms=[InBatchCE()], gradcache_chunk_size=2)
    encoder.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")
    torch.manual_seed(11)
    encoder.zero_grad()
    with autocast:
        loss, _ = cached.compute_loss(STRINGS)
    loss.backward()
    cached_grads = [p.grad.clone() for p in encoder.parameters() if p.grad is not None]
    torch.manual_seed(11)
    encoder.zero_grad()
    tokens = {"queries": encoder.tokenizer.encode_queries(QUERIES),
              "docs": encoder.tokenizer.encode_documents(COLUMNS[0] + COLUMNS[1] + COLUMNS[2])}
    with autocast:
        encoded = {side: concat([encoder.encode(select_rows(batch, slice(s, s + 2)), side == "queries")
                                 for s in range(0, len(batch), 2)]) for side, batch in tokens.items()}
        reference, _ = objective.objective_value(RankingBatch(encoded["queries"], encoded["docs"]))
    reference.backward()
    tolerance = 1e-5 if precision == "fp32" else 1e-3  # bf16: the cached embedding gradients are rounded to bf16
    assert_same_gradients([p.grad for p in encoder.parameters() if p.grad is not None], cached_grads, atol=tolerance)
