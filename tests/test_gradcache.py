"""GradCache: the objective of a whole batch computed chunk by chunk gives the whole batch's gradients."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import astuple, dataclass, fields
from functools import partial

import pytest
import pytorch_lightning as pl
import torch
from transformers import BertConfig, BertModel

from hil.errors import UserError
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
STRINGS = {"queries": QUERIES, "documents": [list(row) for row in zip(*COLUMNS)], "teacher_scores": TEACHER}


def backbone(hf_tokenizer, dropout: float, seed: int = 0):
    torch.manual_seed(seed)
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


def autocast(encoder, dtype: torch.dtype | None, cache: bool = True):
    """``dtype`` None: no autocast. ``cache=False``: each use of a weight casts it anew (``same_chunks_gradients``)."""
    return torch.autocast(encoder.device.type, dtype=dtype, cache_enabled=cache) if dtype else nullcontext()


def parameter_gradients(encoder) -> list[torch.Tensor]:
    return [p.grad.clone() for p in encoder.parameters() if p.grad is not None]


def step_gradients(encoder, seed: int, dtype: torch.dtype | None = None, chunk: int | None = None
                   ) -> list[torch.Tensor]:
    """The gradients of a training step as Lightning runs it (the loss under autocast, its backward outside):
    with GradCache in chunks of ``chunk`` texts, or (None) the ordinary step, queries and documents each at once."""
    module = RetrieverModule(encoder, NWayCE(), terms=[InBatchCE()], gradcache_chunk_size=chunk)
    torch.manual_seed(seed)
    encoder.zero_grad()
    with autocast(encoder, dtype):
        loss, _ = module.compute_loss(STRINGS)
    loss.backward()
    return parameter_gradients(encoder)


def same_chunks_gradients(encoder, chunk: int, seed: int, dtype: torch.dtype | None = None,
                          cache: bool = True) -> list[torch.Tensor]:
    """Full autograd, no GradCache: the batch encoded ``chunk`` texts at a time in GradCache's order under the same
    seed (so with dropout on, the same masks as GradCache's chunks of that size), concatenated, the objective on the
    whole batch, one backward outside autocast. With ``cache`` (autocast's default) each weight is cast to bf16 once
    for all chunks, so its chunks' gradients are summed in bf16; without, each chunk's is cast to fp32 and summed
    there, as GradCache's one backward per chunk does."""
    objective = RetrieverModule(encoder, NWayCE(), terms=[InBatchCE()])
    torch.manual_seed(seed)
    encoder.zero_grad()
    tokens = {"queries": encoder.tokenizer.encode_queries(QUERIES),
              "docs": encoder.tokenizer.encode_documents(COLUMNS[0] + COLUMNS[1] + COLUMNS[2])}
    with autocast(encoder, dtype, cache):
        encoded = {side: concat([encoder.encode(select_rows(batch, slice(s, s + chunk)), side == "queries")
                                 for s in range(0, len(batch), chunk)]) for side, batch in tokens.items()}
        loss, _ = objective.objective_value(RankingBatch(encoded["queries"], encoded["docs"]))
    loss.backward()
    return parameter_gradients(encoder)


OFF_ATOL = 1e-3  # "off": an element further than this from the reference (the largest gradients here: ~5)
RECHUNKING_FACTOR = 2.0


@dataclass(frozen=True)
class GradientError:
    """How far gradients are from reference gradients, over every element of every parameter at once."""

    max_abs: float
    fraction_off: float  # of the elements, those off by more than OFF_ATOL
    relative: float      # ||gradients - reference|| / ||reference||

    @classmethod
    def between(cls, gradients: list[torch.Tensor], reference: list[torch.Tensor]) -> GradientError:
        assert len(gradients) == len(reference) > 0
        ours = torch.cat([g.flatten().double() for g in gradients])
        theirs = torch.cat([g.flatten().double() for g in reference])
        off = (ours - theirs).abs()
        return cls(off.max().item(), (off > OFF_ATOL).double().mean().item(), (off.norm() / theirs.norm()).item())

    def assert_within(self, bound: GradientError, factor: float, what: str) -> None:
        for field, ours, allowed in zip(fields(self), astuple(self), astuple(bound)):
            assert ours <= factor * allowed, (f"{what}: {field.name} {ours:.3g} > {factor} x {allowed:.3g}, that of "
                                              f"the whole batch encoded in other chunks ({self} vs {bound})")


def assert_bf16_gradients_within_rechunking(encoder, seed: int) -> None:
    """GradCache under bf16 autocast against the bound bf16 itself sets: see the test below for the reasoning."""
    bf16 = torch.bfloat16
    encoder.eval()  # dropout off: chunks of any size encode the same batch, the masks cannot differ
    whole = step_gradients(encoder, seed, bf16)
    bound = GradientError.between(same_chunks_gradients(encoder, 3, seed, bf16), whole)
    assert bound.relative > 0  # bf16 did round: the bound is measured, not empty
    GradientError.between(step_gradients(encoder, seed, bf16, chunk=2), whole).assert_within(
        bound, RECHUNKING_FACTOR, "GradCache (chunks of 2), dropout off")
    encoder.train()  # dropout on: the reference draws the masks of GradCache's chunks (same chunks, same seed)
    cached = step_gradients(encoder, seed, bf16, chunk=2)
    GradientError.between(cached, same_chunks_gradients(encoder, 2, seed, bf16)).assert_within(
        bound, RECHUNKING_FACTOR, "GradCache (chunks of 2), dropout on")


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
    encoder.train()
    cached_grads = step_gradients(encoder, seed=7, chunk=2)
    assert_same_gradients(same_chunks_gradients(encoder, 2, seed=7), cached_grads)
    encoder.eval()
    no_dropout = step_gradients(encoder, seed=7, chunk=2)
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(no_dropout, cached_grads))  # dropout mattered


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_cached_gradients_are_as_close_as_another_chunking(hf_tokenizer, seed):
    """Under bf16 autocast (CPU here, CUDA below) GradCache cannot match the whole batch to float32 precision, and
    need not: bf16 rounds differently for every shape of the batch, so the whole batch computed a second time in
    other chunks (full autograd, no GradCache) is itself that far from the whole batch at once. That distance,
    measured on the same model, is the bound: GradCache's error, against the whole batch with dropout off and against
    the same chunks with dropout on (the same masks), must be within RECHUNKING_FACTOR of it in max abs, fraction of
    elements off by > OFF_ATOL, and relative norm. Measured here (6 seeds, chunks of 2 vs 3, CPU): re-chunked
    0.0032-0.0053 relative, 0.020-0.047 max abs, 280-330 ppm off; GradCache 0.0021-0.0032 relative, 0.012-0.047
    max abs, 340-430 ppm off (closer than another chunking in norm: it sums its chunks' weight gradients in fp32
    where the whole batch's single autocast cast sums them in bf16); the worst ratio to the bound was 1.5 (ppm off,
    dropout on). The factor 2 covers that and the spread between chunkings (chunks of 1 to 4: 0.0032-0.0071
    relative), and still fails a wrong replay: without autocast the replay is 1,460-1,760 ppm off (2.2-2.6 x the
    allowed); with other dropout masks, relative error ~1 and max abs ~10.

    The bound cannot see a small systematic error, so the strict half: GradCache is exactly the backward of the
    same chunks with their weight gradients summed in fp32 (autocast's weight-cast cache off), to float32
    reordering (2e-6 measured). A replay whose backward ran under autocast (bf16 matmuls in the backward of CPU's
    fp32 math attention; the bug this test was written for) was 1.5e-4 to 4e-4 off."""
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24,
                             _loaded=backbone(hf_tokenizer, 0.3, seed))
    assert_bf16_gradients_within_rechunking(encoder, seed)
    encoder.train()
    assert_same_gradients(same_chunks_gradients(encoder, 2, seed, torch.bfloat16, cache=False),
                          step_gradients(encoder, seed, torch.bfloat16, chunk=2), atol=1e-5)


def test_the_gradient_reaching_the_loss_scales_the_replay(hf_tokenizer):
    """Loss scaling (fp16) and gradient accumulation multiply the loss before backward: so must the replay."""
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=backbone(hf_tokenizer, 0.0))
    module = RetrieverModule(encoder, NWayCE(), gradcache_chunk_size=3)
    _, once = gradients(module)
    _, scaled = gradients(module, scale=0.25)
    assert_same_gradients([g * 0.25 for g in once], scaled, atol=1e-8)


def test_the_replay_runs_under_the_autocast_of_the_first_pass(hf_tokenizer, monkeypatch):
    """Lightning calls backward outside the autocast of the step: the replay's forward must re-enter it (CPU bf16
    here), and every backward stay outside it, as the whole batch's (the engine runs a backward under its caller's
    autocast state)."""
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24, _loaded=backbone(hf_tokenizer, 0.0))
    module = RetrieverModule(encoder, NWayCE(), gradcache_chunk_size=4)
    seen: list[tuple[bool, bool]] = []
    encode = encoder.encode

    def recording(batch, is_query):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        return encode(batch, is_query)

    monkeypatch.setattr(encoder, "encode", recording)
    backward_autocast: list[tuple[str, bool]] = []  # each backward's autocast state, as the engine runs it

    def record(stage: str):
        return lambda gradient: backward_autocast.append((stage, torch.is_autocast_enabled("cpu")))

    encoder.linear.weight.register_hook(record("replay"))
    value = module.objective_value

    def objective_value(batch):
        loss, parts = value(batch)
        loss.register_hook(record("objective"))
        return loss, parts

    monkeypatch.setattr(module, "objective_value", objective_value)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = module.compute_loss(STRINGS)
    assert seen and all(state == (False, True) for state in seen)  # the first pass: no graph, autocast on
    first = len(seen)
    loss.backward()  # outside autocast, as Lightning's backward
    assert seen[first:] == [(True, True)] * first  # the replay: a graph, autocast on again, every chunk once
    # every backward (the objective's, then each replayed chunk's) outside autocast, as the whole batch's
    assert backward_autocast == [("objective", False)] + [("replay", False)] * first


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
    from hil.data.datamodule import TrainingDataModule

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
        data = TrainingDataModule(triples="msmarco/triples.train.small.head1000.tsv", max_triples=16, batch_size=8,
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
    """On CUDA with dropout on (the CUDA generator's state replayed) and under autocast (re-entered by the replay's
    forward): in fp32 GradCache's gradients equal those of the same chunks kept in one graph under the same seeds;
    in bf16 they are within the bound that another chunking of the whole batch sets (see
    ``test_bf16_cached_gradients_are_as_close_as_another_chunking``; the strict bf16 half stays on the CPU, as
    CUDA's fused attention backward accumulates atomically, in no fixed order)."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24,
                             _loaded=backbone(hf_tokenizer, 0.3)).cuda()
    if precision == "bf16":
        assert_bf16_gradients_within_rechunking(encoder, seed=11)
        return
    encoder.train()
    assert_same_gradients(same_chunks_gradients(encoder, 2, seed=11), step_gradients(encoder, seed=11, chunk=2),
                          atol=1e-5)


def test_fp16_loss_scaling_reaches_the_objective_before_its_half_precision_backward(hf_tokenizer):
    """Under fp16 autocast (``16-mixed``) the whole batch's backward carries GradScaler's scale into the objective's
    half-precision products (the late-interaction matrix product), so their gradients stay in fp16's range. GradCache
    took the objective's gradient at the forward, unscaled: gradients under ~6e-8 were lost, the rest rounded as
    subnormals. Here the objective is made small on purpose (x 2^-24) so that its gradients fit fp16 only once
    scaled by 2^12: GradCache must then give the whole batch's gradients to fp16 rounding (relative 2e-4 measured;
    0.01 allowed), where taken unscaled they are lost or rounded as subnormals (relative 0.32 measured)."""
    encoder = ColBERTEncoder("random", dim=16, query_maxlen=12, doc_maxlen=24,
                             _loaded=backbone(hf_tokenizer, 0.0)).eval()
    queries, docs = encoder.tokenizer.encode_queries(QUERIES), encoder.tokenizer.encode_documents(COLUMNS[0])

    def objective(encoded_queries, encoded_docs):
        return 2.0 ** -24 * encoder.score(encoded_queries, encoded_docs).float().sum(), {}

    def scaled_gradients(loss):
        (loss * 2.0 ** 12).backward()  # as GradScaler.scale(loss).backward(), outside autocast
        return [g / 2.0 ** 12 for g in parameter_gradients(encoder)]

    encoder.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        whole_loss, _ = objective(encoder.encode(queries, True), encoder.encode(docs, False))
    whole = scaled_gradients(whole_loss)
    assert all(torch.isfinite(g).all() for g in whole) and max(float(g.abs().max()) for g in whole) > 0
    encoder.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        cached_loss, _ = gradcache.cached_objective(encoder, queries, docs, 2, objective)
    cached = scaled_gradients(cached_loss)
    assert GradientError.between(cached, whole).relative < 0.01
