"""MUVERA (hil.retrieval.fde, hil.retrieval.backends.muvera) against references written from the definitions.

1. The FDE math: :func:`reference_fde` below writes Dhulipala et al. 2024, Sec. 2 out as loops over repetitions,
   tokens and buckets in float64 numpy (SimHash bits, per-bucket SUM for queries and MEAN for documents, the empty
   bucket's nearest token in Hamming distance, the +-1 / sqrt(d_proj) inner projection, repetitions concatenated,
   the count sketch), given the same random draws; one empty-bucket case is computed by hand.
2. The FDE inner product against Chamfer similarity (Theorem 2.1) on random data: what is asserted is said at each
   test (the theorem's constants are O(.) bounds, so the settings that meet an epsilon are measured, not derived).
3. The back-end: its candidates are the top FDE inner products of the reference (the stored vectors, transformed by
   a numpy/scipy transform, encoded by the loops), wide settings return every document and rank as exact search,
   settings recorded as used, a reused index kept or rebuilt, transforms (checked against scipy) steer candidates
   but not exact scores, blocks of documents by hand, bad values refused, and ``evaluate`` full ranking through it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.linalg
import torch

from hil.data.beir import BeirDataset
from hil.errors import UserError
from hil.evaluation.evaluate import EvaluationSettings, evaluate
from hil.isotropy.linear_transforms import MomentAccumulator
from hil.retrieval.backends import muvera
from hil.retrieval.backends.configs import (
    FlatSearchConfig,
    MuveraIndexConfig,
    MuveraSearchConfig,
    PlaidIndexConfig,
    configs_from_params,
)
from hil.retrieval.backends.muvera import (
    WHITEN_RIDGE,
    MuveraBackend,
    apply_token_transform,
    document_blocks,
    fit_token_transform,
)
from hil.retrieval.backends.registry import open_backend
from hil.retrieval.builder import build_index, open_or_build_index
from hil.retrieval.encoding import eval_mode
from hil.retrieval.fde import FdeSketch, document_fde, fde_sketch, query_fde
from hil.retrieval.full_ranking import full_rank

from toys import QUERIES, WORDS, TwoHeadEncoder, make_encoder, toy_corpus  # noqa: E402

SMALL = {"k_sim": 3, "d_proj": 8, "r_reps": 4}  # 4 x 8 x 8 = 256 dimensions over the toys' D = 16


# -- the reference ------------------------------------------------------------------------------------------------

def reference_fde(tokens: np.ndarray, sketch: FdeSketch, *, is_query: bool, fill: bool) -> np.ndarray:
    """Sec. 2 written out for one token set (T, D), float64 loops, with the random draws of ``sketch``."""
    planes = sketch.hyperplanes.double().numpy()  # (R, D, k)
    reps, dim, k = planes.shape
    inner = None if sketch.inner is None else sketch.inner.double().numpy()  # (R, D, P)
    width = dim if inner is None else inner.shape[2]
    out = np.zeros((reps, 2 ** k, width))
    for r in range(reps):
        bits = [[int(float(np.dot(planes[r, :, j], x)) > 0) for j in range(k)] for x in tokens]
        buckets = [sum(bit << j for j, bit in enumerate(row)) for row in bits]
        projected = [x if inner is None else inner[r].T @ x for x in tokens]
        for bucket in range(2 ** k):
            members = [i for i in range(len(tokens)) if buckets[i] == bucket]
            if members:
                total = sum(projected[i] for i in members)
                out[r, bucket] = total if is_query else total / len(members)
            elif fill and not is_query and k > 0 and len(tokens):
                target = [(bucket >> j) & 1 for j in range(k)]
                hamming = [sum(a != b for a, b in zip(row, target)) for row in bits]
                out[r, bucket] = projected[int(np.argmin(hamming))]  # argmin: the first of the nearest
    flat = out.reshape(-1)
    if sketch.d_final is None:
        return flat
    final = np.zeros(sketch.d_final)
    for i, (bucket, sign) in enumerate(zip(sketch.final_buckets.tolist(), sketch.final_signs.tolist())):
        final[bucket] += sign * flat[i]
    return final


def ragged_batch(n: int, width: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random vectors with a mask that is not a prefix (holes) and one row without any token."""
    g = torch.Generator().manual_seed(seed)
    vectors = torch.randn(n, width, dim, generator=g)
    mask = torch.rand(n, width, generator=g) > 0.35
    mask[0] = False
    return vectors * mask.unsqueeze(-1), mask


@pytest.mark.parametrize("d_proj, d_final", [(None, None), (4, None), (None, 40), (4, 17)])
def test_query_fde_is_the_per_bucket_sum(d_proj, d_final):
    vectors, mask = ragged_batch(5, 9, 8, seed=1)
    sketch = fde_sketch(8, k_sim=3, d_proj=d_proj, r_reps=3, d_final=d_final, seed=4)
    ours = query_fde(vectors, mask, sketch).numpy()
    for row in range(len(vectors)):
        expected = reference_fde(vectors[row][mask[row]].double().numpy(), sketch, is_query=True, fill=False)
        np.testing.assert_allclose(ours[row], expected, atol=1e-5)


@pytest.mark.parametrize("fill", [True, False])
@pytest.mark.parametrize("d_proj, d_final", [(None, None), (4, None), (4, 17)])
def test_document_fde_is_the_per_bucket_mean_with_empty_buckets_filled(fill, d_proj, d_final):
    vectors, mask = ragged_batch(6, 9, 8, seed=2)
    sketch = fde_sketch(8, k_sim=3, d_proj=d_proj, r_reps=3, d_final=d_final, seed=5)
    ours = document_fde(vectors, mask, sketch, fill_empty=fill).numpy()
    assert not ours[0].any(), "a document without tokens encodes to zeros"
    for row in range(len(vectors)):
        expected = reference_fde(vectors[row][mask[row]].double().numpy(), sketch, is_query=False, fill=fill)
        np.testing.assert_allclose(ours[row], expected, atol=1e-5)


def test_empty_bucket_takes_the_token_nearest_in_hamming_distance_by_hand():
    """Hyperplanes e1, e2 in R^3 (bucket = bit0 + 2 bit1). Tokens a = (2, 1, 0) -> bits (1, 1) bucket 3,
    b = (2, -1, 0) -> (1, 0) bucket 1, c = (1, 1, 5) -> (1, 1) bucket 3, with padding between them.
    Bucket 0 (bits 0, 0): Hamming a 2, b 1, c 2 -> b. Bucket 2 (bits 0, 1): a 1, b 2, c 1 -> a (tie: the first)."""
    planes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]).unsqueeze(0)  # (R=1, D=3, k=2)
    sketch = FdeSketch(planes, None, None, None, None)
    a, b, c = torch.tensor([2.0, 1, 0]), torch.tensor([2.0, -1, 0]), torch.tensor([1.0, 1, 5])
    vectors = torch.stack([a, torch.zeros(3), b, c, torch.zeros(3)]).unsqueeze(0)
    mask = torch.tensor([[True, False, True, True, False]])
    filled = document_fde(vectors, mask, sketch, fill_empty=True)[0].view(4, 3)
    torch.testing.assert_close(filled, torch.stack([b, b, a, (a + c) / 2]))
    empty = document_fde(vectors, mask, sketch, fill_empty=False)[0].view(4, 3)
    torch.testing.assert_close(empty, torch.stack([torch.zeros(3), b, torch.zeros(3), (a + c) / 2]))
    query = query_fde(vectors, mask, sketch)[0].view(4, 3)
    torch.testing.assert_close(query, torch.stack([torch.zeros(3), b, torch.zeros(3), a + c]))


def test_the_random_draws_are_a_function_of_the_seed():
    sketch = fde_sketch(16, k_sim=4, d_proj=8, r_reps=5, d_final=100, seed=3)
    again = fde_sketch(16, k_sim=4, d_proj=8, r_reps=5, d_final=100, seed=3)
    other = fde_sketch(16, k_sim=4, d_proj=8, r_reps=5, d_final=100, seed=4)
    for name in ("hyperplanes", "inner", "final_buckets", "final_signs"):
        assert torch.equal(getattr(sketch, name), getattr(again, name)), name
        assert not torch.equal(getattr(sketch, name), getattr(other, name)), name
    assert sketch.hyperplanes.shape == (5, 16, 4) and sketch.fde_dim == 5 * 16 * 8 and sketch.out_dim == 100
    assert sketch.inner.unique().tolist() == pytest.approx([-8 ** -0.5, 8 ** -0.5])
    assert set(sketch.final_signs.unique().tolist()) == {-1.0, 1.0}
    assert 0 <= int(sketch.final_buckets.min()) and int(sketch.final_buckets.max()) < 100
    assert torch.equal(fde_sketch(16, k_sim=4, d_proj=None, r_reps=5, d_final=None, seed=3).hyperplanes,
                       sketch.hyperplanes), "the hyperplanes are drawn first: the same whatever the projections"
    assert fde_sketch(16, k_sim=4, d_proj=16, r_reps=5, d_final=None, seed=3).inner is None, "d_proj = D: identity"


def test_chunked_nearest_search_and_batching_leave_each_encoding_unchanged():
    vectors, mask = ragged_batch(7, 11, 8, seed=6)
    sketch = fde_sketch(8, k_sim=4, d_proj=4, r_reps=3, d_final=None, seed=1)
    whole = document_fde(vectors, mask, sketch)
    assert torch.equal(document_fde(vectors, mask, sketch, block_elements=1), whole), "one bucket per chunk"
    for row in range(len(vectors)):
        alone = document_fde(vectors[row:row + 1, :5], mask[row:row + 1, :5], sketch)
        cut = document_fde(vectors[:, :5], mask[:, :5], sketch)[row:row + 1]
        assert torch.equal(alone, cut), "a document's encoding does not depend on its batch"
        assert torch.equal(query_fde(vectors[row:row + 1], mask[row:row + 1], sketch), query_fde(vectors, mask,
                                                                                                  sketch)[row:row + 1])


# -- the FDE inner product against Chamfer (Theorem 2.1) ----------------------------------------------------------

def unit(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    x = torch.randn(*shape, generator=g)
    return x / x.norm(dim=-1, keepdim=True)


def estimates(queries: torch.Tensor, docs: torch.Tensor, sketch: FdeSketch) -> torch.Tensor:
    """<F_q(Q_i), F_doc(P_i)> / (|Q_i| R) for aligned pairs (all tokens real): the estimate of NChamfer."""
    q_mask = torch.ones(queries.shape[:2], dtype=torch.bool)
    d_mask = torch.ones(docs.shape[:2], dtype=torch.bool)
    inner = (query_fde(queries, q_mask, sketch) * document_fde(docs, d_mask, sketch)).sum(1)
    return inner / (queries.shape[1] * sketch.r_reps)


def n_chamfer(queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """NChamfer(Q, P) = (1 / |Q|) sum_q max_p <q, p>, per aligned pair."""
    return torch.einsum("nqd,npd->nqp", queries, docs).max(-1).values.mean(-1)


def test_fde_meets_epsilon_on_near_duplicates_and_its_error_shrinks_with_k_sim():
    """100 pairs in R^16: 8 random unit query tokens; 24 document tokens, a near-duplicate of each query token
    (cosine >= ~0.995) and 16 random ones, shuffled. Asserted: the mean |estimate - NChamfer| falls as k_sim grows
    4 -> 8 -> 12 (Theorem 2.1's k_sim = O(log(m / delta) / epsilon)); at k_sim = 12, R = 3, no projection,
    |error| <= epsilon = 0.1 for at least 95% of the pairs (measured: 98%) and the mean |error| is <= 0.03."""
    g = torch.Generator().manual_seed(0)
    queries = unit((100, 8, 16), g)
    noise = torch.rand(100, 1, 1, generator=g) * 0.1 * torch.randn(100, 8, 16, generator=g) / 4
    near = torch.nn.functional.normalize(queries + noise, dim=-1)
    docs = torch.cat([near, unit((100, 16, 16), g)], dim=1)[:, torch.randperm(24, generator=g)]
    truth = n_chamfer(queries, docs)
    mean_error = [float((estimates(queries, docs, fde_sketch(16, k_sim=k, d_proj=None, r_reps=1, d_final=None,
                                                             seed=1)) - truth).abs().mean()) for k in (4, 8, 12)]
    assert mean_error[0] > 2 * mean_error[1] > 4 * mean_error[2], mean_error
    error = (estimates(queries, docs, fde_sketch(16, k_sim=12, d_proj=None, r_reps=3, d_final=None, seed=1))
             - truth).abs()
    assert float((error <= 0.1).float().mean()) >= 0.95 and float(error.mean()) <= 0.03


def test_repetitions_shrink_the_spread_of_the_estimate_and_track_chamfer_better():
    """24 pairs of random unit sets (8 and 24 tokens, R^32), k_sim = 4, no projection, 8 seeds. Repetitions average
    independent partitions: the estimate's standard deviation over seeds shrinks ~ 1 / sqrt(R) (asserted: R = 16
    at least 2.5x below R = 1; expected 4x, measured 3.9-4.3 over five data draws), and its correlation with
    NChamfer over the pairs grows (asserted: mean Pearson r over seeds at R = 16 above that at R = 1 by 0.15;
    measured gains 0.24-0.55). Their bias (a bucket's mean for the best match) does not shrink with R, so no
    epsilon is asserted on these unstructured sets."""
    g = torch.Generator().manual_seed(5)
    queries, docs = unit((24, 8, 32), g), unit((24, 24, 32), g)
    truth = n_chamfer(queries, docs).numpy()
    spread, correlation = {}, {}
    for reps in (1, 16):
        runs = torch.stack([estimates(queries, docs, fde_sketch(32, k_sim=4, d_proj=None, r_reps=reps,
                                                                d_final=None, seed=seed)) for seed in range(8)])
        spread[reps] = float(runs.std(dim=0).mean())
        correlation[reps] = float(np.mean([np.corrcoef(run.numpy(), truth)[0, 1] for run in runs]))
    assert spread[1] > 2.5 * spread[16], spread
    assert correlation[16] > correlation[1] + 0.15, correlation


def test_projection_noise_shrinks_with_d_proj_and_d_final():
    """30 random pairs in R^128, k_sim = 3, R = 2, 3 seeds: the projected estimate's mean distance to the
    unprojected one (same hyperplanes: they are drawn first) shrinks ~ 1 / sqrt(d): asserted at least 1.4x per
    4x more dimensions (expected 2x, measured 1.6-2.3 over five data draws), for the inner projection (d_proj 4,
    16, 64) and the count sketch (d_final 64, 256, 1024)."""
    g = torch.Generator().manual_seed(7)
    queries, docs = unit((30, 8, 128), g), unit((30, 24, 128), g)

    def deviation(d_proj, d_final) -> float:
        total = 0.0
        for seed in range(3):
            exact = estimates(queries, docs, fde_sketch(128, k_sim=3, d_proj=None, r_reps=2, d_final=None,
                                                        seed=seed))
            sketch = fde_sketch(128, k_sim=3, d_proj=d_proj, r_reps=2, d_final=d_final, seed=seed)
            total += float((estimates(queries, docs, sketch) - exact).abs().mean())
        return total / 3

    inner = [deviation(d, None) for d in (4, 16, 64)]
    final = [deviation(None, d) for d in (64, 256, 1024)]
    for errors in (inner, final):
        assert errors[0] > 1.4 * errors[1] > 1.4 ** 2 * errors[2], (inner, final)


# -- the back-end ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def encoder(hf_tokenizer):
    return make_encoder(hf_tokenizer, TwoHeadEncoder, seed=1)


@pytest.fixture(scope="module")
def built(encoder, tmp_path_factory):
    """The toy corpus (50 documents, two heads) indexed with each transform, SMALL settings; whitening with a final
    projection too; ``center`` built in blocks of at most 40 padded tokens and 3 documents (many blocks)."""
    ids, texts = toy_corpus()
    root = tmp_path_factory.mktemp("muvera")
    configs = {"none": MuveraIndexConfig(**SMALL), "center": MuveraIndexConfig(**SMALL, transform="center"),
               "whiten": MuveraIndexConfig(**SMALL, d_final=100, transform="whiten", seed=2)}
    indexes = {}
    for name, config in configs.items():
        with pytest.MonkeyPatch.context() as patch:
            if name == "center":
                patch.setattr(muvera, "BLOCK_TOKENS", 40)
                patch.setattr(muvera, "BLOCK_FDE_FLOATS", 3 * 256)
            indexes[name] = build_index(encoder, ids, texts, root / name, backend=config, progress=False)
    return indexes


def test_document_blocks_cover_the_corpus_in_order_within_the_budget():
    lengths = np.array([3, 0, 7, 2, 2, 9, 1, 1, 1, 1, 4])
    blocks = document_blocks(lengths, max_padded_tokens=10, max_docs=3)
    assert blocks == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 9), (9, 11)]  # by hand: greedy count * longest <= 10
    assert document_blocks(lengths, 100, 100) == [(0, 11)]
    assert document_blocks(np.array([50, 1]), 10, 5) == [(0, 1), (1, 2)], "an oversized document is a block alone"


def test_whitening_is_zca_with_a_ridge_and_centering_subtracts_the_mean():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(500, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 6, generator=g, dtype=torch.float64)
    mean, matrix = fit_token_transform("whiten", MomentAccumulator().update(x))
    sigma = np.cov(x.numpy(), rowvar=False)
    ridge = WHITEN_RIDGE * np.trace(sigma) / 6
    np.testing.assert_allclose(mean, x.numpy().mean(axis=0), atol=1e-12)
    np.testing.assert_allclose(matrix, np.real(scipy.linalg.fractional_matrix_power(sigma + ridge * np.eye(6),
                                                                                    -0.5)), rtol=1e-8)
    center_mean, identity = fit_token_transform("center", MomentAccumulator().update(x))
    np.testing.assert_allclose(center_mean, mean)
    np.testing.assert_array_equal(identity, np.eye(6))
    flat = x.clone()
    flat[:, 5] = 1.0  # a direction without variance: scaled by 1 / sqrt(ridge), not by 1 / sqrt(0)
    _, bounded = fit_token_transform("whiten", MomentAccumulator().update(flat))
    sigma = np.cov(flat.numpy(), rowvar=False)
    assert np.isfinite(bounded).all()
    assert np.linalg.eigvalsh(bounded).max() == pytest.approx((WHITEN_RIDGE * np.trace(sigma) / 6) ** -0.5)
    vectors = torch.randn(4, 6, generator=g)
    moved = apply_token_transform(vectors, torch.ones(6), 2 * torch.eye(6))
    torch.testing.assert_close(moved, torch.nn.functional.normalize(vectors - 1, dim=-1))


def reference_transform(index, head: str, kind: str):
    """The transform from its definition over every stored token: mean; ZCA (Sigma + lambda I)^-1/2 by scipy's
    matrix power, lambda = WHITEN_RIDGE * trace / D; then L2-normalized."""
    tokens = np.asarray(index.embeddings[head], dtype=np.float64)
    if kind == "none":
        return lambda x: x
    mean = tokens.mean(axis=0)
    matrix = np.eye(tokens.shape[1])
    if kind == "whiten":
        sigma = np.cov(tokens, rowvar=False)
        ridge = WHITEN_RIDGE * np.trace(sigma) / len(sigma)
        matrix = np.real(scipy.linalg.fractional_matrix_power(sigma + ridge * np.eye(len(sigma)), -0.5))

    def transform(x: np.ndarray) -> np.ndarray:
        y = (x - mean) @ matrix
        return y / np.linalg.norm(y, axis=-1, keepdims=True)
    return transform


def reference_candidates(encoder, index, kind: str, n: int) -> dict[str, set[int]]:
    """Per query, the union over heads of the n documents of largest reference FDE inner product (the draws made
    from the seed index.json records); a query whose n-th and (n+1)-th inner products tie within 1e-4 is left
    out."""
    params = index.backend_settings["params"]
    with eval_mode(encoder):
        queries = encoder.encode_queries(list(QUERIES.values()))
    found: dict[str, set[int]] = {qid: set() for qid in QUERIES}
    for head in encoder.head_names:
        sketch = fde_sketch(16, k_sim=params["k_sim"], d_proj=params["d_proj"], r_reps=params["r_reps"],
                            d_final=params["d_final"], seed=params["seed"])
        transform = reference_transform(index, head, kind)
        docs = np.stack([reference_fde(transform(np.asarray(index.embeddings[head][lo:hi], dtype=np.float64)),
                                       sketch, is_query=False, fill=params["fill_empty"])
                         for lo, hi in zip(index.doc_offsets[:-1], index.doc_offsets[1:])])
        for row, qid in enumerate(QUERIES):
            tokens = transform(queries.heads[head][row][queries.mask[row]].double().numpy())
            scores = docs @ reference_fde(tokens, sketch, is_query=True, fill=False)
            order = np.argsort(-scores, kind="stable")
            if scores[order[n - 1]] - scores[order[n]] < 1e-4:
                found.pop(qid, None)
            elif qid in found:
                found[qid] |= set(order[:n].tolist())
    return found


@pytest.mark.parametrize("kind", ["none", "center", "whiten"])
def test_candidates_are_the_top_reference_fde_inner_products(encoder, built, kind):
    index = built[kind]
    expected = reference_candidates(encoder, index, kind, n=5)
    assert len(expected) >= 4, "enough queries without a tie at the cut"
    with eval_mode(encoder):
        queries = encoder.encode_queries(list(QUERIES.values()))
    found = open_backend(index, MuveraSearchConfig(n_candidates=5)).candidates(queries, encoder.head_names)
    for qid, candidates in zip(QUERIES, found):
        if qid in expected:
            assert set(candidates.docs.tolist()) == expected[qid], (kind, qid)
        assert candidates.heads.sum(axis=0).tolist() == [5, 5], "each head proposes its n_candidates"


def test_wide_search_returns_every_document_and_ranks_as_exact_search(encoder, built):
    """With n_candidates >= n_docs every document is a candidate of every head, so full ranking (exact scores of
    the stored, untransformed vectors) equals the flat index searched exhaustively; a transform changes nothing."""
    flat = build_index(encoder, *toy_corpus(), built["none"].directory.parent / "flat", progress=False)
    exact = full_rank(encoder, flat, QUERIES, k=20, search=FlatSearchConfig(ncandidates=flat.n_tokens),
                      progress=False)
    for index in built.values():
        result = full_rank(encoder, index, QUERIES, k=20, search=MuveraSearchConfig(n_candidates=80),
                           progress=False)
        assert result.stats["candidates_mean"] == index.n_docs
        assert result.stats["search"] == {"backend": "muvera", "n_candidates": index.n_docs}
        for qid in QUERIES:
            assert list(result.run[qid]) == list(exact.run[qid])
            np.testing.assert_allclose(list(result.run[qid].values()), list(exact.run[qid].values()), atol=1e-5)


def test_transforms_change_candidates_but_not_exact_scores(encoder, built):
    runs = {kind: full_rank(encoder, index, QUERIES, k=10, search=MuveraSearchConfig(n_candidates=4),
                            progress=False).run for kind, index in built.items()}
    assert runs["none"] != runs["center"] and runs["none"] != runs["whiten"], "the transforms steer the candidates"
    for kind in ("center", "whiten"):
        shared = [(q, d) for q in QUERIES for d in runs[kind][q] if d in runs["none"][q]]
        assert shared, kind
        for qid, doc in shared:
            assert runs[kind][qid][doc] == pytest.approx(runs["none"][qid][doc], abs=1e-6)


def test_one_query_at_a_time_ranks_as_the_batch(encoder, built):
    """The per-query ``candidates`` and the batch's ``candidate_pairs`` agree, and full ranking one query at a time
    equals the batched one (no near-tie of FDE inner products at the cut in these data)."""
    search = MuveraSearchConfig(n_candidates=4)
    for index in built.values():
        batched = full_rank(encoder, index, QUERIES, k=10, search=search, progress=False)
        alone = full_rank(encoder, index, QUERIES, k=10, search=search, progress=False, batched=False)
        assert batched.run == alone.run and batched.sources == alone.sources


def test_the_index_records_its_settings_and_draws_as_used(built):
    index = built["whiten"]
    meta = json.loads((index.directory / "index.json").read_text())
    assert meta["backend"]["kind"] == "muvera"
    assert meta["backend"]["params"] == {"k_sim": 3, "d_proj": 8, "r_reps": 4, "d_final": 100, "fill_empty": True,
                                         "seed": 2, "transform": "whiten"}
    assert meta["backend"]["factory"] == "FDE3x8x4,CS100,whiten,FlatIP"
    assert {"a.muvera.faiss", "a.muvera.npz", "b.muvera.faiss", "b.muvera.npz"} <= set(meta["files"])
    stored = np.load(index.directory / "a.muvera.npz")
    drawn = fde_sketch(16, k_sim=3, d_proj=8, r_reps=4, d_final=100, seed=2)
    np.testing.assert_array_equal(stored["hyperplanes"], drawn.hyperplanes.numpy())
    np.testing.assert_array_equal(stored["final_buckets"], drawn.final_buckets.numpy())
    identity = MuveraBackend.resolve_params(MuveraIndexConfig(d_proj=None), n_tokens=100, dim=16)
    assert identity["d_proj"] == 16 and MuveraBackend.resolve_params(MuveraIndexConfig(d_proj=16), 100, 16) == identity


def test_search_stats_say_how_many_candidates_were_asked(built):
    index = built["none"]  # 50 documents
    assert open_backend(index).search_stats() == {"backend": "muvera", "n_candidates": 50}, "100, capped"
    assert open_backend(index, MuveraSearchConfig(n_candidates=7)).search_stats()["n_candidates"] == 7
    assert MuveraSearchConfig().for_depth(10).n_candidates == 100
    assert MuveraSearchConfig().for_depth(250).n_candidates == 250
    assert MuveraSearchConfig(n_candidates=3).for_depth(250).n_candidates == 3


def test_a_reused_index_is_kept_for_the_same_settings_and_rebuilt_for_others(encoder, tmp_path):
    ids, texts = toy_corpus(30)
    config = MuveraIndexConfig(**SMALL)
    first = open_or_build_index(encoder, ids, texts, tmp_path / "idx", backend=config, progress=False)
    fde_file, vectors = first.directory / "a.muvera.faiss", first.directory / "a.embeddings.npy"
    stamps = fde_file.stat().st_mtime_ns, vectors.stat().st_mtime_ns
    open_or_build_index(encoder, ids, texts, tmp_path / "idx", backend=MuveraIndexConfig(**SMALL), progress=False)
    assert (fde_file.stat().st_mtime_ns, vectors.stat().st_mtime_ns) == stamps, "reused, nothing rewritten"
    for changed in ({"k_sim": 2}, {"seed": 1}, {"transform": "center"}, {"fill_empty": False}):
        other = MuveraIndexConfig(**{**SMALL, **changed})
        rebuilt = open_or_build_index(encoder, ids, texts, tmp_path / "idx", backend=other, progress=False)
        assert {k: rebuilt.backend_settings["params"][k] for k in changed} == changed
        assert fde_file.stat().st_mtime_ns != stamps[0], f"{changed}: the FDEs were rebuilt"
        assert vectors.stat().st_mtime_ns == stamps[1], "only the search structures, not the corpus encoding"
        stamps = fde_file.stat().st_mtime_ns, stamps[1]
    plaid = open_or_build_index(encoder, ids, texts, tmp_path / "idx", backend=PlaidIndexConfig(n_centroids=8),
                                progress=False)
    assert plaid.backend_settings["kind"] == "plaid" and not list(tmp_path.glob("idx/*.muvera.*")), "stale files"


def test_bad_values_are_refused_naming_the_key(encoder, tmp_path):
    for values, key in (({"k_sim": 17}, "k_sim"), ({"k_sim": -1}, "k_sim"), ({"r_reps": 0}, "r_reps"),
                        ({"d_proj": 0}, "d_proj"), ({"d_final": 0}, "d_final"), ({"seed": -1}, "seed"),
                        ({"transform": "pca"}, "transform"), ({"fill_empty": "yes"}, "fill_empty")):
        with pytest.raises(UserError, match=key):
            MuveraIndexConfig(**values)
    with pytest.raises(UserError, match="n_candidates"):
        MuveraSearchConfig(n_candidates=0)
    with pytest.raises(UserError, match="d_proj=32 is larger than the embedding dimension 16"):
        MuveraBackend.resolve_params(MuveraIndexConfig(d_proj=32), n_tokens=100, dim=16)
    with pytest.raises(UserError, match=r"d_final=257 is larger than the FDE dimension 256"):
        MuveraBackend.resolve_params(MuveraIndexConfig(**SMALL, d_final=257), n_tokens=100, dim=16)
    with pytest.raises(UserError, match=r"\['nprobe'\] do not apply to backend 'muvera'"):
        configs_from_params("muvera", {"nprobe": 2})
    ids, texts = toy_corpus(10)
    with pytest.raises(UserError, match="d_final"):
        build_index(encoder, ids, texts, tmp_path / "idx", backend=MuveraIndexConfig(**SMALL, d_final=10 ** 6),
                    progress=False)
    assert not (tmp_path / "idx").exists(), "nothing half-written"


def small_dataset(n_docs: int = 60, n_queries: int = 8) -> BeirDataset:
    """Random short texts of the toy vocabulary, three judged documents per query."""
    rng = np.random.default_rng(3)
    corpus = {f"d{i:02d}": {"title": "", "text": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))}
              for i in range(n_docs)}
    queries = {f"q{i}": " ".join(rng.choice(WORDS, size=4)) for i in range(n_queries)}
    qrels = {q: {f"d{int(j):02d}": 1 for j in rng.choice(n_docs, 3, replace=False)} for q in queries}
    return BeirDataset("muvera", corpus, queries, qrels, split="test", source="memory")


def test_evaluate_full_ranking_through_muvera(hf_tokenizer, tmp_path):
    """``evaluate`` with backend muvera: every document a candidate (the default 100 > 60 documents) gives the
    exhaustive ranking; the details record the index's settings and the candidates as used."""
    model, data = make_encoder(hf_tokenizer, seed=0), small_dataset()
    common = {"k": 10, "progress": False, "metrics": ("ndcg@10",)}
    exhaustive = evaluate(model, data, EvaluationSettings(mode="exhaustive", index_root=None, **common))
    wide = evaluate(model, data, EvaluationSettings(index_root=tmp_path, backend=MuveraIndexConfig(**SMALL),
                                                    **common))
    assert wide.details["backend"]["kind"] == "muvera" and wide.details["backend"]["params"]["r_reps"] == 4
    assert wide.details["search_stats"]["search"] == {"backend": "muvera", "n_candidates": 60}
    for qid, ranking in exhaustive.run.items():
        assert list(wide.run[qid]) == list(ranking), qid
        np.testing.assert_allclose(list(wide.run[qid].values()), list(ranking.values()), atol=1e-5)
    narrow = evaluate(model, data, EvaluationSettings(index_root=tmp_path, backend=MuveraIndexConfig(**SMALL),
                                                      search=MuveraSearchConfig(n_candidates=3), **common))
    assert narrow.details["search_stats"]["search"]["n_candidates"] == 3
    assert narrow.details["search_stats"]["candidates_max"] <= 3


@pytest.mark.integration
def test_fewer_muvera_candidates_than_k_are_said(tiny_model_dir, tmp_path):
    """A head proposing ``n_candidates`` < k documents makes runs shorter than k: said once, as PLAID's ``ndocs``
    (the warning comes from the back-end's own cap, not from a branch on its kind)."""
    from hil.data.beir import load_beir
    from hil.evaluation.evaluate import EvaluationSettings, evaluate
    from hil.modeling.loading import load_encoder
    from hil.retrieval.backends.configs import MuveraIndexConfig, MuveraSearchConfig

    dataset = load_beir("scifact").subset(3, 40, seed=1)
    encoder = load_encoder(str(tiny_model_dir), dim=16)
    settings = EvaluationSettings(mode="full", k=10, index_root=str(tmp_path), progress=False,
                                  backend=MuveraIndexConfig(), search=MuveraSearchConfig(n_candidates=4),
                                  metrics=("ndcg@10",))
    with pytest.warns(UserWarning, match="muvera: n_candidates=4 < k=10"):
        evaluate(encoder, dataset, settings)
