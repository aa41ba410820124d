"""Search back-ends (hil.retrieval.backends) against brute force: with settings wide enough to see everything, every
registered back-end proposes every document, and full ranking equals a MaxSim loop over the stored vectors.

A two-head random-BERT encoder (relevance = the sum of both heads' Eq. 1) over a toy corpus of 50 short texts;
the reference is written as loops, documents sorted by ``(-score, doc_id)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hil.errors import UserError
from hil.retrieval.backends.configs import (
    REGISTRY,
    IvfFlatIndexConfig,
    IvfSearchConfig,
    PlaidIndexConfig,
    PlaidSearchConfig,
    configs_from_params,
    with_search_values,
)
from hil.retrieval.backends.registry import backend_class, backend_classes, open_backend
from hil.retrieval.builder import build_index, rebuild_search_structures
from hil.retrieval.encoding import eval_mode
from hil.retrieval.full_ranking import full_rank

from toys import QUERIES, TwoHeadEncoder, make_encoder, toy_corpus  # noqa: E402

# Per kind: build parameters, and search settings that look at every token, list, centroid and document.
EVERYTHING = {
    "flat": ({}, {}),
    "ivfflat": ({"nlist": 4}, {"nprobe": 4}),
    "ivfpq": ({"nlist": 4, "m": 4, "nbits": 4}, {"nprobe": 4}),
    "plaid": ({"n_centroids": 8, "niter": 3}, {"nprobe": 8, "ndocs": 50, "stage2_docs": 50}),
    "muvera": ({"k_sim": 3, "d_proj": 8, "r_reps": 2}, {"n_candidates": 50}),
}


@pytest.fixture(scope="module")
def encoder(hf_tokenizer):
    return make_encoder(hf_tokenizer, TwoHeadEncoder, seed=1)


@pytest.fixture(scope="module")
def indexes(encoder, tmp_path_factory):
    ids, texts = toy_corpus()
    root = tmp_path_factory.mktemp("backends")
    return {kind: build_index(encoder, ids, texts, root / kind, backend=REGISTRY[kind].index_config(**params),
                              progress=False) for kind, (params, _) in EVERYTHING.items()}


def wide_settings(kind: str, index):
    wide = {"ncandidates": index.n_tokens} if kind not in ("plaid", "muvera") else {}
    return REGISTRY[kind].search_config(**wide, **EVERYTHING[kind][1])


def loop_ranking(encoder, index, text: str, k: int) -> list[tuple[str, float]]:
    """Sum over heads of sum_i max_j q_i . d_j, written as loops over the stored (fp16) vectors."""
    with eval_mode(encoder):
        query = encoder.encode_queries([text])
    scores = {}
    for doc in range(index.n_docs):
        lo, hi = int(index.doc_offsets[doc]), int(index.doc_offsets[doc + 1])
        total = 0.0
        for head in encoder.head_names:
            vectors = query.heads[head][0][query.mask[0]].double().numpy()
            stored = np.asarray(index.embeddings[head][lo:hi], dtype=np.float64)
            for q in vectors:
                total += max((float(np.dot(q, d)) for d in stored), default=0.0)
        scores[index.doc_ids[doc]] = total
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]


def test_every_registered_backend_is_covered():
    assert set(EVERYTHING) == set(REGISTRY)
    assert [cls.kind for cls in backend_classes()] == list(REGISTRY), "every registered kind has its class"


@pytest.mark.parametrize("kind", list(EVERYTHING))
def test_wide_candidates_are_every_document_from_every_head(encoder, indexes, kind):
    index = indexes[kind]
    assert index.backend_settings["kind"] == kind and (index.doc_lengths > 0).all()
    backend = open_backend(index, wide_settings(kind, index))
    assert type(backend) is REGISTRY[kind].backend
    with eval_mode(encoder):
        queries = encoder.encode_queries(list(QUERIES.values()))
    found = backend.candidates(queries, encoder.head_names)
    assert len(found) == len(QUERIES)
    for candidates in found:
        assert candidates.docs.tolist() == list(range(index.n_docs))
        assert candidates.heads.shape == (index.n_docs, 2) and candidates.heads.all()


@pytest.mark.parametrize("kind", list(EVERYTHING))
def test_wide_full_rank_equals_the_brute_force_loop(encoder, indexes, kind):
    index = indexes[kind]
    result = full_rank(encoder, index, QUERIES, k=10, search=wide_settings(kind, index), batch_size=4,
                       progress=False)
    assert result.stats["search"]["backend"] == kind and result.stats["candidates_mean"] == index.n_docs
    for qid, text in QUERIES.items():
        expected = loop_ranking(encoder, index, text, 10)  # (-score, id) ascending: no ties in these scores
        assert list(result.run[qid]) == [doc for doc, _ in expected], (kind, qid)
        np.testing.assert_allclose(list(result.run[qid].values()), [score for _, score in expected], atol=1e-4)


def test_plaid_search_settings_are_the_search_config_and_never_the_index(indexes):
    """Search-time settings are not part of an index: the defaults are PlaidSearchConfig's, whatever the build."""
    backend = open_backend(indexes["plaid"])
    assert backend.search == PlaidSearchConfig()
    assert "nprobe" not in indexes["plaid"].backend_settings["params"]
    overridden = open_backend(indexes["plaid"], PlaidSearchConfig(nprobe=3, ndocs=5, stage2_docs=7))
    assert overridden.search_stats() == {"backend": "plaid", "nprobe": 3, "ndocs": 5, "stage2_docs": 7}


def test_each_kind_is_one_registry_entry_with_its_settings_beside_its_searcher():
    """One entry per kind holds the back-end class and its settings classes; a built-in's settings are defined in
    the module beside its searcher's (``centroid`` -> ``centroid_configs``), exported by the registry's module and
    recorded under it: the name YAML recipes use, and the identity of results written before they moved."""
    from hil.retrieval.backends import configs

    for kind in EVERYTHING:
        entry = REGISTRY[kind]
        assert (entry.backend.kind, entry.backend.index_config, entry.backend.search_config) == (
            kind, entry.index_config, entry.search_config)
        for settings in (entry.index_config, entry.search_config):
            assert settings.__module__ == f"{entry.backend.__module__}_configs", settings
            assert getattr(configs, settings.__name__) is settings
            assert settings().record()["class_path"] == f"hil.retrieval.backends.configs.{settings.__name__}"

    @dataclass(frozen=True)
    class Narrower(PlaidSearchConfig):  # settings defined elsewhere, on a built-in's: recorded where they are
        pass

    assert Narrower().record()["class_path"] == f"{__name__}.Narrower"


def test_a_kind_is_registered_once():
    """A second back-end class for a kind, or a kind registered again with other settings, is refused when the
    class is defined; the registry keeps the first."""
    from hil.retrieval.backends.base import SearchBackend
    from hil.retrieval.backends.centroid import PlaidBackend

    with pytest.raises(ValueError, match="'plaid' is already registered with PlaidIndexConfig / PlaidSearchConfig"):
        class OtherSettings(SearchBackend):
            kind, index_config, search_config = "plaid", PlaidIndexConfig, IvfSearchConfig
    with pytest.raises(ValueError, match="'plaid' is already PlaidBackend"):
        class SecondPlaid(SearchBackend):
            kind, index_config, search_config = "plaid", PlaidIndexConfig, PlaidSearchConfig
    with pytest.raises(ValueError, match="PlaidIndexConfig.kind must be 'plaid2'"):
        class Misnamed(SearchBackend):
            kind, index_config, search_config = "plaid2", PlaidIndexConfig, PlaidSearchConfig
    assert REGISTRY["plaid"].backend is PlaidBackend and "plaid2" not in REGISTRY


def test_the_views_of_the_two_registries_before_0_3_warn_and_read_the_one():
    from hil.retrieval.backends import configs, registry

    with pytest.warns(DeprecationWarning, match="REGISTRY"):
        assert configs.INDEX_CONFIGS == {kind: entry.index_config for kind, entry in REGISTRY.items()}
    with pytest.warns(DeprecationWarning, match="REGISTRY"):
        assert configs.SEARCH_CONFIGS == {kind: entry.search_config for kind, entry in REGISTRY.items()}
    with pytest.warns(DeprecationWarning, match="backend_kinds"):
        assert configs.BACKEND_KINDS == registry.BACKEND_KINDS == tuple(REGISTRY) == tuple(configs.BACKEND_CHOICES)
    with pytest.warns(DeprecationWarning, match="backend_class"):
        assert registry.BACKENDS == {kind: entry.backend for kind, entry in REGISTRY.items()}


def test_unknown_kind_is_refused_with_the_known_ones():
    with pytest.raises(UserError, match=r"backend must be one of \('flat', 'ivfflat', 'ivfpq', 'plaid', 'muvera'\), "
                                        r"got 'hnsw'"):
        backend_class("hnsw")


@pytest.mark.parametrize("kind", list(EVERYTHING))
def test_each_backend_owns_its_settings(kind):
    backend = backend_class(kind)
    assert backend.kind == kind and backend.index_config is REGISTRY[kind].index_config
    resolved = backend.resolve_params(backend.index_config(**EVERYTHING[kind][0]), n_tokens=2000, dim=16)
    assert set(resolved) <= backend.index_config.field_names()
    assert backend.resolve_params(backend.index_config(**resolved), n_tokens=2000, dim=16) == resolved, \
        "resolving is idempotent"
    with pytest.raises(UserError, match="do not apply"):
        configs_from_params(kind, {"no_such_setting": 1})
    other = next(entry.index_config for name, entry in REGISTRY.items() if name != kind)
    with pytest.raises(UserError, match="does not configure"):
        backend.resolve_params(other(), n_tokens=2000, dim=16)


def test_untyped_params_split_into_build_and_search_settings():
    build, search = configs_from_params("plaid", {"n_centroids": 16, "nprobe": 4, "stage2_docs": 9})
    assert build == PlaidIndexConfig(n_centroids=16) and search == PlaidSearchConfig(nprobe=4, stage2_docs=9)
    build, search = configs_from_params("ivfpq", {"nlist": 8, "m": 4, "nprobe": 2, "ncandidates": 5})
    assert build.given() == {"nlist": 8, "m": 4, "seed": 0, "nbits": 8}
    assert search.values() == {"ncandidates": 5, "max_candidates": None, "nprobe": 2}
    with pytest.raises(UserError, match=r"\['nprobe'\] do not apply to a 'flat' index"):
        with_search_values("flat", None, {"nprobe": 3})
    with pytest.raises(UserError, match="must be an integer >= 1"):
        PlaidSearchConfig(stage2_docs=0)


def test_search_time_params_at_build_time_are_refused(encoder, tmp_path):
    """An index no longer holds nprobe: accepting it at build time would silently search with another value."""
    ids, texts = toy_corpus()
    with pytest.raises(UserError, match=r"\['nprobe'\] are search-time settings"):
        build_index(encoder, ids, texts, tmp_path / "idx", faiss_kind="ivfflat", faiss_params={"nlist": 4,
                                                                                              "nprobe": 2},
                    progress=False)
    assert not (tmp_path / "idx").exists()


def test_switching_kinds_leaves_only_the_new_kinds_files(encoder, tmp_path):
    ids, texts = toy_corpus()
    index = build_index(encoder, ids, texts, tmp_path / "idx", backend=PlaidIndexConfig(**EVERYTHING["plaid"][0]),
                        progress=False)
    base = {"index.json", "doc_ids.json", "doc_offsets.npy", "token_ids.npy", "a.embeddings.npy",
            "b.embeddings.npy"}
    plaid = {f"{h}.{name}.npy" for h in "ab" for name in ("centroids", "codes", "ivf_offsets", "ivf_docs")}
    files = lambda: {path.name for path in index.directory.iterdir()}  # noqa: E731
    assert files() == base | plaid, "no temporary file is left behind"
    index = rebuild_search_structures(index, IvfFlatIndexConfig(**EVERYTHING["ivfflat"][0]), progress=False)
    assert files() == base | {"a.faiss", "b.faiss"}
    index = rebuild_search_structures(index, "flat", progress=False)
    assert files() == base


def test_a_plaid_build_says_so_before_its_k_means_and_after_each_head(encoder, tmp_path, capfd, monkeypatch):
    # Off a terminal (the test's stderr) the line comes when the stage starts, not only when it ends: k-means and
    # the codes ran silent for ~20 s on SciFact (issue 40). The first line is written before any head's k-means.
    import hil.retrieval.backends.centroid as centroid

    seen_before_kmeans = []
    real = centroid.train_plaid_centroids

    def watched(*args, **kwargs):
        seen_before_kmeans.append(capfd.readouterr().err)
        return real(*args, **kwargs)

    monkeypatch.setattr(centroid, "train_plaid_centroids", watched)
    ids, texts = toy_corpus()
    build_index(encoder, ids, texts, tmp_path / "idx", backend=PlaidIndexConfig(**EVERYTHING["plaid"][0]),
                progress=True)
    assert "plaid structures" in seen_before_kmeans[0] and "0/2" in seen_before_kmeans[0]
    assert "2/2" in capfd.readouterr().err
