"""The tiled vector source of the scale bench (hil.retrieval.vector_source.TiledVectors) and a build from it.

References written here: a copy's tokens compared with the base's as multisets (a shuffle draws every base token
once), (vector, id) pairs looked up in the base, a rotation checked by its orthogonality and by the products it
keeps, reads in any grouping of rows against reads one row at a time.
"""

from __future__ import annotations

import numpy as np
import pytest

from hil.retrieval.backends.centroid import two_level_nprobe
from hil.retrieval.backends.configs import PlaidIndexConfig
from hil.retrieval.builder import build_index
from hil.retrieval.store import TokenStore
from hil.retrieval.vector_source import TiledVectors, random_rotation

from toys import make_encoder

DIM = 16


def toy_base(n_docs: int = 30, seed: int = 0) -> TokenStore:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, size=n_docs)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    vectors = rng.standard_normal((int(offsets[-1]), DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = rng.integers(1000, 2000, size=int(offsets[-1])).astype(np.int32)
    return TokenStore([f"d{i}" for i in range(n_docs)], offsets, {"colbert": vectors.astype(np.float16)}, ids)


def rows_of(tiled: TiledVectors, rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    read = tiled.vectors(np.asarray(rows, dtype=np.int64))
    return read.embeddings["colbert"], read.token_ids, read.lengths


@pytest.mark.parametrize("tiling", ["shuffle", "rotation"])
def test_copy_zero_is_the_base_and_ids_keep_their_judgments(tiling):
    base = toy_base()
    tiled = TiledVectors(base, 4, seed=3, tiling=tiling)
    vectors, ids, lengths = rows_of(tiled, np.arange(base.n_docs))
    np.testing.assert_array_equal(vectors, base.embeddings["colbert"])
    np.testing.assert_array_equal(ids, base.token_ids)
    np.testing.assert_array_equal(lengths, base.doc_lengths)
    assert tiled.n_docs == 4 * base.n_docs
    assert tiled.doc_ids()[: base.n_docs] == base.doc_ids and tiled.doc_ids()[base.n_docs + 2] == "d2#1"
    assert len(set(tiled.doc_ids())) == tiled.n_docs


def test_a_shuffled_copy_is_every_base_token_once_in_bags_of_the_base_lengths():
    base = toy_base()
    tiled = TiledVectors(base, 3, seed=5)
    pairs = {(tuple(v.tolist()), int(i)) for v, i in zip(base.embeddings["colbert"], base.token_ids)}
    for copy in (1, 2):
        vectors, ids, lengths = rows_of(tiled, np.arange(base.n_docs) + copy * base.n_docs)
        np.testing.assert_array_equal(lengths, base.doc_lengths)
        # the same multiset of rows as the base (a permutation), in another order
        assert sorted(map(tuple, vectors.tolist())) == sorted(map(tuple, base.embeddings["colbert"].tolist()))
        assert not np.array_equal(vectors, base.embeddings["colbert"])
        assert all((tuple(v.tolist()), int(i)) in pairs for v, i in zip(vectors, ids)), "ids travel with vectors"
    first, _, _ = rows_of(tiled, np.arange(base.n_docs) + base.n_docs)
    second, _, _ = rows_of(tiled, np.arange(base.n_docs) + 2 * base.n_docs)
    assert not np.array_equal(first, second), "each copy its own permutation"
    again, _, _ = rows_of(TiledVectors(base, 3, seed=5), np.arange(base.n_docs) + base.n_docs)
    other, _, _ = rows_of(TiledVectors(base, 3, seed=6), np.arange(base.n_docs) + base.n_docs)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_a_rotated_copy_is_the_base_turned_by_an_orthogonal_matrix():
    rotation = random_rotation(DIM, 7)
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(DIM), atol=1e-12)
    base = toy_base()
    tiled = TiledVectors(base, 2, seed=6, tiling="rotation")
    turned, ids, _ = rows_of(tiled, np.arange(base.n_docs) + base.n_docs)
    expected = base.embeddings["colbert"].astype(np.float32) @ random_rotation(DIM, 7).astype(np.float32)
    np.testing.assert_allclose(turned.astype(np.float32), expected, atol=2e-3)  # fp16 rounding
    np.testing.assert_array_equal(ids, base.token_ids)
    original = base.embeddings["colbert"].astype(np.float32)
    np.testing.assert_allclose(turned.astype(np.float32) @ turned.astype(np.float32).T, original @ original.T,
                               atol=5e-3)  # a copy keeps its own geometry


@pytest.mark.parametrize("tiling", ["shuffle", "rotation"])
def test_rows_read_in_any_grouping_are_the_rows_read_one_by_one(tiling):
    base = toy_base()
    tiled = TiledVectors(base, 5, seed=1, tiling=tiling)
    rows = np.array([2, 31, 33, 64, 90, 149])  # several copies in one read, as a chunk of the build holds
    vectors, ids, lengths = rows_of(tiled, rows)
    one = [rows_of(tiled, [row]) for row in rows]
    np.testing.assert_array_equal(vectors, np.concatenate([v for v, _, _ in one]))
    np.testing.assert_array_equal(ids, np.concatenate([i for _, i, _ in one]))
    np.testing.assert_array_equal(lengths, np.concatenate([n for _, _, n in one]))


def test_bad_tilings_are_refused():
    with pytest.raises(ValueError, match="tiling must be one of"):
        TiledVectors(toy_base(), 2, tiling="mirror")
    with pytest.raises(ValueError, match="factor must be >= 1"):
        TiledVectors(toy_base(), 0)


def test_an_index_built_from_a_tiling_holds_its_vectors_and_records_it(hf_tokenizer, tmp_path):
    encoder = make_encoder(hf_tokenizer)
    base = toy_base(40)
    tiled = TiledVectors(base, 3, seed=2)
    index = build_index(encoder, tiled.doc_ids(), None, tmp_path / "idx", vectors=tiled, chunk_docs=16,
                        progress=False)
    np.testing.assert_array_equal(np.asarray(index.embeddings["colbert"]),
                                  tiled.vectors(np.arange(tiled.n_docs)).embeddings["colbert"])
    assert index.meta["vector_source"]["tiling"] == "shuffle" and index.meta["vector_source"]["factor"] == 3
    assert index.corpus_fingerprint == tiled.fingerprint() != TiledVectors(base, 3, seed=2,
                                                                           tiling="rotation").fingerprint()
    compressed = build_index(encoder, tiled.doc_ids(), None, tmp_path / "compressed", vectors=tiled, chunk_docs=16,
                             backend=PlaidIndexConfig(n_centroids=8, residual_bits=2, keep_embeddings=False),
                             progress=False)
    assert compressed.compressed_only and compressed.n_tokens == 3 * base.n_tokens


def test_two_level_groups_probed_grow_with_the_centroids():
    # max(8, ceil(0.045 * round(sqrt(C)))), by hand: 91 -> 4.1, 181 -> 8.1, 256 -> 11.5, 362 -> 16.3, 512 -> 23.0
    assert [two_level_nprobe(c) for c in (2 ** 13, 2 ** 15, 2 ** 16, 2 ** 17, 2 ** 18)] == [8, 9, 12, 17, 24]
