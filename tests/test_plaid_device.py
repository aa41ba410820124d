"""PLAID's search stages on a chosen device (issue 24, item 4): the device-generic torch code gives, on the CPU,
exactly the numbers of the numpy implementation it replaced; every cell probed equals exact search; no stage leaves
the requested device; on a GPU (tests marked ``gpu``) the results equal the CPU's.

Without a GPU "no stage leaves the device" is checked by what can be seen on the CPU: tensors made without the
requested device land on the ``meta`` default device (and break the arithmetic), host copies (``.numpy()``,
``.cpu()``, ``.tolist()``, ``torch.from_numpy``) are refused while a search runs, and the cached tables are checked
to sit on a non-CPU device (``meta``) when asked for one.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from hil.modeling.scoring import masked_max
from hil.retrieval import plaid_search as plaid_module
from hil.retrieval.backends.configs import PlaidIndexConfig, PlaidSearchConfig
from hil.retrieval.builder import build_index
from hil.retrieval.codec import CompressedEmbeddings, fit_residual_codec
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.plaid import CentroidPlan, assign_codes
from hil.retrieval.plaid_search import centroid_interaction, plaid_candidates, plaid_pairs, top_by_score
from hil.retrieval.search import exact_rank
from hil.retrieval.store import length_blocks, padded_rows

from toys import QUERIES, TwoHeadEncoder, make_encoder, random_plan, toy_corpus, unit  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU = torch.device("cpu")


# -- the numpy implementation before issue 24 (commit 5a2686c), kept as the regression oracle -----------------------
# One change: its sums over query tokens add one token at a time (issue 29 made them sequential, so that a query's
# numbers do not depend on the batch it is searched in: hil.retrieval.plaid_search.token_sum).

def sequential_sum(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` in index order, one slice at a time (a loop, the obvious way)."""
    slices = values.unbind(dim)
    total = slices[0].clone()
    for part in slices[1:]:
        total = total + part
    return total


def before_cell_scores(plan, centroid_scores, cells):
    n_tokens_q, nprobe = cells.shape
    flat_cells = cells.reshape(-1).numpy()
    starts, ends = plan.ivf_offsets[flat_cells], plan.ivf_offsets[flat_cells + 1]
    sizes = ends - starts
    if sizes.sum() == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    entry_doc = plan.ivf_docs[np.repeat(starts - np.cumsum(sizes) + sizes, sizes) + np.arange(sizes.sum())]
    entry_token = np.repeat(np.repeat(np.arange(n_tokens_q), nprobe), sizes)
    probe_scores = centroid_scores.gather(1, cells).reshape(-1).numpy()
    entry_score = np.repeat(probe_scores, sizes)
    docs, doc_of_entry = np.unique(entry_doc, return_inverse=True)
    best = torch.full((n_tokens_q * len(docs),), -torch.inf)
    best.scatter_reduce_(0, torch.from_numpy(entry_token * len(docs) + doc_of_entry),
                         torch.from_numpy(entry_score.astype(np.float32)), reduce="amax")
    best = best.view(n_tokens_q, len(docs))
    bound = sequential_sum(torch.where(torch.isinf(best), torch.zeros_like(best), best), dim=0)
    return docs.astype(np.int64), bound.numpy()


def before_centroid_interaction(plan, centroid_scores, docs, block_elements=1 << 22):
    docs = np.asarray(docs, dtype=np.int64)
    out = np.zeros(len(docs), dtype=np.float32)
    if len(docs) == 0 or len(plan.codes) == 0:
        return out
    codes = torch.from_numpy(np.asarray(plan.codes).astype(np.int64))
    table = centroid_scores.t().contiguous()
    n_q = table.shape[1]
    lengths = plan.doc_offsets[docs + 1] - plan.doc_offsets[docs]
    order = np.argsort(lengths, kind="stable")
    for start, end in length_blocks(lengths[order], max(1, block_elements // n_q)):
        block = order[start:end]
        rows, mask = padded_rows(plan.doc_offsets, docs[block])
        sims = table[codes[rows]].transpose(1, 2)
        out[block] = sequential_sum(masked_max(sims, mask[:, None, :]), dim=1).numpy()
    return out


def before_top_by_score(docs, scores, count):
    if len(docs) <= count:
        return docs, scores
    keep = np.lexsort((docs, -scores))[:count]
    keep.sort()
    return docs[keep], scores[keep]


def before_plaid_candidates(plan, query, *, nprobe, ndocs, stage2_docs):
    scores = query.float() @ torch.from_numpy(plan.centroids).T
    cells = scores.topk(min(nprobe, scores.shape[1]), dim=1, sorted=False).indices
    docs, bound = before_cell_scores(plan, scores, cells)
    n_probed = len(docs)
    docs, _ = before_top_by_score(docs, bound, stage2_docs)
    approx = before_centroid_interaction(plan, scores, docs)
    docs, approx = before_top_by_score(docs, approx, ndocs)
    return docs, approx, {"probed_docs": n_probed}


# -- the device-generic code on the CPU equals the numpy implementation ------------------------------------------

PLANS = {"many documents": (400, 16, 24, 9, 0), "tie-heavy": (300, 8, 3, 4, 1)}
SETTINGS = [(1, 5, 20), (2, 10, 10), (4, 3, 50), (8, 40, 160), (64, 500, 500)]  # (nprobe, ndocs, stage2_docs)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("device", [None, CPU, "cpu"], ids=["query's", "torch.device", "str"])
@pytest.mark.parametrize("dense_ratio", [0, 1 << 30], ids=["stage 2 sorted", "stage 2 dense"])
def test_the_stages_on_the_cpu_equal_the_numpy_implementation(plan_name, device, dense_ratio, monkeypatch):
    monkeypatch.setattr(plaid_module, "_DENSE_RATIO", dense_ratio)
    n_docs, dim, n_centroids, max_len, seed = PLANS[plan_name]
    plan = random_plan(n_docs, dim, n_centroids, max_len, seed)
    ties = 0
    for q, (nprobe, ndocs, stage2_docs) in enumerate(SETTINGS * 2):
        query = torch.from_numpy(unit(1 + q % 6, dim, 100 + q))
        docs, approx, counts = plaid_candidates(plan, query, nprobe=nprobe, ndocs=ndocs, stage2_docs=stage2_docs,
                                                device=device)
        want_docs, want_approx, want_counts = before_plaid_candidates(plan, query, nprobe=nprobe, ndocs=ndocs,
                                                                      stage2_docs=stage2_docs)
        assert docs.device == CPU and docs.dtype == torch.int64 and approx.dtype == torch.float32
        np.testing.assert_array_equal(docs.numpy(), want_docs)
        np.testing.assert_array_equal(approx.numpy(), want_approx)  # bit for bit
        assert counts == want_counts
        ties += len(want_approx) - len(np.unique(want_approx))
    if plan_name == "tie-heavy":
        assert ties > 0, "ties at the cuts are exercised"


@pytest.mark.parametrize("block_elements", [1, 7, 64, 1 << 22])
def test_centroid_interaction_in_blocks_equals_the_numpy_implementation(block_elements):
    plan = random_plan(200, 8, 12, 30, 5)
    query = torch.from_numpy(unit(5, 8, 6))
    scores = query @ torch.from_numpy(plan.centroids).T
    docs = np.random.default_rng(0).permutation(200)[:150]  # unsorted, with empty documents among them
    got = centroid_interaction(plan, scores, torch.from_numpy(docs), block_elements=block_elements)
    want = before_centroid_interaction(plan, scores, docs, block_elements=block_elements)
    np.testing.assert_array_equal(got.numpy(), want)


def test_top_by_score_keeps_the_numpy_tie_rule():
    rng = np.random.default_rng(3)
    for case in range(40):
        docs = rng.choice(1000, size=60, replace=False).astype(np.int64)  # any order: kept as given
        docs = np.sort(docs) if case % 2 else docs
        scores = rng.integers(0, 4, size=60).astype(np.float32)  # four values: ties everywhere
        count = int(rng.integers(1, 60))
        got_docs, got_scores = top_by_score(torch.from_numpy(docs), torch.from_numpy(scores), count)
        want_docs, want_scores = before_top_by_score(docs, scores, count)
        np.testing.assert_array_equal(got_docs.numpy(), want_docs)
        np.testing.assert_array_equal(got_scores.numpy(), want_scores)


# -- no stage leaves the requested device ----------------------------------------------------------------------

HOST_COPIES = {"numpy", "tolist", "cpu", "__array__"}


class DeviceWatch(TorchFunctionMode):
    """Records host copies and every torch result that is not on ``device`` while a search runs."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.host_copies: list[str] = []
        self.elsewhere: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_COPIES:
            self.host_copies.append(name)
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.device != self.device:
                self.elsewhere.append(f"{name} -> {value.device}")
        return out


def refuse_from_numpy(*args, **kwargs):
    raise AssertionError("torch.from_numpy during a search: a host array entered a stage")


def watched_search(plan: CentroidPlan, query: torch.Tensor, device: torch.device, monkeypatch, **settings):
    """``plaid_candidates`` with the tables already uploaded, the default device set to ``meta`` (a tensor made
    without ``device=`` lands there) and host copies recorded. -> (docs, approx, watch)."""
    plan.tables(device)  # the upload an index opening does once
    query = query.to(device)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "from_numpy", refuse_from_numpy)
        with torch.device("meta"), DeviceWatch(device) as watch:
            docs, approx, _ = plaid_candidates(plan, query, device=device, **settings)
    return docs, approx, watch


@pytest.mark.parametrize("settings", [dict(nprobe=2, ndocs=10, stage2_docs=30), dict(nprobe=24, ndocs=400,
                                                                                        stage2_docs=400)])
def test_no_stage_makes_a_tensor_elsewhere_or_copies_to_the_host(monkeypatch, settings):
    plan = random_plan(400, 16, 24, 9, 0)
    query = torch.from_numpy(unit(6, 16, 9))
    docs, approx, watch = watched_search(plan, query, CPU, monkeypatch, **settings)
    assert watch.host_copies == [] and watch.elsewhere == []
    want_docs, want_approx, _ = before_plaid_candidates(plan, query, **settings)
    np.testing.assert_array_equal(docs.numpy(), want_docs)
    np.testing.assert_array_equal(approx.numpy(), want_approx)


def test_the_watch_sees_a_stray_tensor_and_a_host_copy(monkeypatch):
    """The check above can fail: a tensor made without ``device=`` and a round trip through numpy are both seen."""
    with torch.device("meta"), DeviceWatch(CPU) as watch:
        stray = torch.zeros(3)
    assert stray.device.type == "meta" and watch.elsewhere == ["zeros -> meta"]
    with DeviceWatch(CPU) as watch:
        torch.arange(3).numpy()
    assert watch.host_copies == ["numpy"]
    plan = random_plan(50, 8, 6, 5, 2)  # not uploaded yet: the search would read the host arrays
    with pytest.raises(AssertionError, match="from_numpy"):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "from_numpy", refuse_from_numpy)
            plaid_candidates(plan, torch.zeros(2, 8), nprobe=2, ndocs=3, device=CPU)


def test_tables_are_uploaded_once_to_the_device_asked_for():
    plan = random_plan(60, 8, 6, 5, 4)
    cpu = plan.tables(CPU)
    assert plan.tables("cpu") is cpu and plan.tables() is cpu  # cached: one upload per device and opening
    meta = plan.tables(torch.device("meta"))  # a non-CPU device without a GPU: only placement can be checked
    for name, tensor in vars(meta).items():
        assert tensor.device.type == "meta", name
        assert tensor.shape == getattr(cpu, name).shape, name
    # each document's distinct centroids, ascending, against a loop over its tokens
    starts, ends = cpu.doc_code_offsets[:-1].numpy(), cpu.doc_code_offsets[1:].numpy()
    for doc in range(len(plan.doc_offsets) - 1):
        expected = np.unique(plan.codes[plan.doc_offsets[doc]: plan.doc_offsets[doc + 1]])
        np.testing.assert_array_equal(cpu.doc_codes.numpy()[starts[doc]: ends[doc]], expected)
    np.testing.assert_array_equal(cpu.ivf_docs.numpy(), plan.ivf_docs)
    np.testing.assert_array_equal(cpu.doc_offsets.numpy(), plan.doc_offsets)
    np.testing.assert_array_equal(cpu.ivf_offsets.numpy(), plan.ivf_offsets)
    np.testing.assert_array_equal(cpu.centroids.numpy(), plan.centroids)


def compressed_table(n_tokens: int = 300, dim: int = 16, nbits: int = 2) -> tuple[CompressedEmbeddings, np.ndarray]:
    vectors, centroids = unit(n_tokens, dim, 20), unit(12, dim, 21)
    codes = assign_codes(vectors, centroids)
    codec = fit_residual_codec(vectors, codes, centroids, nbits)
    return CompressedEmbeddings(codec, codes, codec.compress(vectors, codes)), vectors


def test_decompression_runs_on_the_device_asked_for():
    """Only the centroid ids and packed bytes are read on the host; every float is computed on the device (the
    ``meta`` device stands in for a GPU: its tensors have shapes but no values)."""
    table, _ = compressed_table()
    rows = torch.tensor([5, 0, 299, 5])
    with DeviceWatch(torch.device("meta")) as watch:
        vectors = table.rows_torch(rows, device="meta")
    assert vectors.device.type == "meta" and vectors.shape == (4, 16)
    computed_on_host = [entry for entry in watch.elsewhere if entry != "cpu -> cpu"]  # the rows, read there
    assert not computed_on_host, computed_on_host
    byte_table, centroids = table.codec.device_tables("meta")
    assert byte_table.device.type == centroids.device.type == "meta"
    assert table.codec.device_tables("meta")[0] is byte_table


def test_decompression_on_the_cpu_is_unchanged():
    table, _ = compressed_table()
    rows = np.array([5, 0, 299, 5, 17])
    got = table.rows_torch(torch.from_numpy(rows), device=CPU).numpy()
    codec = table.codec
    # the decompression formula written out: normalize(C_code + w[bucket of each dimension])
    buckets = (table.packed[rows][:, :, None] >> (np.arange(codec.per_byte) * codec.nbits)) & ((1 << codec.nbits) - 1)
    residual = codec.weights[buckets.reshape(len(rows), -1)]
    raw = codec.centroids[table.codes[rows]] + residual
    np.testing.assert_allclose(got, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_array_equal(got, table[rows])  # the array view and the tensor path agree bit for bit


# -- end to end on an index: every cell probed equals exact search; the device setting reaches the stages ---------

@pytest.fixture(scope="module")
def indexes(hf_tokenizer, tmp_path_factory):
    encoder = make_encoder(hf_tokenizer, TwoHeadEncoder, seed=1)
    ids, texts = toy_corpus(60)
    root = tmp_path_factory.mktemp("plaid_device")
    plain = build_index(encoder, ids, texts, root / "plain", backend=PlaidIndexConfig(n_centroids=16, niter=5),
                        progress=False)
    compressed = build_index(encoder, ids, texts, root / "compressed", progress=False,
                             backend=PlaidIndexConfig(n_centroids=16, niter=5, residual_bits=2, keep_embeddings=False))
    return encoder, plain, compressed


@pytest.mark.parametrize("which", ["plain", "compressed"])
def test_every_cell_probed_on_an_explicit_device_equals_exact(indexes, which):
    encoder, plain, compressed = indexes
    index = plain if which == "plain" else compressed
    every = PlaidSearchConfig(nprobe=16, ndocs=index.n_docs, stage2_docs=index.n_docs)
    exact = exact_rank(encoder, index, QUERIES, k=20, progress=False)
    for device in (None, "cpu", CPU):
        result = full_rank(encoder, index, QUERIES, k=20, search=every, device=device, progress=False)
        for qid in QUERIES:
            assert list(result.run[qid]) == list(exact.run[qid]), (device, qid)
            np.testing.assert_allclose(list(result.run[qid].values()), list(exact.run[qid].values()), atol=1e-5)


def test_full_rank_passes_its_device_to_the_stages(indexes, monkeypatch):
    encoder, plain, _ = indexes
    import hil.retrieval.backends.centroid as centroid

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["device"])
        return plaid_pairs(*args, **kwargs)

    monkeypatch.setattr(centroid, "plaid_pairs", recording)
    search = PlaidSearchConfig(nprobe=2, ndocs=5, stage2_docs=20)
    default = full_rank(encoder, plain, {"q1": QUERIES["q1"]}, k=5, search=search, progress=False)
    assert seen == [encoder.device] * 2  # both heads, on the encoder's device
    seen.clear()
    explicit = full_rank(encoder, plain, {"q1": QUERIES["q1"]}, k=5, search=search, device="cpu", progress=False)
    assert seen == [CPU] * 2 and explicit.run == default.run
    with pytest.raises(ValueError, match="device 'gpu'"):
        full_rank(encoder, plain, {"q1": QUERIES["q1"]}, k=5, search=search, device="gpu", progress=False)



def test_an_opened_backend_searches_on_its_device(indexes, monkeypatch):
    """``open_backend(..., device=...)`` overrides the queries' device (``meta`` marks it: no GPU needed)."""
    encoder, plain, _ = indexes
    import hil.retrieval.backends.centroid as centroid
    from hil.retrieval.backends.registry import open_backend
    from hil.retrieval.encoding import eval_mode

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["device"])
        return plaid_pairs(*args, **{**kwargs, "device": CPU})

    monkeypatch.setattr(centroid, "plaid_pairs", recording)
    with eval_mode(encoder):
        queries = encoder.encode_queries([QUERIES["q1"]])
    open_backend(plain, device=torch.device("meta"), depth=5).candidates(queries, ("a", "b"))
    assert seen == [torch.device("meta")] * 2
    seen.clear()
    open_backend(plain, depth=5).candidates(queries, ("a", "b"))
    assert seen == [queries.mask.device] * 2

# -- on a GPU: the same results as on the CPU ----------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("settings", [dict(nprobe=2, ndocs=10, stage2_docs=30), dict(nprobe=8, ndocs=40,
                                                                                        stage2_docs=160)])
def test_gpu_stages_equal_the_cpu_stages_and_stay_on_the_gpu(monkeypatch, settings):
    cuda = torch.device("cuda", torch.cuda.current_device())
    plan = random_plan(400, 16, 24, 9, 0)
    for q in range(6):
        query = torch.from_numpy(unit(1 + q, 16, 50 + q))
        docs, approx, watch = watched_search(plan, query, cuda, monkeypatch, **settings)
        assert watch.host_copies == [] and watch.elsewhere == [], (watch.host_copies, watch.elsewhere)
        assert docs.device == approx.device == cuda
        want_docs, want_approx, _ = plaid_candidates(plan, query, device=CPU, **settings)
        np.testing.assert_array_equal(docs.cpu().numpy(), want_docs.numpy())
        np.testing.assert_allclose(approx.cpu().numpy(), want_approx.numpy(), rtol=1e-5, atol=1e-6)
    assert all(t.device == cuda for t in vars(plan.tables("cuda")).values())
    assert plan.tables("cuda") is plan.tables(cuda)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decompression_equals_the_cpu():
    table, _ = compressed_table()
    rows = torch.tensor([5, 0, 299, 5, 17])
    on_gpu = table.rows_torch(rows, device="cuda")
    assert on_gpu.device.type == "cuda"
    np.testing.assert_allclose(on_gpu.cpu().numpy(), table.rows_torch(rows).numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("which", ["plain", "compressed"])
def test_gpu_full_rank_equals_the_cpu(indexes, which):
    encoder, plain, compressed = indexes
    index = plain if which == "plain" else compressed
    search = PlaidSearchConfig(nprobe=2, ndocs=6, stage2_docs=20)
    options = dict(k=10, search=search, keep_candidate_sources=True, progress=False)
    gpu_encoder = copy.deepcopy(encoder).to("cuda")
    on_gpu = full_rank(gpu_encoder, index, QUERIES, **options)  # the encoder's device by default
    cuda = torch.device("cuda", torch.cuda.current_device())
    plans = [plan for key, plan in index.search_structures.items() if key[0] == "plan"]
    assert plans and all(cuda in plan.__dict__["_tables"] for plan in plans), "searched on the GPU"
    # the same query vectors searched on the CPU: the same candidates, hence the same exact scores on the GPU
    searched_on_cpu = full_rank(gpu_encoder, index, QUERIES, device="cpu", **options)
    assert searched_on_cpu.sources == on_gpu.sources and searched_on_cpu.run == on_gpu.run
    # end to end against a CPU encoder (its query vectors differ in the last bits)
    on_cpu = full_rank(encoder, index, QUERIES, **options)
    assert on_cpu.sources == on_gpu.sources
    for qid in QUERIES:
        assert list(on_gpu.run[qid]) == list(on_cpu.run[qid]), qid
        np.testing.assert_allclose(list(on_gpu.run[qid].values()), list(on_cpu.run[qid].values()), atol=1e-4)
