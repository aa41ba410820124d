"""Spherical k-means in torch (hil.retrieval.kmeans) against FAISS's ``Kmeans(spherical=True)``, numpy and hand
computations; the build setting ``PlaidIndexConfig.kmeans`` (resolution, record, reuse) and an index built with it.

Data: clustered synthetic unit vectors (blobs) and real token vectors (SciFact documents through the tiny shared
BERT with a seeded random 32-d head). The inertia compared is ``sum_i (1 - max_c x_i . c)`` (the stricter end of
the spherical objective: kmeans.py's docstring).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hil.errors import UserError
from hil.retrieval import kmeans as kmeans_module
from hil.retrieval.backends.configs import PlaidIndexConfig, PlaidSearchConfig
from hil.retrieval.builder import _same_build_params, build_index, open_or_build_index
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.index import INDEX_JSON
from hil.retrieval.kmeans import (
    KMeansEngine,
    kmeans_engine,
    nearest_centroids,
    spherical_inertia,
    spherical_kmeans,
    split_pairs,
)
from hil.retrieval.plaid import assign_codes, train_centroids
from hil.retrieval.search import exact_rank

from toys import QUERIES, make_encoder, toy_corpus  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True, scope="module")
def one_faiss_thread():
    import faiss

    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # small problems, a shared machine
    yield
    faiss.omp_set_num_threads(previous)


def unit_rows(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def blobs(n: int, dim: int, n_blobs: int, spread: float, seed: int) -> np.ndarray:
    """``n`` unit vectors around ``n_blobs`` random unit directions (Gaussian noise of ``spread`` per coordinate)."""
    rng = np.random.default_rng(seed)
    centers = unit_rows(rng.standard_normal((n_blobs, dim)))
    return unit_rows(centers[rng.integers(0, n_blobs, n)] + spread * rng.standard_normal((n, dim)))


def numpy_inertia(x: np.ndarray, centroids: np.ndarray) -> float:
    """The reference: ``sum_i (1 - max_c x_i . c)`` in float64, by brute force."""
    return float((1.0 - (x.astype(np.float64) @ centroids.astype(np.float64).T).max(axis=1)).sum())


def faiss_kmeans(x: np.ndarray, k: int, niter: int, seed: int, init: np.ndarray | None = None):
    import faiss

    kmeans = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, spherical=True, verbose=False,
                          max_points_per_centroid=len(x))  # no subsampling: the same sample as ours
    kmeans.train(x, init_centroids=None if init is None else init.copy())
    return kmeans


@pytest.fixture(scope="module")
def token_vectors(shared_dir) -> np.ndarray:
    """Real token vectors: 100 SciFact documents, tiny BERT, a seeded random 32-d head, fp16 as an index stores."""
    from hil.modeling.encoder import ColBERTEncoder
    from hil.retrieval.encoding import encode_document_tokens, eval_mode

    texts = []
    with open(shared_dir / "data" / "beir" / "scifact" / "corpus.jsonl", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            texts.append(f"{record['title']} {record['text']}")
            if len(texts) == 100:
                break
    torch.manual_seed(0)
    encoder = ColBERTEncoder(str(shared_dir / "models" / "bert-tiny-splade"), dim=32, doc_maxlen=128)
    with eval_mode(encoder):
        return encode_document_tokens(encoder, texts).embeddings["colbert"]  # (~11k, 32) fp16


# -- assignment ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("blocks", [(None, None), (7, None), (None, 3), (5, 4), (1000, 1000)])
def test_nearest_centroids_is_the_numpy_argmax(blocks):
    points, centroids = unit_rows(np.random.default_rng(0).standard_normal((300, 16))), blobs(23, 16, 5, 0.5, 1)
    codes, scores = nearest_centroids(torch.from_numpy(points), torch.from_numpy(centroids),
                                      block_rows=blocks[0], block_centroids=blocks[1])
    reference = points.astype(np.float64) @ centroids.astype(np.float64).T
    np.testing.assert_array_equal(codes.numpy(), reference.argmax(axis=1))
    np.testing.assert_allclose(scores.numpy(), reference.max(axis=1), atol=1e-6)


@pytest.mark.parametrize("block_centroids", [None, 1, 2])
def test_nearest_centroids_breaks_ties_by_the_lowest_number(block_centroids):
    """FAISS's IndexFlatIP keeps the lowest centroid number among equal scores; so must every block layout."""
    centroids = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    points = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    codes, _ = nearest_centroids(points, centroids, block_centroids=block_centroids)
    assert codes.tolist() == [1, 0, 0]


def test_assign_codes_in_torch_equals_faiss_and_numpy(token_vectors):
    centroids = unit_rows(token_vectors[::50].astype(np.float32))  # (~350, 32)
    faiss_codes = assign_codes(token_vectors, centroids)
    torch_codes = assign_codes(token_vectors, centroids, engine=KMeansEngine("torch", torch.device("cpu")),
                               block_tokens=4096)
    reference = np.argmax(token_vectors.astype(np.float64) @ centroids.astype(np.float64).T, axis=1)
    assert torch_codes.dtype == faiss_codes.dtype == np.uint16
    np.testing.assert_array_equal(torch_codes, reference)
    np.testing.assert_array_equal(torch_codes, faiss_codes)


# -- k-means ------------------------------------------------------------------------------------------------------

def test_torch_kmeans_follows_faiss_from_the_same_start():
    """Same initial centroids: the same iterations (assign, mean, normalize) as FAISS's, to fp32 rounding."""
    x = blobs(6000, 24, 60, 0.25, 3)
    init = x[np.random.default_rng(3).choice(len(x), 40, replace=False)]
    reference = faiss_kmeans(x, 40, niter=6, seed=0, init=init)
    result = spherical_kmeans(torch.from_numpy(x), 40, niter=6, init_centroids=torch.from_numpy(init))
    np.testing.assert_allclose(result.centroids.numpy(), reference.centroids, atol=2e-6)
    np.testing.assert_allclose(result.objective, reference.obj, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("data", ["blobs", "tokens"])
def test_inertia_within_one_percent_of_faiss(data, seed, request):
    """Each from its own seeded start (other random numbers than FAISS's): the goal of issue 29."""
    if data == "blobs":
        x16, k, niter = blobs(20000, 32, 300, 0.3, seed), 128, 10
    else:
        x16, k, niter = request.getfixturevalue("token_vectors"), 128, 4
    x = x16.astype(np.float32)
    ours = spherical_kmeans(torch.from_numpy(x16), k, niter=niter, seed=seed).centroids.numpy()
    theirs = faiss_kmeans(x, k, niter=niter, seed=seed).centroids
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    assert numpy_inertia(x, ours) <= 1.01 * numpy_inertia(x, theirs)
    assert spherical_inertia(torch.from_numpy(x), torch.from_numpy(ours)) == pytest.approx(numpy_inertia(x, ours),
                                                                                        rel=1e-5)


def test_blocked_kmeans_equals_unblocked():
    x = torch.from_numpy(blobs(3000, 16, 40, 0.3, 5))
    whole = spherical_kmeans(x, 32, niter=5, seed=4)
    blocked = spherical_kmeans(x, 32, niter=5, seed=4, block_rows=257, block_centroids=5)
    np.testing.assert_allclose(blocked.centroids.numpy(), whole.centroids.numpy(), atol=1e-6)
    np.testing.assert_allclose(blocked.objective, whole.objective, rtol=1e-6)


def test_kmeans_is_deterministic_for_a_seed():
    x = torch.from_numpy(blobs(3000, 16, 40, 0.3, 6)).half()  # stored dtype: fp16
    first, again = (spherical_kmeans(x, 32, niter=4, seed=9).centroids for _ in range(2))
    other = spherical_kmeans(x, 32, niter=4, seed=10).centroids
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_empty_cluster_takes_half_of_the_cluster_it_splits():
    """A hand-made case: A = 3 points near e1 (one centroid), B = 1 point at e2 (one centroid), and a third
    centroid (-e1) that nobody picks. Only A can be split (weight count - 1 = 2; B's is 0): the empty centroid
    becomes A's mean times (1 + eps, 1 - eps, ...), A's times (1 - eps, 1 + eps, ...), both normalized (FAISS's
    split_clusters, eps = 1/1024). FAISS, from the same start, does the same."""
    eps = 1 / 1024
    a = unit_rows(np.array([[1.0, 0.1, 0.0, 0.0], [1.0, 0.0, 0.1, 0.0], [1.0, 0.0, 0.0, 0.1]]))
    x = np.concatenate([a, np.array([[0.0, 1.0, 0.0, 0.0]], dtype=np.float32)])
    init = np.array([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [-1.0, 0, 0, 0]], dtype=np.float32)
    result = spherical_kmeans(torch.from_numpy(x), 3, niter=1, init_centroids=torch.from_numpy(init))
    mean = a.mean(axis=0)
    up = np.array([1 + eps, 1 - eps, 1 + eps, 1 - eps])
    expected = unit_rows(np.stack([mean * (2 - up), [0, 1.0, 0, 0], mean * up]))
    assert result.n_split == [1]
    np.testing.assert_allclose(result.centroids.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(result.centroids.numpy(), faiss_kmeans(x, 3, 1, 0, init).centroids, atol=1e-6)


def test_split_pairs_draws_in_proportion_to_count_minus_one():
    """Counts (0, 3, 5): donors 1 and 2 with weights 2 and 4, so cluster 2 about two thirds of the time; a later
    empty cluster sees the halved count (the even split FAISS assumes)."""
    rng = np.random.default_rng(0)
    donors = [split_pairs(np.array([0, 3, 5]), rng)[0][1] for _ in range(3000)]
    assert np.mean(np.array(donors) == 2) == pytest.approx(2 / 3, abs=0.03)
    assert split_pairs(np.array([0, 5, 1, 0]), rng)[0] == (0, 1)  # the only cluster with count > 1
    # Counts (0, 0, 4): cluster 0 splits 2, which leaves 2 + 2, so cluster 1 then splits 0 or 2, about equally.
    seconds = [split_pairs(np.array([0, 0, 4]), rng) for _ in range(400)]
    assert all(pairs[0] == (0, 2) and pairs[1][0] == 1 for pairs in seconds)
    assert np.mean([pairs[1][1] == 0 for pairs in seconds]) == pytest.approx(0.5, abs=0.1)


def test_kmeans_refuses_bad_input():
    with pytest.raises(ValueError, match="n_centroids"):
        spherical_kmeans(torch.ones(3, 2), 4, niter=1)
    with pytest.raises(ValueError, match="NaN"):
        spherical_kmeans(torch.tensor([[1.0, 0.0], [float("nan"), 0.0]]), 1, niter=1)


# -- the build setting --------------------------------------------------------------------------------------------

def test_kmeans_engine_resolution(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(kmeans_module, "faiss_gpu_count", lambda: 0)  # faiss-cpu, as with CUDA 13 torch
    assert kmeans_engine("auto", cpu) == KMeansEngine("faiss", cpu, None)
    assert kmeans_engine("torch", cpu) == KMeansEngine("torch", cpu, None)
    assert kmeans_engine("auto", gpu) == KMeansEngine("torch", gpu, None)
    assert kmeans_engine("faiss", gpu) == KMeansEngine("faiss", cpu, None)
    monkeypatch.setattr(kmeans_module, "faiss_gpu_count", lambda: 1)  # faiss-gpu sees cuda:0
    assert kmeans_engine("auto", gpu) == KMeansEngine("faiss", cpu, 0)
    assert kmeans_engine("torch", gpu) == KMeansEngine("torch", gpu, None)
    for requested in ("auto", "faiss", "torch"):  # a recorded name resolves to the engine that recorded it
        for faiss_gpus in (0, 1):
            monkeypatch.setattr(kmeans_module, "faiss_gpu_count", lambda n=faiss_gpus: n)
            for device in (cpu, gpu):
                engine = kmeans_engine(requested, device)
                assert kmeans_engine(engine.name, device) == engine
    with pytest.raises(UserError, match="kmeans"):
        PlaidIndexConfig(kmeans="cuda")


def test_auto_matches_any_recorded_choice_an_explicit_name_only_its_own():
    stored = {"n_centroids": 16, "kmeans": "torch"}
    assert _same_build_params({"n_centroids": 16, "kmeans": "auto"}, stored)
    assert _same_build_params({"n_centroids": 16, "kmeans": "auto"}, {"n_centroids": 16})  # built before the key
    assert _same_build_params({"n_centroids": 16, "kmeans": "torch"}, stored)
    assert not _same_build_params({"n_centroids": 16, "kmeans": "faiss"}, stored)
    assert not _same_build_params({"n_centroids": 8, "kmeans": "auto"}, stored)


@pytest.fixture(scope="module")
def two_plaid_indexes(hf_tokenizer, tmp_path_factory):
    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus(80)
    root = tmp_path_factory.mktemp("kmeans")
    built = {kind: build_index(encoder, ids, texts, root / kind, progress=False,
                               backend=PlaidIndexConfig(n_centroids=16, niter=5, kmeans=kind))
             for kind in ("faiss", "torch")}
    return encoder, ids, texts, root, built


def test_index_built_with_torch_kmeans_records_it_and_ranks_as_faiss_built(two_plaid_indexes):
    encoder, _, _, _, built = two_plaid_indexes
    assert built["torch"].backend_settings["params"]["kmeans"] == "torch"
    assert built["faiss"].backend_settings["params"]["kmeans"] == "faiss"
    vectors, params = built["torch"].embeddings["colbert"], built["torch"].backend_settings["params"]
    for kind, engine in (("torch", KMeansEngine("torch", torch.device("cpu"))), ("faiss", None)):
        expected = train_centroids(vectors, 16, train_size=params["train_size"], niter=5, seed=0,
                                   **({"engine": engine} if engine else {}))
        np.testing.assert_array_equal(np.load(built[kind].directory / "colbert.centroids.npy"), expected)
    assert built["torch"].meta["encoding_batch_size"] == 32  # the CPU default
    every = PlaidSearchConfig(nprobe=16, ndocs=80, stage2_docs=80)  # every cell, every document: exact ranking
    exact = exact_rank(encoder, built["faiss"], QUERIES, k=10, progress=False)
    for index in built.values():
        result = full_rank(encoder, index, QUERIES, k=10, search=every, progress=False)
        assert {q: list(r) for q, r in result.run.items()} == {q: list(r) for q, r in exact.run.items()}
    default = {kind: full_rank(encoder, index, QUERIES, k=10, progress=False) for kind, index in built.items()}
    overlap = [len(set(default["torch"].run[q]) & set(default["faiss"].run[q])) / 10 for q in QUERIES]
    assert np.mean(overlap) >= 0.7


def test_auto_reuses_a_torch_built_index_and_faiss_rebuilds_its_centroids(two_plaid_indexes, caplog):
    encoder, ids, texts, root, built = two_plaid_indexes
    config = PlaidIndexConfig(n_centroids=16, niter=5)  # kmeans: auto (FAISS here, on the CPU)
    fresh = build_index(encoder, ids, texts, root / "auto", backend=config, progress=False)
    assert fresh.backend_settings["params"]["kmeans"] == "faiss"
    reused = open_or_build_index(encoder, ids, texts, root / "torch", backend=config, progress=False)
    assert reused.backend_settings["params"]["kmeans"] == "torch"
    assert (root / "torch" / "colbert.centroids.npy").read_bytes() == (
        built["torch"].directory / "colbert.centroids.npy").read_bytes()
    rebuilt = open_or_build_index(encoder, ids, texts, root / "torch", progress=False,
                                  backend=PlaidIndexConfig(n_centroids=16, niter=5, kmeans="faiss"))
    assert rebuilt.backend_settings["params"]["kmeans"] == "faiss"
    meta = json.loads((root / "torch" / INDEX_JSON).read_text())
    assert meta["backend"]["params"]["kmeans"] == "faiss"


def test_torch_engine_trains_centroids_on_the_sample_faiss_gets(token_vectors):
    """train_centroids: both engines cluster the same seeded sample (the torch one in its stored fp16), the
    inertia on that sample within 1%."""
    engine = KMeansEngine("torch", torch.device("cpu"))
    ours = train_centroids(token_vectors, 128, train_size=8000, niter=4, seed=2, engine=engine)
    theirs = train_centroids(token_vectors, 128, train_size=8000, niter=4, seed=2)
    rows = np.sort(np.random.default_rng(2).choice(len(token_vectors), 8000, replace=False))
    direct = spherical_kmeans(torch.from_numpy(token_vectors[rows]), 128, niter=4, seed=2).centroids.numpy()
    np.testing.assert_allclose(ours, direct, atol=1e-7)
    np.testing.assert_allclose(theirs, faiss_kmeans(token_vectors[rows].astype(np.float32), 128, 4, 2).centroids,
                               atol=1e-7)
    sample = token_vectors[rows].astype(np.float32)
    assert numpy_inertia(sample, ours) <= 1.01 * numpy_inertia(sample, theirs)


# -- on a GPU (skipped here) --------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
def test_cuda_kmeans_is_deterministic_and_agrees_with_the_cpu(token_vectors):
    x = torch.from_numpy(token_vectors)
    first, again = (spherical_kmeans(x.cuda(), 256, niter=4, seed=0) for _ in range(2))
    assert torch.equal(first.centroids, again.centroids)  # index_put_(accumulate=True): no atomics
    on_cpu = spherical_kmeans(x, 256, niter=4, seed=0)
    assert abs(first.objective[-1] - on_cpu.objective[-1]) <= 1e-4 * abs(on_cpu.objective[-1])
    codes, _ = nearest_centroids(x.cuda(), on_cpu.centroids.cuda())
    reference, _ = nearest_centroids(x, on_cpu.centroids)
    assert (codes.cpu() != reference).float().mean() < 1e-3  # fp32 rounding: near-ties only


@pytest.mark.gpu
@needs_gpu
def test_cuda_kmeans_ignores_tf32(token_vectors):
    """A process that allowed TF32 (training does) still assigns with full fp32 products."""
    x, centroids = torch.from_numpy(token_vectors).cuda(), torch.from_numpy(unit_rows(token_vectors[::40])).cuda()
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        codes, _ = nearest_centroids(x, centroids)
    finally:
        torch.set_float32_matmul_precision(previous)
    reference = np.argmax(token_vectors.astype(np.float64) @ unit_rows(token_vectors[::40]).astype(np.float64).T, 1)
    assert (codes.cpu().numpy() != reference).mean() < 1e-3


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_starting_centroids_are_distinct_points_for_every_seed(seed):
    # As many centroids as points: distinct starting points make every point its own centroid after one step (no
    # cluster empty, the centroids are the points); a repeated starting point leaves a cluster empty, re-seeded.
    points = torch.nn.functional.normalize(torch.randn(64, 8, generator=torch.Generator().manual_seed(seed)), dim=1)
    result = kmeans_module.spherical_kmeans(points, 64, niter=1, seed=seed)
    assert result.n_split == [0]
    best, nearest = (points @ result.centroids.T).max(dim=1)  # each point's own centroid, one to one
    assert sorted(nearest.tolist()) == list(range(64)) and bool((best > 1 - 1e-5).all())
