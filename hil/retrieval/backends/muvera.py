"""The ``muvera`` back-end: candidates by one inner-product search over fixed dimensional encodings (MUVERA).

Dhulipala et al. 2024 (arXiv 2405.19504), Sec. 2-3: every document's token set becomes one vector F_doc(P), every
query's F_q(Q) (:mod:`hil.retrieval.fde`, the equations there), and a single-vector maximum inner product search
over the F_doc finds the candidates, which full ranking then scores exactly by the encoder over the stored token
vectors (the paper's re-ranking by Chamfer similarity). Per head: ``<head>.muvera.faiss``, a FAISS ``IndexFlatIP``
of the document FDEs in document order (exact inner products: the approximation is the FDE's alone), and
``<head>.muvera.npz``, the random draws the FDEs were built with (hyperplanes, inner projections, count sketch) and
the index-time transform. A search reads both from the index, so queries meet documents encoded with the very same
draws whatever torch's generator does on another machine or version.

Index-time transform (``MuveraIndexConfig.transform``): SimHash partitions are coarse when the tokens lie in a
narrow cone (few hyperplanes through the origin cut it, so most tokens share a bucket and the FDE tends to a mean),
which is what anisotropic ColBERT embeddings do (LightOn 2026, issue 30). ``center`` subtracts the mean of the
head's corpus tokens, ``whiten`` then multiplies by ``(Sigma + lambda I)^-1/2`` (ZCA: the symmetric inverse square
root, which keeps the axes; ``lambda`` = :data:`WHITEN_RIDGE` times the mean eigenvalue, so directions without
variance are not blown up); the result is L2-normalized (Theorem 2.1 is for unit vectors; 000 likewise scores
transformed vectors by cosine). Mean and covariance are those of every stored token of the head (float64,
:class:`~hil.isotropy.linear_transforms.MomentAccumulator`). The transform applies to query tokens too,
and only to the FDEs: exact scoring reads the stored, untransformed vectors.

Search: each head's query FDEs (computed where the query vectors are) retrieve that head's ``n_candidates`` best
documents from its FAISS index, and the union over heads, with which head proposed each, goes to exact scoring.
On a GPU the FDEs are computed there, but ``index_add_`` sums with atomics, so they equal the CPU's up to float
rounding (candidates can differ only where two FDE inner products tie at the cut); the FAISS search runs on the
GPU only with faiss-gpu (``use_gpu``), which limits ``n_candidates`` to 2,048.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hil.errors import UserError
from hil.isotropy.linear_transforms import MomentAccumulator
from hil.modeling.contracts import EncodedBatch
from hil.provenance import atomic_output
from hil.retrieval.backends.base import CandidatePairs, Candidates, SearchBackend
from hil.retrieval.backends.config_base import IndexConfig
from hil.retrieval.backends.muvera_configs import MuveraIndexConfig, MuveraSearchConfig
from hil.retrieval.backends.token_ann import _to_gpu
from hil.retrieval.codec import ResidualCodec
from hil.retrieval.fde import MAX_K_SIM, FdeSketch, document_fde, fde_dimension, fde_sketch, query_fde
from hil.retrieval.index import DOC_OFFSETS_NPY
from hil.retrieval.integrity import NonFiniteError, check_finite_vectors, rebuild_hint
from hil.retrieval.store import TokenTable, padded_rows

WHITEN_RIDGE = 1e-3  # ridge of the whitening, relative to the covariance's mean eigenvalue
# Per block of documents: padded tokens read and encoded at once, and FDE floats held (2^24: 64 MiB).
BLOCK_TOKENS = 1 << 15
BLOCK_FDE_FLOATS = 1 << 24


# -- the index-time transform -----------------------------------------------------------------------------------

def fit_token_transform(kind: str, moments: MomentAccumulator) -> tuple[np.ndarray, np.ndarray]:
    """(mean (D,), matrix (D, D)) float64 of the transform ``x -> normalize((x - mean) @ matrix)``: ``center``
    the identity matrix, ``whiten`` ZCA ``U diag((s + lambda)^-1/2) U^T`` of the covariance ``U diag(s) U^T``."""
    mean = moments.mean.numpy()
    if kind == "center":
        return mean, np.eye(len(mean))
    covariance = moments.covariance.numpy()
    eigenvalues, vectors = np.linalg.eigh(covariance)
    ridge = WHITEN_RIDGE * max(float(np.trace(covariance)) / len(mean), np.finfo(np.float64).tiny)
    scale = 1.0 / np.sqrt(np.clip(eigenvalues, 0.0, None) + ridge)
    return mean, (vectors * scale) @ vectors.T


def apply_token_transform(vectors: torch.Tensor, mean: torch.Tensor | None,
                          matrix: torch.Tensor | None) -> torch.Tensor:
    """``normalize((x - mean) @ matrix)`` of (..., D) float32 vectors; unchanged without a transform."""
    if mean is None:
        return vectors
    return torch.nn.functional.normalize((vectors - mean) @ matrix, dim=-1)


# -- blocks of documents ----------------------------------------------------------------------------------------

def document_blocks(lengths: np.ndarray, max_padded_tokens: int, max_docs: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` runs of documents whose padded size ``count * longest`` (an empty document
    counts 1) fits ``max_padded_tokens`` and count ``max_docs``; at least one document each (greedy)."""
    blocks, start, n = [], 0, len(lengths)
    while start < n:
        window = np.maximum.accumulate(np.maximum(lengths[start: start + max(1, max_docs)], 1))
        padded = np.arange(1, len(window) + 1) * window  # nondecreasing
        end = start + max(1, int(np.searchsorted(padded, max_padded_tokens, side="right")))
        blocks.append((start, end))
        start = end
    return blocks


def padded_block(vectors: TokenTable, doc_offsets: np.ndarray, start: int, end: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents ``start..end - 1`` as (N, L, D) float32 + mask (N, L) on ``device``: their tokens are one
    contiguous run of the table, read once."""
    first, last = int(doc_offsets[start]), int(doc_offsets[end])
    tokens = torch.from_numpy(np.ascontiguousarray(vectors[first:last], dtype=np.float32))
    rows, mask = padded_rows(doc_offsets[start: end + 1] - first, np.arange(end - start))
    if last == first:  # no token at all: nothing to read
        return torch.zeros((*mask.shape, vectors.shape[1]), device=device), mask.to(device)
    padded = tokens[rows] * mask.unsqueeze(-1)
    return padded.to(device), mask.to(device)


# -- the back-end -----------------------------------------------------------------------------------------------

class MuveraBackend(SearchBackend):
    """FDE candidates (see the module docstring), steered by a :class:`MuveraSearchConfig` at every search."""

    kind = "muvera"
    index_config = MuveraIndexConfig
    search_config = MuveraSearchConfig

    # -- building -----------------------------------------------------------------------------------------------
    @classmethod
    def resolve_params(cls, config: IndexConfig, n_tokens: int, dim: int) -> dict[str, Any]:
        """Every field of :class:`MuveraIndexConfig`, ``d_proj`` resolved to the dimension used (``dim`` for the
        identity: None or ``dim``); refused: ``d_proj`` above ``dim``, ``d_final`` above d_FDE."""
        config = cls.check_config(config)
        assert isinstance(config, MuveraIndexConfig)
        if config.d_proj is not None and config.d_proj > dim:
            raise UserError(f"muvera: d_proj={config.d_proj} is larger than the embedding dimension {dim} (an inner "
                             "projection reduces it; d_proj=None keeps the vectors as they are)")
        if not 0 <= config.k_sim <= MAX_K_SIM:
            raise UserError(f"muvera: k_sim must lie in 0..{MAX_K_SIM}, got {config.k_sim}")
        d_proj = dim if config.d_proj is None else config.d_proj
        size = fde_dimension(dim, config.k_sim, d_proj, config.r_reps)
        if config.d_final is not None and config.d_final > size:
            raise UserError(f"muvera: d_final={config.d_final} is larger than the FDE dimension {size} "
                             f"(r_reps * 2^k_sim * d_proj = {config.r_reps} * {1 << config.k_sim} * {d_proj})")
        return {"k_sim": config.k_sim, "d_proj": d_proj, "r_reps": config.r_reps, "d_final": config.d_final,
                "fill_empty": config.fill_empty, "seed": config.seed, "transform": config.transform}

    @classmethod
    def factory(cls, params: dict[str, Any]) -> str:
        final = f",CS{params['d_final']}" if params["d_final"] is not None else ""
        transform = f",{params['transform']}" if params["transform"] != "none" else ""
        return f"FDE{params['k_sim']}x{params['d_proj']}x{params['r_reps']}{final}{transform},FlatIP"

    @classmethod
    def head_files(cls, directory: Path, head: str) -> list[Path]:
        return [directory / f"{head}.muvera.faiss", directory / f"{head}.muvera.npz"]

    @classmethod
    def structure_bytes(cls, params: dict[str, Any], n_tokens: int, n_docs: int, dim: int) -> int:
        """One fp32 FDE per document in a flat FAISS index."""
        size = params["d_final"] or fde_dimension(dim, params["k_sim"], params["d_proj"], params["r_reps"])
        return n_docs * size * 4

    @classmethod
    def build_head(cls, directory: Path, head: str, vectors: TokenTable, params: dict[str, Any], *,
                   use_gpu: bool = False, gpu_device: int = 0,
                   device: torch.device | None = None) -> ResidualCodec | None:
        """Fit the transform (one pass over the tokens), then each block of documents' FDEs on ``device`` (the
        encoder's), added to an ``IndexFlatIP`` in document order; both files written atomically."""
        import faiss

        device = torch.device(device if device is not None else "cpu")
        doc_offsets = np.load(directory / DOC_OFFSETS_NPY)
        dim = int(vectors.shape[1])
        sketch = fde_sketch(dim, k_sim=params["k_sim"], d_proj=params["d_proj"], r_reps=params["r_reps"],
                            d_final=params["d_final"], seed=params["seed"])
        what = f"{directory}: the vectors of head {head}"
        advice = "the index's vectors are damaged; " + rebuild_hint(directory)
        lengths = np.diff(doc_offsets)
        blocks = document_blocks(lengths, BLOCK_TOKENS, max(1, BLOCK_FDE_FLOATS // sketch.out_dim))
        mean = matrix = None
        if params["transform"] != "none":
            moments = MomentAccumulator()
            for start, end in blocks:
                rows = np.ascontiguousarray(vectors[int(doc_offsets[start]):int(doc_offsets[end])], dtype=np.float32)
                check_finite_vectors(rows, what, advice, first_row=int(doc_offsets[start]))
                moments.update(torch.from_numpy(rows))
            if moments.count < 2:
                raise UserError(f"muvera: transform={params['transform']!r} needs at least 2 tokens in head "
                                 f"{head!r}, the index has {moments.count}")
            mean, matrix = fit_token_transform(params["transform"], moments)
        on_device = sketch.to(device)
        transform = _as_tensors(mean, matrix, device)
        index = faiss.IndexFlatIP(sketch.out_dim)
        for start, end in blocks:
            padded, mask = padded_block(vectors, doc_offsets, start, end, device)
            fdes = document_fde(apply_token_transform(padded, *transform), mask, on_device,
                                fill_empty=params["fill_empty"]).cpu().numpy()
            check_finite_vectors(fdes, what, advice, first_row=start)  # a damaged token spoils its document's FDE
            index.add(np.ascontiguousarray(fdes, dtype=np.float32))
        faiss_path, npz_path = cls.head_files(directory, head)
        with atomic_output(faiss_path) as tmp:
            faiss.write_index(index, str(tmp))
        arrays = {name: value.numpy() for name, value in (
            ("hyperplanes", sketch.hyperplanes), ("inner", sketch.inner), ("final_buckets", sketch.final_buckets),
            ("final_signs", sketch.final_signs)) if value is not None}
        if mean is not None:
            arrays.update(transform_mean=mean.astype(np.float32), transform_matrix=matrix.astype(np.float32))
        with atomic_output(npz_path) as tmp, open(tmp, "wb") as handle:
            np.savez(handle, **arrays)
        return None

    # -- searching ----------------------------------------------------------------------------------------------
    def structures(self, head: str) -> tuple[Any, FdeSketch, np.ndarray | None, np.ndarray | None]:
        """(FAISS index, FDE sketch, transform mean, transform matrix) of ``head``, read on first use and kept with
        the opened index."""
        self.index.require_head(head)
        # Not `use_gpu and gpu_device`: GPU 0's key was then 0, equal to False, the CPU's.
        key = ("muvera", head, ("gpu", self.gpu_device) if self.use_gpu else "cpu")
        cache = self.index.search_structures
        if key not in cache:
            import faiss

            faiss_path, npz_path = self.head_files(self.index.directory, head)
            with np.load(npz_path) as stored:
                arrays = {name: stored[name] for name in stored.files}
            params = self.index.backend_settings["params"]
            tensors = {name: torch.from_numpy(value) for name, value in arrays.items()}
            sketch = FdeSketch(tensors["hyperplanes"], tensors.get("inner"), tensors.get("final_buckets"),
                               tensors.get("final_signs"), params["d_final"])
            index = faiss.read_index(str(faiss_path))
            if self.use_gpu:
                index = _to_gpu(index, self.gpu_device)
            cache[key] = (index, sketch, arrays.get("transform_mean"), arrays.get("transform_matrix"))
        return cache[key]

    def token_transform(self, head: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The transform fitted at build time (``MuveraIndexConfig.transform``), from the head's ``.npz`` alone
        (its FAISS index is not loaded); None for ``transform: none``."""
        self.index.require_head(head)
        with np.load(self.head_files(self.index.directory, head)[1]) as stored:
            if "transform_mean" not in stored.files:
                return None
            return stored["transform_mean"], stored["transform_matrix"]

    def candidates_per_head(self) -> tuple[str, int] | None:
        given = self.search.n_candidates
        return ("n_candidates", given) if given is not None else None

    @property
    def n_candidates(self) -> int:
        """Documents each head's FDE search returns: ``n_candidates`` (default for the depth, else 100), at most
        the number of documents."""
        wanted = self.search.n_candidates
        return min(wanted if wanted is not None else MuveraSearchConfig().for_depth(1).n_candidates,
                   max(1, self.index.n_docs))

    def query_fdes(self, queries: EncodedBatch, head: str) -> np.ndarray:
        """F_q of every query of the batch in ``head`` (transformed as the documents were), computed where the
        query vectors are (or on the back-end's ``device``). -> (B, out_dim) float32 on the host."""
        _, sketch, mean, matrix = self.structures(head)
        vectors = queries.heads[head]
        device = self.device if self.device is not None else vectors.device
        transformed = apply_token_transform(vectors.to(device, torch.float32), *_as_tensors(mean, matrix, device))
        fdes = query_fde(transformed, queries.mask.to(device).bool(), sketch.to(device))
        return np.ascontiguousarray(fdes.cpu().numpy(), dtype=np.float32)

    def candidate_pairs(self, queries: EncodedBatch, heads: Sequence[str]) -> CandidatePairs:
        """Each head's FAISS search of the batch's query FDEs, then the union over heads (flags per head)."""
        per_head, n_docs = [], self.index.n_docs
        for head in heads:
            faiss_index = self.structures(head)[0]
            sims, hits = faiss_index.search(self.query_fdes(queries, head), self.n_candidates)  # (B, n) each
            valid = hits >= 0
            if not np.isfinite(sims[valid]).all():  # query vectors are checked before: the stored FDEs are at fault
                raise NonFiniteError(f"{self.index.directory} (head {head}): the FDE index returned non-finite "
                                     "inner products: its file is damaged; " + rebuild_hint(self.index.directory))
            query = np.nonzero(valid)[0].astype(np.int64)
            per_head.append((torch.from_numpy(query), torch.from_numpy(hits[valid].astype(np.int64))))
        pairs = CandidatePairs.union(per_head, n_docs)
        device = queries.mask.device
        return CandidatePairs(pairs.query.to(device), pairs.docs.to(device), pairs.heads.to(device))

    def candidates(self, queries: EncodedBatch, heads: Sequence[str]) -> list[Candidates]:
        """:meth:`candidate_pairs` as per-query host arrays."""
        return self.candidate_pairs(queries, heads).per_query(len(queries))

    def search_stats(self) -> dict[str, Any]:
        """``n_candidates`` as asked of FAISS (the default for the depth filled in, capped at the number of
        documents)."""
        return {**super().search_stats(), "n_candidates": self.n_candidates}


def _as_tensors(mean: np.ndarray | None, matrix: np.ndarray | None,
                device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if mean is None:
        return None, None
    return (torch.as_tensor(mean, dtype=torch.float32, device=device),
            torch.as_tensor(matrix, dtype=torch.float32, device=device))
