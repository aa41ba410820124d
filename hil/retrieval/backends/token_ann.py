"""Token-level ANN back-ends (ColBERT v1's end-to-end retrieval): ``flat``, ``ivfflat`` and ``ivfpq`` FAISS indexes.

Khattab & Zaharia 2020, Sec. 3.6 (HIL Sec. 2): every query token vector retrieves its ``ncandidates`` nearest
document token vectors (inner product) from the head's FAISS index; the documents owning them are the query's
candidates, the union over tokens and heads.

Choices (the paper only says "ANN search, then late-interaction re-ranking"; these follow ColBERT v1):
- ``flat`` is exact inner-product search (``IndexFlatIP``). Its content is exactly the fp16 embeddings widened to
  fp32, so it is *not* written to disk (that would double the index size for nothing): it is rebuilt in memory
  from the embeddings on first use. ``ivfflat`` / ``ivfpq`` are trained on a seeded random sample of tokens and
  written as ``<head>.faiss``.
- ``max_candidates`` caps the candidates of a query, keeping those with the best approximate score: the sum over
  heads and query tokens of each token's best retrieved similarity in the document (MaxSim restricted to what the
  ANN returned: a ColBERT-style lower bound of Eq. 1, a choice of ours); ties go to the lower document row.
"""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from hil.errors import UserError
from hil.modeling.contracts import EncodedBatch
from hil.provenance import atomic_output
from hil.retrieval.backends.base import Candidates, SearchBackend
from hil.retrieval.backends.config_base import IndexConfig
from hil.retrieval.backends.token_ann_configs import (
    FlatIndexConfig,
    FlatSearchConfig,
    IvfFlatIndexConfig,
    IvfPqIndexConfig,
    IvfSearchConfig,
)
from hil.retrieval.codec import ResidualCodec
from hil.retrieval.device_tokens import device_tokens
from hil.retrieval.devices import faiss_gpu_count
from hil.retrieval.integrity import NonFiniteError, check_finite_vectors, rebuild_hint
from hil.retrieval.store import TokenTable
from hil.retrieval.torch_flat import TorchFlatSearch

logger = logging.getLogger(__name__)

# Rows widened to fp32 and added to a FAISS index at once (bounds the temporary copy: 128 MiB at D = 128).
_ADD_BLOCK = 1 << 18


# -- FAISS helpers ----------------------------------------------------------------------------------------------

def _to_gpu(index: Any, device: int = 0) -> Any:
    """``index`` copied to FAISS GPU ``device`` (the CPU index itself, with a warning, when FAISS has no GPU)."""
    import faiss

    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        logger.warning("use_gpu=True but faiss sees no GPU (faiss-cpu installed?): staying on the CPU")
        return index
    resources = faiss.StandardGpuResources()
    gpu_index = faiss.index_cpu_to_gpu(resources, int(device), index)
    gpu_index.hil_resources = resources  # keep the resources alive as long as the index
    return gpu_index


def _is_gpu_index(index: Any) -> bool:
    return type(index).__name__.startswith("Gpu")


def _ivf_part(index: Any) -> Any:
    """The IVF part of a FAISS index (the object that holds ``nprobe``), or None for a flat index."""
    import faiss

    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return index if hasattr(index, "nprobe") else None  # a GPU IVF index: extract_index_ivf does not know it


def set_nprobe(index: Any, nprobe: int) -> None:
    """Set the number of inverted lists visited per query vector (IVF indexes; a no-op for flat ones)."""
    part = _ivf_part(index)
    if part is not None:
        part.nprobe = int(nprobe)


def get_nprobe(index: Any) -> int | None:
    """The ``nprobe`` a FAISS index searches with now (None for a flat index): read back for the records."""
    part = _ivf_part(index)
    return None if part is None else int(part.nprobe)


# -- candidates from token hits ---------------------------------------------------------------------------------

def head_hits(faiss_index: Any, vectors: np.ndarray, token_rows: np.ndarray, token_doc: np.ndarray, n_docs: int,
              ncandidates: int, want_approx: bool,
              where: str = "token search") -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """One ANN search of all query token vectors (T, D) of a batch -> unique ``row * n_docs + doc`` keys.

    ``token_rows`` (T,): the query row of each vector. With ``want_approx`` also (keys, values) of each (row,
    doc, query token) pair's best retrieved similarity, to be summed into the approximate score.
    """
    sims, hits = faiss_index.search(vectors, ncandidates)  # (T, k) each
    valid = hits >= 0  # FAISS pads with -1 when it finds fewer than k
    if not np.isfinite(sims[valid]).all():  # query vectors are checked before: the FAISS index is at fault
        raise NonFiniteError(f"{where}: the FAISS index returned non-finite similarities (NaN or inf): its file is "
                             "damaged; rebuild it")
    token_pos = np.nonzero(valid)[0]
    docs = token_doc[hits[valid]].astype(np.int64)
    keys = token_rows[token_pos] * n_docs + docs
    if not want_approx:
        return np.unique(keys), None, None
    token_keys = token_pos.astype(np.int64) * n_docs + docs
    similarity = sims[valid]
    order = np.lexsort((-similarity, token_keys))  # per (token, doc) the best hit first
    unique_token_keys, first = np.unique(token_keys[order], return_index=True)
    best = similarity[order][first].astype(np.float64)
    row_keys = token_rows[unique_token_keys // n_docs] * n_docs + unique_token_keys % n_docs
    return np.unique(keys), row_keys, best


def _cap(docs: np.ndarray, flags: np.ndarray, approx: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``cap`` documents of best approximate score (ties: lower row first), kept in ascending row order."""
    keep = np.lexsort((docs, -approx))[:cap]
    keep.sort()
    return docs[keep], flags[keep]


class TokenAnnBackend(SearchBackend):
    """Candidates from a FAISS index of every stored token, one per head (see the module docstring)."""

    trained: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._used_nprobe: dict[str, int | None] = {}  # head -> nprobe its FAISS index searched with
        self._search_device: torch.device | None = None  # where the last batch's queries were

    @property
    def ncandidates(self) -> int:
        """Neighbours asked per query token: ``ncandidates``, but never more than the index holds."""
        return min(self.search.ncandidates, max(1, self.index.n_tokens))

    def search_stats(self) -> dict[str, Any]:
        """The settings as used: ``ncandidates`` as asked of FAISS, and ``nprobe`` read back from each head's
        FAISS index after its last search (one value when the heads agree)."""
        stats: dict[str, Any] = {**super().search_stats(), "ncandidates": self.ncandidates}
        if isinstance(self.search, IvfSearchConfig):
            used = set(self._used_nprobe.values())
            stats["nprobe"] = used.pop() if len(used) == 1 else dict(self._used_nprobe) or None
        return stats

    @abstractmethod
    def _open_faiss(self, head: str, device: torch.device | None = None) -> Any:
        """The FAISS index of ``head`` for this search's device (loaded or rebuilt); ``device``: where the queries
        are (a back-end may search there without FAISS: ``flat`` on an accelerator)."""

    def faiss_index(self, head: str, device: torch.device | None = None) -> Any:
        """The FAISS index of ``head``, loaded (or, for ``flat``, rebuilt from the embeddings) on first use and kept
        with the opened index; this search's ``nprobe`` is set on it every time (the cached object is shared by
        every search of the opened index, each with its own settings)."""
        self.index.require_head(head)
        on_accelerator = device is not None and device.type != "cpu"
        # Not `use_gpu and gpu_device`: GPU 0's key was then 0, equal to False, the CPU's.
        where = ("gpu", self.gpu_device) if self.use_gpu else "cpu"
        key = ("faiss", head, where, str(device) if on_accelerator else None)
        cache = self.index.search_structures
        if key not in cache:
            cache[key] = self._open_faiss(head, device)
        if isinstance(self.search, IvfSearchConfig):
            set_nprobe(cache[key], self.search.nprobe)
        return cache[key]

    @classmethod
    def new_faiss_index(cls, vectors: TokenTable, params: dict[str, Any], *, use_gpu: bool = False,
                        gpu_device: int = 0, block_tokens: int = _ADD_BLOCK, what: str = "the stored vectors",
                        advice: str = "the file holding them is damaged") -> Any:
        """An inner-product FAISS index over ``vectors`` (n_tokens, D), trained if this kind needs it, filled
        in fp32 blocks read from the (memmapped) table. ``params`` are resolved.

        Every block is checked for NaN / inf on its way in (:class:`~hil.retrieval.integrity.NonFiniteError`
        naming ``what``, followed by ``advice``): FAISS would silently never return such a token, so its document
        would drop out of every ranking. Chunks refuse non-finite vectors when written, so one here means a damaged
        file."""
        import faiss

        n_tokens, dim = vectors.shape
        index = faiss.index_factory(dim, cls.factory(params), faiss.METRIC_INNER_PRODUCT)
        if use_gpu:
            index = _to_gpu(index, gpu_device)
        if cls.trained:
            rng = np.random.default_rng(params["seed"])
            sample = np.sort(rng.choice(n_tokens, size=params["train_size"], replace=False))
            index.train(np.ascontiguousarray(vectors[sample], dtype=np.float32))
        for start in range(0, n_tokens, block_tokens):
            block = np.ascontiguousarray(vectors[start: start + block_tokens], dtype=np.float32)
            check_finite_vectors(block, what, advice, first_row=start)
            index.add(block)
        return index

    def candidates(self, queries: EncodedBatch, heads: Sequence[str]) -> list[Candidates]:
        self._search_device = self.device if self.device is not None else queries.mask.device
        mask = queries.mask.bool()
        token_rows = np.nonzero(mask.cpu().numpy())[0].astype(np.int64)  # query row of each scored token
        union, flags, approx = self._union_over_heads(queries, mask, token_rows, heads)
        n_docs, cap = self.index.n_docs, self.search.max_candidates
        bounds = np.searchsorted(union // n_docs, np.arange(len(queries) + 1))  # union is sorted by (row, doc)
        found = []
        for row in range(len(queries)):
            lo, hi = bounds[row], bounds[row + 1]
            docs, doc_flags = union[lo:hi] % n_docs, flags[lo:hi]
            if approx is not None and cap is not None and len(docs) > cap:
                docs, doc_flags = _cap(docs, doc_flags, approx[lo:hi], cap)
            found.append(Candidates(docs, doc_flags))
        return found

    def _union_over_heads(self, queries: EncodedBatch, mask: torch.Tensor, token_rows: np.ndarray,
                          heads: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """ANN search of a batch's query tokens in every head -> (union keys ``row * n_docs + doc`` sorted (U,),
        flags (U, H), approximate scores (U,) when candidates are capped, else None)."""
        n_docs, want_approx = self.index.n_docs, self.search.max_candidates is not None
        head_keys, approx_keys, approx_values = [], [], []
        for head in heads:
            vectors = np.ascontiguousarray(queries.heads[head][mask].float().cpu().numpy())  # (T, D)
            faiss_index = self.faiss_index(head, self._search_device)
            keys, row_keys, best = head_hits(faiss_index, vectors, token_rows, self.index.token_doc,
                                             n_docs, self.ncandidates, want_approx,
                                             where=f"{self.index.directory} (head {head})")
            self._used_nprobe[head] = get_nprobe(faiss_index)
            head_keys.append(keys)
            approx_keys.append(row_keys)
            approx_values.append(best)
        union = np.unique(np.concatenate(head_keys))
        flags = np.stack([np.isin(union, keys, assume_unique=True) for keys in head_keys], axis=1)  # (U, H)
        if not want_approx:
            return union, flags, None
        inverse = np.searchsorted(union, np.concatenate(approx_keys))  # every approx key is in the union
        approx = np.bincount(inverse, weights=np.concatenate(approx_values), minlength=len(union))
        return union, flags, approx


class FlatBackend(TokenAnnBackend):
    """Exact inner-product search, rebuilt in memory from the stored vectors (nothing written)."""

    kind = "flat"
    index_config = FlatIndexConfig
    search_config = FlatSearchConfig
    stores_files = False

    @classmethod
    def resolve_params(cls, config: IndexConfig, n_tokens: int, dim: int) -> dict[str, Any]:
        cls.check_config(config)
        return {}

    @classmethod
    def factory(cls, params: dict[str, Any]) -> str:
        return "Flat"

    @classmethod
    def search_memory_bytes(cls, params: dict[str, Any], n_tokens: int, n_docs: int, dim: int) -> int:
        """``IndexFlatIP`` holds every stored vector widened to fp32."""
        return n_tokens * dim * 4

    def _open_faiss(self, head: str, device: torch.device | None = None) -> Any:
        """FAISS's flat index on the CPU or faiss-gpu; for queries on an accelerator where FAISS is not on the GPU
        (faiss-cpu, the usual case with CUDA 13 torch), the same search in torch on that device when its table fits
        there (:class:`~hil.retrieval.torch_flat.TorchFlatSearch`)."""
        directory = self.index.directory
        if device is not None and device.type != "cpu" and not (self.use_gpu and faiss_gpu_count()):
            where, table = device_tokens(self.index, device).table(head)
            if where == "device":
                return TorchFlatSearch(table, where=f"{directory} (head {head})")
        return self.new_faiss_index(self.index.embeddings[head], {}, use_gpu=self.use_gpu,
                                    gpu_device=self.gpu_device,
                                    what=f"{directory}: the stored vectors of head {head}",
                                    advice="the index is damaged; " + rebuild_hint(directory))


def _largest_divisor_at_most(value: int, limit: int) -> int:
    return max(d for d in range(1, min(value, limit) + 1) if value % d == 0)


class IvfBackend(TokenAnnBackend):
    """An inverted file of ``nlist`` k-means lists, ``nprobe`` of them visited per query token; written to disk."""

    search_config = IvfSearchConfig
    trained = True

    @classmethod
    def resolve_params(cls, config: IndexConfig, n_tokens: int, dim: int) -> dict[str, Any]:
        """Defaults: ``nlist = min(4 sqrt(n_tokens), n_tokens / 39)`` (FAISS wants >= 39 training points per
        list), ``train_size = min(n_tokens, max(100 nlist, 65536))``."""
        params = cls.check_config(config).given()
        nlist = int(params.get("nlist") or max(1, min(int(4 * math.sqrt(n_tokens)), n_tokens // 39)))
        train_size = int(params.get("train_size") or min(n_tokens, max(100 * nlist, 65536)))
        resolved: dict[str, Any] = {"nlist": nlist, "train_size": min(train_size, n_tokens),
                                    "seed": int(params.get("seed", 0))}
        if resolved["train_size"] < nlist:
            raise UserError(f"backend {cls.kind}: nlist={nlist} needs at least {nlist} training tokens, the index has "
                             f"{n_tokens} tokens and train_size={resolved['train_size']}; lower nlist")
        return resolved

    @classmethod
    def head_files(cls, directory: Path, head: str) -> list[Path]:
        return [directory / f"{head}.faiss"]

    @classmethod
    def structure_bytes(cls, params: dict[str, Any], n_tokens: int, n_docs: int, dim: int) -> int:
        """FAISS's file: every vector in fp32 (IVF-Flat; PQ codes for IVF-PQ) and its 8-byte id, and the lists'
        centroids."""
        per_token = (params["m"] * params["nbits"] + 7) // 8 if "m" in params else 4 * dim
        return n_tokens * (per_token + 8) + params["nlist"] * dim * 4

    @classmethod
    def search_memory_bytes(cls, params: dict[str, Any], n_tokens: int, n_docs: int, dim: int) -> int:
        """``faiss.read_index`` loads the whole file."""
        return cls.structure_bytes(params, n_tokens, n_docs, dim)

    @classmethod
    def build_head(cls, directory: Path, head: str, vectors: TokenTable, params: dict[str, Any], *,
                   use_gpu: bool = False, gpu_device: int = 0,
                   device: torch.device | None = None) -> ResidualCodec | None:
        import faiss

        index = cls.new_faiss_index(vectors, params, use_gpu=use_gpu, gpu_device=gpu_device,
                                    what=f"{directory}: the vectors of head {head}",
                                    advice="the index's vectors are damaged; " + rebuild_hint(directory))
        if _is_gpu_index(index):
            index = faiss.index_gpu_to_cpu(index)
        (path,) = cls.head_files(directory, head)
        with atomic_output(path) as tmp:
            faiss.write_index(index, str(tmp))
        return None

    def _open_faiss(self, head: str, device: torch.device | None = None) -> Any:
        import faiss

        (path,) = self.head_files(self.index.directory, head)
        index = faiss.read_index(str(path))
        if self.use_gpu:
            index = _to_gpu(index, self.gpu_device)
        return index


class IvfFlatBackend(IvfBackend):
    """IVF with full fp32 vectors in the lists."""

    kind = "ivfflat"
    index_config = IvfFlatIndexConfig

    @classmethod
    def factory(cls, params: dict[str, Any]) -> str:
        return f"IVF{params['nlist']},Flat"


class IvfPqBackend(IvfBackend):
    """IVF with product-quantized vectors: ``m`` sub-vectors of ``nbits`` bits each."""

    kind = "ivfpq"
    index_config = IvfPqIndexConfig

    @classmethod
    def resolve_params(cls, config: IndexConfig, n_tokens: int, dim: int) -> dict[str, Any]:
        """The IVF defaults, plus ``m`` = the largest divisor of D up to 16 (16 bytes per token with ``nbits=8``,
        ColBERT v1's setting) and ``nbits = 8``."""
        resolved = super().resolve_params(config, n_tokens, dim)
        params = config.given()
        m = int(params.get("m") or _largest_divisor_at_most(dim, 16))
        nbits = int(params.get("nbits", 8))
        if dim % m:
            raise UserError(f"backend ivfpq: m={m} must divide the embedding dimension {dim}")
        if not 1 <= nbits <= 16:
            raise UserError(f"backend ivfpq: nbits must be in 1..16, got {nbits}")
        if resolved["train_size"] < 2 ** nbits:
            raise UserError(f"backend ivfpq: nbits={nbits} needs at least {2 ** nbits} training tokens, got "
                             f"{resolved['train_size']}; lower nbits")
        return {**resolved, "m": m, "nbits": nbits}

    @classmethod
    def factory(cls, params: dict[str, Any]) -> str:
        return f"IVF{params['nlist']},PQ{params['m']}x{params['nbits']}"
