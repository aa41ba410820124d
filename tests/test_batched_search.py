"""Batched full ranking (issue 29, item 3): a batch of queries searched at once gives the rankings of the same
queries searched one at a time -- every back-end, ColBERT, a two-head model and ColBERT-HIL (running and per-query
z-scores) -- and each batched piece equals a slow reference written out here: the per-group top count, trec_eval's
order, the union over heads, documents gathered on the device, the exact pair scores, PLAID's stages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hil.data.ranking import id_rank, top_k_indices
from hil.modeling.hil import HILEncoder
from hil.retrieval import plaid_search
from hil.retrieval.backends.base import CandidatePairs, Candidates
from hil.retrieval.backends.configs import IvfFlatIndexConfig, PlaidIndexConfig, PlaidSearchConfig
from hil.retrieval.builder import build_index
from hil.retrieval.device_tokens import device_tokens
from hil.retrieval.encoding import eval_mode
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.pair_scoring import pair_scores, ranked_pairs
from hil.retrieval.plaid_search import (
    best_in_groups,
    plaid_candidates,
    plaid_pairs,
    probe_cells,
    probed_pairs,
    query_centroid_scores,
)
from hil.retrieval.search import score_documents
from hil.retrieval.store import TokenStore, gather_documents

from conftest import random_bert
from toys import TwoHeadEncoder, make_encoder, random_plan, toy_corpus, unit

# queries whose ids are corpus ids too (skip_self has something to skip), of different lengths
QUERIES = {"d007": "protein gene therapy", "q2": "tumor growth in the mouse brain", "d014": "vaccine dose trial",
           "q10": "insulin signal receptor", "q4": "heart and lung risk", "q5": "what is a cell?",
           "q6": "blood", "q7": "model effect rate level study patient"}


# -- the batched pieces against slow references -------------------------------------------------------------------

def test_best_in_groups_equals_a_loop_with_the_tie_rule():
    """Each group's ``count`` best by score, ties to the lower document: against a lexsort per group."""
    rng = np.random.default_rng(0)
    checked_ties = 0
    for case in range(60):
        n_groups = int(rng.integers(1, 6))
        sizes = rng.integers(0, 25, size=n_groups)
        group = np.repeat(np.arange(n_groups), sizes)
        docs = np.concatenate([np.sort(rng.choice(200, size=s, replace=False)) for s in sizes]).astype(np.int64)
        scores = rng.integers(0, 4, size=len(docs)).astype(np.float32)  # four values: ties at every cut
        count = int(rng.integers(0, 12))
        want = np.zeros(len(docs), dtype=bool)
        for g in range(n_groups):
            rows = np.flatnonzero(group == g)
            want[rows[np.lexsort((docs[rows], -scores[rows]))[:count]]] = True
        got = best_in_groups(torch.from_numpy(group), torch.from_numpy(docs), torch.from_numpy(scores), count,
                             n_groups)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"case {case}")
        checked_ties += int(want.sum() < len(docs) and count > 0)
    assert checked_ties > 20


def test_ranked_pairs_follow_top_k_indices_per_query():
    """trec_eval's order (score desc, id desc), the query's own document excluded, k per query."""
    rng = np.random.default_rng(1)
    doc_ids = [f"d{(37 * i) % 101:03d}" for i in range(101)]
    tie_rank = id_rank(doc_ids)
    for case in range(40):
        n_queries = int(rng.integers(1, 5))
        sizes = rng.integers(0, 30, size=n_queries)
        query = np.repeat(np.arange(n_queries), sizes)
        docs = np.concatenate([np.sort(rng.choice(101, size=s, replace=False)) for s in sizes]).astype(np.int64)
        scores = rng.integers(0, 5, size=len(docs)).astype(np.float32) / 4
        exclude = rng.integers(-1, 101, size=n_queries)
        k = int(rng.integers(1, 20))
        got = ranked_pairs(torch.from_numpy(query), torch.from_numpy(docs), torch.from_numpy(scores),
                           torch.from_numpy(tie_rank), k, n_queries, torch.from_numpy(exclude))
        want = []
        for q in range(n_queries):
            rows = np.flatnonzero(query == q)
            skip = np.flatnonzero(docs[rows] == exclude[q])
            best = top_k_indices(scores[rows], tie_rank[docs[rows]], k, exclude=int(skip[0]) if len(skip) else None)
            want.extend(rows[best].tolist())
        assert got.tolist() == want, case


def test_candidate_pairs_union_and_per_query_round_trip():
    rng = np.random.default_rng(2)
    per_head, expected = [], {}
    for head in range(3):
        pairs = sorted({(int(q), int(d)) for q, d in zip(rng.integers(0, 4, 40), rng.integers(0, 30, 40))})
        per_head.append((torch.tensor([q for q, _ in pairs]), torch.tensor([d for _, d in pairs])))
        for pair in pairs:
            expected.setdefault(pair, [False] * 3)[head] = True
    union = CandidatePairs.union(per_head, n_docs=30)
    got = {(q, d): flags for q, d, flags in zip(union.query.tolist(), union.docs.tolist(), union.heads.tolist())}
    assert list(got) == sorted(expected) and got == expected
    found = union.per_query(5)
    assert len(found) == 5 and len(found[4].docs) == 0
    back = CandidatePairs.from_candidates(found, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip((back.query, back.docs, back.heads),
                                                 (union.query, union.docs, union.heads)))
    assert CandidatePairs.from_candidates([Candidates(np.zeros(0, np.int64), np.zeros((0, 2), bool))],
                                          torch.device("cpu")).heads.shape == (0, 2)


@pytest.mark.parametrize("dim, n_centroids", [(8, 12), (16, 64), (128, 256)])
def test_centroid_scores_of_a_query_do_not_depend_on_its_batch(dim, n_centroids):
    """Bit for bit, whatever the batch size (a single product over B Lq rows would round some rows differently)."""
    centroids = torch.from_numpy(unit(n_centroids, dim, 1))
    for n_queries in (1, 2, 5, 7, 9):
        queries = torch.from_numpy(unit(n_queries * 6, dim, n_queries)).view(n_queries, 6, dim)
        together = query_centroid_scores(queries, centroids)
        for row in range(n_queries):
            assert torch.equal(together[row], query_centroid_scores(queries[row:row + 1], centroids)[0])
            torch.testing.assert_close(together[row], queries[row] @ centroids.T)  # the definition


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("nprobe", [1, 3])
def test_probed_pairs_of_a_query_do_not_depend_on_its_batch(dense, nprobe):
    """Stage 2 for a batch against each query alone: the same documents and bounds bit for bit (a plain torch sum
    over tokens rounds some columns differently with the table's width), and only the tokens in play probe."""
    plan = random_plan(1500, 16, 48, 20, 2)
    tables = plan.tables("cpu")
    queries = torch.from_numpy(unit(9 * 32, 16, 3)).view(9, 32, 16)
    valid = torch.from_numpy(np.random.default_rng(4).random((9, 32)) < 0.6)
    valid[:, 0] = True
    valid[3, 1:] = False  # a query of one token: few pairs, a narrow table when alone
    queries = queries.masked_fill(~valid[..., None], 0.0)
    scores = query_centroid_scores(queries, tables.centroids)
    cells = probe_cells(scores, nprobe)
    query, docs, bound = probed_pairs(tables, scores, cells, valid, dense=dense)
    for row in range(9):
        mine = query == row
        _, alone_docs, alone_bound = probed_pairs(tables, scores[row:row + 1], cells[row:row + 1],
                                                  valid[row:row + 1], dense=dense)
        assert torch.equal(docs[mine], alone_docs) and torch.equal(bound[mine], alone_bound), row
        reached = set()  # the documents of the cells its scored tokens probe, and no other
        for token in np.flatnonzero(valid[row].numpy()):
            for cell in cells[row, token].tolist():
                reached.update(plan.ivf_docs[plan.ivf_offsets[cell]: plan.ivf_offsets[cell + 1]].tolist())
        assert docs[mine].tolist() == sorted(reached), row


@pytest.mark.parametrize("entry_budget, table_bytes", [(1, 1 << 30), (1 << 22, 1 << 30), (1 << 22, 1)],
                         ids=["a group per query", "one group", "a score table per query"])
@pytest.mark.parametrize("dense_ratio", [0, 1 << 30], ids=["sorted", "dense"])
@pytest.mark.parametrize("settings", [(1, 5, 20), (4, 3, 50), (8, 40, 160)])
def test_plaid_pairs_equal_each_query_searched_alone(monkeypatch, entry_budget, table_bytes, dense_ratio, settings):
    """B queries with holes in their token masks: every stage's result for a query is the one of that query alone
    (its scored tokens only), bit for bit, however the batch is split into entry groups or score tables."""
    monkeypatch.setattr(plaid_search, "_ENTRY_BUDGET", entry_budget)
    monkeypatch.setattr(plaid_search, "SCORE_TABLE_BYTES", table_bytes)
    monkeypatch.setattr(plaid_search, "_DENSE_RATIO", dense_ratio)
    nprobe, ndocs, stage2 = settings
    plan = random_plan(300, 8, 12, 9, 4)
    queries = torch.from_numpy(unit(7 * 6, 8, 9)).view(7, 6, 8)
    valid = torch.from_numpy(np.random.default_rng(5).random((7, 6)) < 0.7)
    valid[:, 0] = True
    query, docs, approx, _ = plaid_pairs(plan, queries, valid, nprobe=nprobe, ndocs=ndocs, stage2_docs=stage2)
    for row in range(7):
        mine = query == row
        _, alone_docs, alone_approx, _ = plaid_pairs(plan, queries[row:row + 1], valid[row:row + 1], nprobe=nprobe,
                                                     ndocs=ndocs, stage2_docs=stage2)
        np.testing.assert_array_equal(docs[mine].numpy(), alone_docs.numpy())
        np.testing.assert_array_equal(approx[mine].numpy(), alone_approx.numpy())  # bit for bit
        # and the query's scored tokens alone (a product of another shape: equal to float rounding)
        want_docs, want_approx, _ = plaid_candidates(plan, queries[row][valid[row]], nprobe=nprobe, ndocs=ndocs,
                                                     stage2_docs=stage2)
        np.testing.assert_array_equal(docs[mine].numpy(), want_docs.numpy())
        np.testing.assert_allclose(approx[mine].numpy(), want_approx.numpy(), rtol=1e-6)


# -- on indexes: gathering, pair scores, whole searches ------------------------------------------------------------

def hil_encoder(hf_tokenizer, zscore_eval: str) -> HILEncoder:
    torch.manual_seed(0)
    model = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, zscore_eval=zscore_eval,
                       _loaded=(random_bert(), hf_tokenizer))
    model.set_idf_from_texts(toy_corpus(80)[1], source="toy corpus")
    with torch.no_grad():  # non-trivial running statistics
        model.zscore["L"].update(torch.tensor(0.4), torch.tensor(0.7))
        model.zscore["H"].update(torch.tensor(0.6), torch.tensor(0.2))
    return model.eval()


ENCODERS = {"colbert": lambda tok: make_encoder(tok, seed=3),
            "two-head": lambda tok: make_encoder(tok, TwoHeadEncoder, 1),
            "hil-running": lambda tok: hil_encoder(tok, "running"),
            "hil-per-query": lambda tok: hil_encoder(tok, "per_query")}
BACKENDS = {"flat": "flat", "ivfflat": IvfFlatIndexConfig(nlist=8, seed=0),
            "plaid": PlaidIndexConfig(n_centroids=16, niter=5, seed=0),
            "plaid-compressed": PlaidIndexConfig(n_centroids=16, niter=5, seed=0, residual_bits=2,
                                                 keep_embeddings=False)}


@pytest.fixture(scope="module")
def indexes(hf_tokenizer, tmp_path_factory):
    """(encoder name, back-end name) -> (encoder, index), built once."""
    ids, texts = toy_corpus(80)
    root = tmp_path_factory.mktemp("batched")
    built = {}
    for name, make in ENCODERS.items():
        encoder = make(hf_tokenizer)
        for kind, backend in BACKENDS.items():
            if name.startswith("hil") and kind not in ("flat", "plaid"):
                continue
            built[name, kind] = (encoder, build_index(encoder, ids, texts, root / f"{name}-{kind}", backend=backend,
                                                      progress=False))
    return built


def synthetic_store(seed: int = 7) -> TokenStore:
    """30 documents of 0..6 random unit fp16 tokens, empty ones first, inside and last."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 7, size=30)
    lengths[[0, 11, 29]] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    vectors = {h: unit(int(offsets[-1]), 16, seed + i).astype(np.float16) for i, h in enumerate(("a", "b"))}
    token_ids = rng.integers(1000, 2000, size=int(offsets[-1])).astype(np.int32)
    return TokenStore([f"d{i:02d}" for i in range(30)], offsets, vectors, token_ids)


def assert_same_batch(got, want, repeats: bool) -> None:
    assert torch.equal(got.mask, want.mask) and torch.equal(got.input_ids, want.input_ids)
    assert got.padding_repeats_tokens == want.padding_repeats_tokens
    for head, vectors in want.heads.items():
        if not got.padding_repeats_tokens:  # zeroed padding on both sides
            assert torch.equal(got.heads[head], vectors), head
            continue
        assert torch.equal(got.heads[head][got.mask], vectors[want.mask]), head
        for row, n in enumerate(got.mask.sum(dim=1).tolist()):  # padding repeats one of the document's own tokens
            real = got.heads[head][row, :n]
            assert all((real == pad).all(dim=1).any() for pad in got.heads[head][row, n:])


@pytest.mark.parametrize("docs", [[3, 0, 29, 13, 3, 11], [4, 1, 2, 28], [0], [29, 0]],
                         ids=["empty ones, repeats, unsorted", "none empty", "one empty", "only empty"])
def test_documents_gathered_on_the_device_equal_gather_documents(docs):
    store = synthetic_store()
    tokens = device_tokens(store, "cpu")
    docs = np.array(docs)
    for repeat in (False, True):
        for ids in (False, True):
            got = tokens.gather(torch.from_numpy(docs), ("a", "b"), repeat_padding=repeat, token_ids=ids)
            want = gather_documents(store, docs, heads=("a", "b"), repeat_padding=repeat, token_ids=ids)
            assert_same_batch(got, want, repeat)
            lengths = store.doc_lengths[docs]
            known = tokens.gather(torch.from_numpy(docs), ("a", "b"), repeat_padding=repeat, token_ids=ids,
                                  lengths=(int(lengths.min()), int(lengths.max())))
            assert_same_batch(known, want, repeat)
    assert device_tokens(store, torch.device("cpu")) is tokens  # one per store and device


def test_compressed_documents_gathered_on_the_device_equal_gather_documents(indexes):
    _, index = indexes["two-head", "plaid-compressed"]
    docs = np.array([5, 0, 79, 13, 5, 40])
    for repeat in (False, True):
        got = device_tokens(index, "cpu").gather(torch.from_numpy(docs), ("a", "b"), repeat_padding=repeat)
        assert_same_batch(got, gather_documents(index, docs, heads=("a", "b"), repeat_padding=repeat), repeat)


@pytest.mark.parametrize("name", list(ENCODERS))
def test_pair_scores_equal_score_documents_query_by_query(indexes, name):
    encoder, index = indexes[name, "flat"]
    rng = np.random.default_rng(6)
    with eval_mode(encoder):
        queries = encoder.encode_queries(list(QUERIES.values()))
        sizes = rng.integers(0, 30, size=len(QUERIES))
        query = np.repeat(np.arange(len(QUERIES)), sizes)
        docs = np.concatenate([np.sort(rng.choice(80, size=s, replace=False)) for s in sizes]).astype(np.int64)
        got = pair_scores(encoder, queries, index, torch.from_numpy(query), torch.from_numpy(docs),
                          block_tokens=97).numpy()
        for row in range(len(QUERIES)):
            mine = query == row
            if mine.any():
                want = score_documents(encoder, queries.select(slice(row, row + 1)), index, docs[mine])[0]
                np.testing.assert_array_equal(got[mine], want, err_msg=f"query {row}")


def own_text_queries() -> dict[str, str]:
    """QUERIES, with d007's text its own document's: skip_self has a document to skip at rank 1."""
    ids, texts = toy_corpus(80)
    return {**QUERIES, "d007": texts[ids.index("d007")]}


def search_both_ways(encoder, index, kind, **options):
    search = PlaidSearchConfig(nprobe=2, ndocs=12, stage2_docs=30) if kind.startswith("plaid") else None
    common = dict(k=8, search=search, progress=False, batch_size=5, **options)
    queries = own_text_queries()
    return (full_rank(encoder, index, queries, batched=True, **common),
            full_rank(encoder, index, queries, batched=False, **common))


@pytest.mark.parametrize("key", ["colbert-flat", "colbert-ivfflat", "colbert-plaid", "colbert-plaid-compressed",
                                 "two-head-flat", "two-head-plaid", "two-head-ivfflat", "hil-running-flat",
                                 "hil-running-plaid", "hil-per-query-plaid"])
def test_batched_search_ranks_as_one_query_at_a_time(indexes, key):
    name, kind = next((n, key[len(n) + 1:]) for n in ENCODERS if key.startswith(n + "-"))
    encoder, index = indexes[name, kind]
    batched, alone = search_both_ways(encoder, index, kind, skip_self=True, keep_candidate_sources=True)
    assert batched.stats["batched"] and not alone.stats["batched"]
    kept = search_both_ways(encoder, index, kind)[0].run["d007"]
    assert next(iter(kept)) == "d007"  # searched for its own text, a document ranks itself first ...
    for qid in QUERIES:
        assert list(batched.run[qid].items()) == list(alone.run[qid].items()), qid  # order and scores, bit for bit
        assert qid not in batched.run[qid]  # its own document skipped
    assert batched.sources == alone.sources
    for stat in ("candidates_mean", "candidates_min", "candidates_max", "candidate_sources", "search"):
        assert batched.stats[stat] == alone.stats[stat], stat
    assert batched.stats["candidates_mean"] > 8  # more candidates than k: the cut is exercised
    # keep_candidate_sources: every candidate is named, not only the ranked ones
    assert sum(map(len, batched.sources.values())) == round(batched.stats["candidates_mean"] * len(QUERIES))


def test_batched_search_refuses_the_queries_with_a_nan_score(indexes, monkeypatch):
    """A non-finite score is never ranked: every such query of the batch is named, as one at a time does."""
    encoder, index = indexes["colbert", "flat"]
    import hil.retrieval.full_ranking as full_ranking

    real = full_ranking.pair_scores

    def poisoned(encoder, queries, store, pair_query, pair_doc, **kwargs):
        values = real(encoder, queries, store, pair_query, pair_doc, **kwargs)
        return torch.where(pair_query == 1, torch.full_like(values, float("nan")), values)

    monkeypatch.setattr(full_ranking, "pair_scores", poisoned)
    from hil.retrieval.integrity import NonFiniteError

    with pytest.raises(NonFiniteError, match="q2"):
        full_rank(encoder, index, QUERIES, k=5, progress=False, batch_size=8)


# -- flat search in torch (an accelerator without faiss-gpu) --------------------------------------------------------

@pytest.mark.parametrize("block_rows", [1, 37, 1 << 18])
@pytest.mark.parametrize("k", [1, 9, 500])
def test_torch_flat_search_finds_faiss_flat_neighbours(block_rows, k):
    """Against FAISS's IndexFlatIP on the same fp32 vectors: the same rows where similarities differ, the same
    similarities everywhere (to float rounding), FAISS's padding past the table."""
    import faiss

    from hil.retrieval.torch_flat import TorchFlatSearch

    table = unit(300, 16, 11).astype(np.float16)
    queries = unit(25, 16, 12)
    reference = faiss.IndexFlatIP(16)
    reference.add(table.astype(np.float32))
    want_sims, want_rows = reference.search(queries, k)
    got_sims, got_rows = TorchFlatSearch(torch.from_numpy(table), block_rows=block_rows).search(queries, k)
    assert got_rows.shape == want_rows.shape == (25, k)
    np.testing.assert_allclose(got_sims, want_sims, rtol=1e-5, atol=1e-6)
    distinct = np.abs(np.diff(want_sims, axis=1, append=-np.inf)) > 1e-5  # not tied with the next one
    np.testing.assert_array_equal(got_rows[distinct & (want_rows >= 0)], want_rows[distinct & (want_rows >= 0)])
    assert ((got_rows == -1) == (want_rows == -1)).all()


def test_torch_flat_search_refuses_a_damaged_table():
    from hil.retrieval.integrity import NonFiniteError
    from hil.retrieval.torch_flat import TorchFlatSearch

    table = torch.from_numpy(unit(50, 8, 3))
    table[17, 2] = float("nan")
    with pytest.raises(NonFiniteError, match="rebuild"):
        TorchFlatSearch(table, where="idx")


# -- on a GPU: batched search there gives the CPU's rankings ---------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("key", [("colbert", "flat"), ("colbert", "plaid"), ("two-head", "plaid-compressed"),
                                 ("hil-running", "plaid")])
def test_gpu_batched_search_ranks_as_the_cpu(indexes, key):
    """Candidates, gathering, exact scores and the top k on the GPU (flat: torch's search without faiss-gpu; the
    token tables uploaded): the CPU's documents in the CPU's order, scores to float rounding."""
    import copy

    encoder, index = indexes[key]
    on_cpu = search_both_ways(encoder, index, key[1])[0]
    gpu_encoder = copy.deepcopy(encoder).to("cuda")
    for batched in (True, False):
        search = PlaidSearchConfig(nprobe=2, ndocs=12, stage2_docs=30) if key[1].startswith("plaid") else None
        on_gpu = full_rank(gpu_encoder, index, QUERIES, k=8, search=search, progress=False, batch_size=5,
                           batched=batched)
        for qid in QUERIES:
            assert list(on_gpu.run[qid]) == list(on_cpu.run[qid]), (qid, batched)
            np.testing.assert_allclose(list(on_gpu.run[qid].values()), list(on_cpu.run[qid].values()), rtol=1e-4)
    cuda = torch.device("cuda", torch.cuda.current_device())
    assert cuda in index.__dict__["_device_tokens"], "documents gathered on the GPU"
