"""The ``plaid`` back-end: PLAID / ColBERTv2 centroid pruning instead of a token ANN search (no FAISS at query time).

The math (k-means centroids, inverted file, probed-cells bound, centroid interaction) is in
:mod:`hil.retrieval.plaid`; the optional ColBERTv2 residual compression in :mod:`hil.retrieval.codec`. This
module owns the settings, the files (``<head>.centroids/codes/ivf_offsets/ivf_docs[/residuals].npy``) and the
per-query candidate search: each head keeps its ``ndocs`` best documents by centroid interaction, and the union
over heads goes to exact scoring. The search runs on the back-end's ``device`` (by default the query vectors', i.e.
the encoder's): a GPU encoder's queries are searched on its GPU, the plan's arrays uploaded there once per opened
index.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.errors import UserError
from hil.modeling.contracts import EncodedBatch
from hil.provenance import atomic_output
from hil.retrieval.backends.base import CandidatePairs, Candidates, SearchBackend
from hil.retrieval.backends.centroid_configs import PlaidIndexConfig, PlaidSearchConfig
from hil.retrieval.backends.config_base import IndexConfig
from hil.retrieval.codec import NBITS, CompressedEmbeddings, ResidualCodec, fit_residual_codec
from hil.retrieval.index import DOC_OFFSETS_NPY, embeddings_path, plaid_paths, save_npy_atomic
from hil.retrieval.integrity import check_finite_vectors, load_npy, rebuild_hint
from hil.retrieval.kmeans import kmeans_engine
from hil.retrieval.plaid import (
    CentroidPlan,
    assign_codes,
    code_dtype,
    default_n_centroids,
    sample_rows,
    train_plaid_centroids,
    write_ivf,
)
from hil.retrieval.plaid_search import plaid_pairs
from hil.retrieval.store import TokenTable

# Tokens the residual buckets are fitted on (a seeded sample).
CODEC_SAMPLE = 1 << 16
# assignment "auto": two-level on a CPU build from this many centroids (SciFact x16's 2^15: exact assignment of its
# 13M tokens took ~12 minutes here, of MS MARCO's 633M to 2^18 it would take days; bench/README.md).
TWO_LEVEL_MIN_CENTROIDS = 1 << 15
# Groups probed per token by a two-level assignment unless assignment_nprobe says otherwise: at least
# TWO_LEVEL_NPROBE, and TWO_LEVEL_PROBED_SHARE of the round(sqrt(C)) groups, so that the share of centroids a token
# is compared with stays put as C grows (measured on SciFact tiled, bench/README.md: with 8 groups agreement with
# exact assignment fell from 91% at 2^15 centroids to 71% at 2^17; 16 groups there: 82%, 32: 90%, each costing
# ~0.6 us a token more on 2 cores).
TWO_LEVEL_NPROBE = 8
TWO_LEVEL_PROBED_SHARE = 0.045


def two_level_nprobe(n_centroids: int) -> int:
    """The default groups probed per token for ``n_centroids`` (see :data:`TWO_LEVEL_PROBED_SHARE`)."""
    return max(TWO_LEVEL_NPROBE, math.ceil(TWO_LEVEL_PROBED_SHARE * max(1, round(n_centroids ** 0.5))))


def _check_plaid_params(resolved: dict[str, Any], n_tokens: int, dim: int) -> None:
    n_centroids, bits = resolved["n_centroids"], resolved["residual_bits"]
    keep = resolved["keep_embeddings"]
    if bits == "auto":  # decided by the corpus before a build (PlaidIndexConfig.sized: never keep False without
        bits, keep = 0, True  # residuals), and checked then
    if not 1 <= n_centroids <= max(1, n_tokens):
        raise UserError(f"plaid: n_centroids={n_centroids} must lie in 1..n_tokens={n_tokens}")
    if resolved["train_size"] < n_centroids:
        raise UserError(f"plaid: n_centroids={n_centroids} needs at least as many training tokens "
                         f"(train_size={resolved['train_size']})")
    if resolved["niter"] < 1:
        raise UserError(f"plaid: niter must be >= 1, got {resolved['niter']}")
    if bits and (bits not in NBITS or dim * bits % 8):
        raise UserError(f"plaid: residual_bits must be 0 or one of {NBITS} (with D * bits a multiple of 8), "
                         f"got {bits}")
    if not keep and not bits:
        raise UserError("plaid: keep_embeddings=False needs residual_bits (the vectors must be stored somehow)")


class PlaidBackend(SearchBackend):
    """Centroid pruning (see the module docstring), steered by a :class:`PlaidSearchConfig` at every search."""

    kind = "plaid"
    index_config = PlaidIndexConfig
    search_config = PlaidSearchConfig

    @classmethod
    def keyword_search_values(cls, *, ncandidates: int | None, max_candidates: int | None, nprobe: int | None,
                              stage2_docs: int | None) -> dict[str, int | None]:
        """``max_candidates`` is PLAID's ``ndocs`` (each head's documents kept by centroid interaction)."""
        return {"ndocs": max_candidates, "nprobe": nprobe, "stage2_docs": stage2_docs, "ncandidates": ncandidates}

    def candidates_per_head(self) -> tuple[str, int] | None:
        return ("ndocs", self.search.ndocs) if self.search.ndocs is not None else None

    # -- building -----------------------------------------------------------------------------------------------
    @classmethod
    def resolve_params(cls, config: IndexConfig, n_tokens: int, dim: int) -> dict[str, Any]:
        """Stored structure (:class:`PlaidIndexConfig`): ``n_centroids`` (default ColBERTv2's
        ``2**floor(log2(16 sqrt(n_tokens)))``), k-means on ``train_size`` sampled tokens (default
        ``min(n_tokens, 32 n_centroids)``) for ``niter`` iterations, ``seed``, ``residual_bits``,
        ``keep_embeddings`` (``auto`` where left to the corpus: a build decides them first,
        :meth:`~hil.retrieval.backends.configs.PlaidIndexConfig.sized`), and ``kmeans`` as asked (``auto`` is
        resolved by :meth:`resolve_machine_params`)."""
        params = cls.check_config(config).given()
        n_centroids = int(params.get("n_centroids") or default_n_centroids(n_tokens))
        resolved: dict[str, Any] = {
            "n_centroids": n_centroids,
            "train_size": min(n_tokens, int(params.get("train_size") or 32 * n_centroids)),
            "niter": int(params["niter"]), "seed": int(params["seed"]),
            "residual_bits": int(params["residual_bits"]) if "residual_bits" in params else "auto",
            "keep_embeddings": bool(params["keep_embeddings"]) if "keep_embeddings" in params else "auto",
            "kmeans": params["kmeans"],
            "assignment": params["assignment"], "assignment_nprobe": params.get("assignment_nprobe", "auto")}
        _check_plaid_params(resolved, n_tokens, dim)
        return resolved

    @classmethod
    def resolve_machine_params(cls, params: dict[str, Any], *, device: torch.device, use_gpu: bool = False,
                               gpu_device: int = 0) -> dict[str, Any]:
        """``kmeans`` and ``assignment`` resolved for a build on ``device`` (:func:`~hil.retrieval.kmeans.
        kmeans_engine`), what ``index.json`` records: ``assignment: auto`` is ``two-level`` for a build without a
        GPU and at least :data:`TWO_LEVEL_MIN_CENTROIDS` centroids, else ``exact``; ``two-level`` runs our torch
        k-means (``kmeans: torch``, with ``auto`` asked; an explicit ``faiss`` is refused with it) and takes
        :func:`two_level_nprobe` groups per token unless ``assignment_nprobe`` says otherwise."""
        engine = kmeans_engine(params["kmeans"], device, use_gpu=use_gpu, gpu_device=gpu_device)
        on_gpu = engine.faiss_gpu is not None or engine.device.type != "cpu"
        assignment = params.get("assignment", "exact")
        if assignment == "auto":
            assignment = "two-level" if not on_gpu and params["n_centroids"] >= TWO_LEVEL_MIN_CENTROIDS else "exact"
        if assignment == "two-level":
            if params["kmeans"] == "faiss":
                raise UserError("plaid: assignment='two-level' trains its centroids with torch k-means; "
                                "kmeans='faiss' cannot be honoured with it (use kmeans='auto' or 'torch')")
            engine = kmeans_engine("torch", device, use_gpu=use_gpu, gpu_device=gpu_device)
        nprobe = params.get("assignment_nprobe", "auto")
        nprobe = (two_level_nprobe(params["n_centroids"]) if nprobe == "auto" else int(nprobe)) \
            if assignment == "two-level" else None
        return dict(params, kmeans=engine.name, assignment=assignment, assignment_nprobe=nprobe)

    @classmethod
    def factory(cls, params: dict[str, Any]) -> str:
        return f"PLAID{params['n_centroids']}" + (f",R{params['residual_bits']}" if params["residual_bits"] else "")

    @classmethod
    def head_files(cls, directory: Path, head: str) -> list[Path]:
        return list(plaid_paths(directory, head).values())

    @classmethod
    def structure_bytes(cls, params: dict[str, Any], n_tokens: int, n_docs: int, dim: int) -> int:
        """Codes, the inverted file (at most one entry per token, int32), centroids, and packed residuals."""
        codes = code_dtype(params["n_centroids"]).itemsize
        residuals = dim * params["residual_bits"] // 8
        return n_tokens * (codes + 4 + residuals) + params["n_centroids"] * (dim * 4 + 8)

    @classmethod
    def build_head(cls, directory: Path, head: str, vectors: TokenTable, params: dict[str, Any], *,
                   use_gpu: bool = False, gpu_device: int = 0,
                   device: torch.device | None = None) -> ResidualCodec | None:
        """Centroids, codes and inverted file of one head (and residual codes when asked); -> the codec or None.
        k-means and the assignment of every token run on the engine ``params["kmeans"]`` names for a build on
        ``device`` (the encoder's; :func:`~hil.retrieval.kmeans.kmeans_engine`: torch there, or FAISS, on the GPU
        ``use_gpu`` / ``gpu_device`` name where faiss-gpu sees it).

        With ``keep_embeddings=False`` the fp16 file is removed last, once the compressed vectors are in place.
        """
        if isinstance(vectors, CompressedEmbeddings):
            raise UserError(f"{directory}: head {head!r} is stored compressed only; new centroids would need "
                             "the original vectors: build the index again (build_index(..., overwrite=True))")
        paths = plaid_paths(directory, head)
        engine = kmeans_engine(params.get("kmeans", "faiss"), device if device is not None else "cpu",
                               use_gpu=use_gpu, gpu_device=gpu_device)
        centroids, assignment = train_plaid_centroids(
            vectors, params["n_centroids"], train_size=params["train_size"], niter=params["niter"],
            seed=params["seed"], engine=engine, method=params.get("assignment") or "exact",
            nprobe=params.get("assignment_nprobe") or 0)
        with atomic_output(paths["codes"]) as tmp:
            codes = np.lib.format.open_memmap(tmp, mode="w+", dtype=code_dtype(len(centroids)),
                                              shape=(vectors.shape[0],))
            assign_codes(vectors, centroids, out=codes, engine=engine, assignment=assignment)
            codes.flush()
            del codes
        codes = np.load(paths["codes"], mmap_mode="r")
        write_ivf(codes, np.load(directory / DOC_OFFSETS_NPY), len(centroids), paths["ivf_offsets"],
                  paths["ivf_docs"])
        codec = None
        if params["residual_bits"]:
            codec = _write_residuals(paths["residuals"], vectors, codes, centroids, params)
        else:
            paths["residuals"].unlink(missing_ok=True)
        del codes
        save_npy_atomic(paths["centroids"], centroids)
        if not params["keep_embeddings"]:
            embeddings_path(directory, head).unlink(missing_ok=True)
        return codec

    # -- searching ----------------------------------------------------------------------------------------------
    def plan(self, head: str) -> CentroidPlan:
        """The :class:`~hil.retrieval.plaid.CentroidPlan` of ``head``, loaded on first use and kept with the index."""
        self.index.require_head(head)
        key = ("plan", head)
        cache = self.index.search_structures
        if key not in cache:
            paths = plaid_paths(self.index.directory, head)
            centroids = load_npy(paths["centroids"])
            # Every query token is scored against every centroid: one NaN centroid would spoil every search.
            check_finite_vectors(centroids, str(paths["centroids"]),
                                 "the file is damaged; " + rebuild_hint(self.index.directory))
            # The inverted file stays a memory map (file pages, not this process's memory: 600 MB at 150M entries).
            cache[key] = CentroidPlan(centroids, load_npy(paths["codes"], "r"), load_npy(paths["ivf_offsets"]),
                                      load_npy(paths["ivf_docs"], "r"), self.index.doc_offsets)
        return cache[key]

    def _check_resolved(self) -> None:
        if not self.search.resolved:
            raise ValueError("PLAID's default nprobe / ndocs / stage2_docs depend on the ranking depth: open the "
                             "back-end with depth=k, or give all three (PlaidSearchConfig.for_depth)")

    def candidates(self, queries: EncodedBatch, heads: Sequence[str]) -> list[Candidates]:
        """:meth:`candidate_pairs` as per-query host arrays."""
        return self.candidate_pairs(queries, heads).per_query(len(queries))

    def candidate_pairs(self, queries: EncodedBatch, heads: Sequence[str]) -> CandidatePairs:
        """Every query of the batch searched at once on the device (:func:`~hil.retrieval.plaid_search.plaid_pairs`:
        one query is the batch of one, and a query's candidates do not depend on its batch), per head, then the
        union over heads."""
        self._check_resolved()
        per_head = []
        for head in heads:
            vectors = queries.heads[head]  # (B, Lq, D); the tokens outside ``mask`` take no part
            query, docs, _, _ = plaid_pairs(self.plan(head), vectors, queries.mask, nprobe=self.search.nprobe,
                                            ndocs=self.search.ndocs, stage2_docs=self.search.stage2_docs,
                                            device=self.search_device(vectors))
            per_head.append((query, docs))
        return CandidatePairs.union(per_head, self.index.n_docs)

    def search_device(self, queries: torch.Tensor) -> torch.device:
        """Where the stages run: the back-end's ``device`` when it was opened with one, else where the query
        vectors are (the encoder's device: a GPU encoder searches on its GPU)."""
        return self.device if self.device is not None else queries.device

    def search_stats(self) -> dict[str, Any]:
        """The three stages' settings as passed to :func:`~hil.retrieval.plaid_search.plaid_pairs` (it clips
        ``nprobe`` to the number of centroids: recorded as clipped)."""
        stats = super().search_stats()
        n_centroids = min((len(plan.centroids) for key, plan in self.index.search_structures.items()
                           if key[0] == "plan"), default=None)
        if n_centroids is not None and self.search.nprobe is not None:
            stats["nprobe"] = min(self.search.nprobe, n_centroids)
        return stats


def _write_residuals(path: Path, vectors: np.ndarray, codes: np.ndarray, centroids: np.ndarray,
                     params: dict[str, Any]) -> ResidualCodec:
    """Fit residual buckets on a seeded sample of tokens, then compress every token into ``path``."""
    n_tokens = vectors.shape[0]
    rows = sample_rows(n_tokens, min(n_tokens, CODEC_SAMPLE), params["seed"] + 1)
    codec = fit_residual_codec(np.asarray(vectors[rows], dtype=np.float32), np.asarray(codes[rows]), centroids,
                               params["residual_bits"])
    with atomic_output(path) as tmp:
        packed = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(n_tokens, codec.packed_bytes))
        codec.compress_into(vectors, codes, packed)
        packed.flush()
        del packed
    return codec
