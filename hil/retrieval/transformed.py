"""Post-hoc isotropy transforms at evaluation time: an encoder wrapper, fitting on a corpus, a derived index.

Jung et al. (paper 000, Section 4.1) whiten or flow the token representations of a *frozen* retriever and score
the transformed vectors with the same cosine aggregator; Su et al. (002) add dimension reduction (Whitening-k).
Here any :class:`~hil.isotropy.postprocess.TransformPipeline` is applied to each head's token vectors:

    base = load_encoder("model")                              # any encoder: ColBERT, HIL (heads L/H), ensemble
    index = open_or_build_index(base, doc_ids, texts, folder)
    transforms = fit_head_transforms(index, "whitening", mode="token")       # head -> fitted pipeline
    encoder = TransformedEncoder(base, transforms, spec="whitening", mode="token")
    derived = derive_transformed_index(index, encoder, other_folder)         # no re-encoding of the corpus
    full_rank(encoder, derived, queries)

Choices (where the papers leave room):

- **What is transformed.** The heads' output vectors (L2-normalized, D-dimensional) -- the vectors the model
  scores -- not the backbone's hidden states: the heads are what every architecture here shares, and for an
  untrained or trained head alike the transform then acts on exactly the space MaxSim sees. 000 transforms
  "BERT representations" of a ColBERT whose scores are cosines of those representations; our heads play that role.
- **Fitted on documents only.** The statistics come from corpus token vectors (000: "pre-compute the mean and
  covariance using ... the source data"): up to ``max_tokens`` (default 200,000) tokens sampled uniformly from
  the stored index, or, without an index, from encoding a sample of documents. Queries are transformed with the
  same parameters; their own distribution (with ``[MASK]`` augmentation tokens) is not used for fitting.
- **Token-wise vs sequence-wise** (000 Section 4.1.1): ``mode="token"`` fits on token vectors, ``"sequence"`` on
  one mean-pooled vector per sampled document; either way it maps token vectors (ColBERT's scores need them).
- **Renormalization.** The last step L2-normalizes (``fit_transform_from_config``'s default): the score stays a sum
  of cosines, 000's "aggregator that performs the cosine similarity". Masked positions stay exactly 0.
- **Scoring** is the wrapped encoder's own ``score`` / ``score_pairs`` on the transformed vectors. HIL's running
  z-score statistics, estimated on untransformed vectors, no longer standardize the head scores after a transform:
  ``L + H`` then weighs each head by its new spread (not re-estimated).
- **A derived index** holds the base index's stored (fp16) vectors transformed block by block, instead of
  encoding the corpus again: the same result up to fp16 rounding of the transform's input. Its ``index.json``
  records the transform and the base index it came from; the fitted parameters are saved beside it as
  ``transform_<head>.pt`` (+ ``transforms.json``). Its encoder fingerprint is the transformed encoder's, so
  ``open_or_build_index(encoder, ...)`` reuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from hil.data.tokenization import ColBERTTokenizer, TokenizedBatch
from hil.isotropy.post_transform import PostTransform
from hil.isotropy.postprocess import TransformPipeline, fit_transform_from_config, load_transform
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.provenance import file_lock, lock_path, provenance, replace_directory, write_json_atomic
from hil.retrieval.backends.configs import FlatIndexConfig, IndexConfig
from hil.retrieval.builder import backend_from, rebuild_search_structures, same_search_structures
from hil.retrieval.encoding import encode_document_tokens, eval_mode
from hil.retrieval.index import (
    DOC_IDS_JSON,
    DOC_OFFSETS_NPY,
    INDEX_FORMAT,
    INDEX_FORMAT_VERSION,
    INDEX_JSON,
    TOKEN_IDS_NPY,
    TokenIndex,
    encoder_fingerprint,
    save_npy_atomic,
    seal_index,
)
from hil.retrieval.integrity import check_finite_vectors
from hil.retrieval.store import TokenStore

logger = logging.getLogger(__name__)

TRANSFORM_MODES = ("token", "sequence")
TRANSFORMS_JSON = "transforms.json"
DEFAULT_MAX_TOKENS = 200_000
DEFAULT_MAX_DOCS = 20_000


def transform_file_name(head: str) -> str:
    return f"transform_{head}.pt"


def _state_bytes(value: Any, digest: "hashlib._Hash") -> None:
    """Feed a transform's ``to_dict()`` state (nested dicts / lists / tensors / numbers) into a hash, in order."""
    if isinstance(value, Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{flat.dtype}{tuple(value.shape)}".encode())
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(f"K{key}".encode())
            _state_bytes(value[key], digest)
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _state_bytes(item, digest)
    else:
        digest.update(f"V{value!r}".encode())


def transform_fingerprint(transform: PostTransform) -> str:
    """SHA-256 (16 hex digits) of a fitted transform's name, settings and every parameter byte."""
    payload = transform.to_dict()
    digest = hashlib.sha256()
    _state_bytes({"name": payload["name"], "settings": payload["settings"], "state": payload["state"]}, digest)
    return digest.hexdigest()[:16]


def unnormalized_transform(transform: PostTransform, x: Tensor) -> Tensor:
    """``transform`` applied to x (..., D) with its *final* L2 normalization left out (to inspect covariances).

    Steps before the last run as they do at evaluation time; the last step's raw map is applied.
    """
    steps = transform.steps if isinstance(transform, TransformPipeline) else [transform]
    if not steps:
        return x
    flat = x.reshape(-1, x.shape[-1])
    for step in steps[:-1]:
        flat = step.transform(flat)
    step = steps[-1]
    step._require_fitted()
    out = step._transform_flat(flat)  # the raw map of the last step: no renormalization
    return out.reshape(*x.shape[:-1], out.shape[-1])


# -- the encoder wrapper ----------------------------------------------------------------------------------------

class TransformedEncoder(Encoder):
    """Any encoder with fitted post-hoc transforms applied to its heads' token vectors (see module docstring).

    Implements every member of the :class:`~hil.modeling.contracts.Encoder` contract itself, by transforming or
    delegating to the wrapped encoder; nothing else is forwarded: what is model-specific (HIL's ``idf``, a
    ``backbone``) is read from ``inner``. Heads without a transform pass through unchanged.

    Args:
        encoder: the base encoder (kept as the submodule ``inner``; its weights enter the fingerprint).
        transforms: head name -> fitted transform (usually a :class:`TransformPipeline`).
        spec: the transform spec string it was fitted from (recorded in ``settings()``).
        mode: ``"token"`` or ``"sequence"`` (how it was fitted; recorded).
        fit_info: anything else worth recording (sample sizes, source index).
    """

    def __init__(self, encoder: Encoder, transforms: Mapping[str, PostTransform], *, spec: str | None = None,
                 mode: str = "token", fit_info: Mapping[str, Any] | None = None):
        super().__init__()
        if not isinstance(encoder, Encoder):
            raise TypeError(f"TransformedEncoder: expected an Encoder (hil.modeling.contracts), got "
                            f"{type(encoder).__name__}")
        if mode not in TRANSFORM_MODES:
            raise ValueError(f"TransformedEncoder: mode must be one of {TRANSFORM_MODES}, got {mode!r}")
        unknown = sorted(set(transforms) - set(encoder.head_names))
        if unknown:
            raise ValueError(f"TransformedEncoder: transforms for unknown head(s) {unknown}; the encoder has heads "
                             f"{list(encoder.head_names)}")
        if not transforms:
            raise ValueError("TransformedEncoder: no transform given (use the encoder itself)")
        dims = {}
        for head in encoder.head_names:
            transform = transforms.get(head)
            if transform is None:
                dims[head] = int(encoder.dim)
                continue
            transform._require_fitted()
            if transform.input_dim != int(encoder.dim):
                raise ValueError(f"TransformedEncoder: the transform of head {head!r} takes {transform.input_dim}-d "
                                 f"vectors, the encoder's heads are {encoder.dim}-d")
            dims[head] = int(transform.output_dim)
        if len(set(dims.values())) != 1:
            raise ValueError(f"TransformedEncoder: heads would get different dimensions {dims}; transform every head "
                             f"to the same size")
        self.inner = encoder
        self.transforms = dict(transforms)  # plain dict: transforms are not parameters of the model
        self.spec = spec if spec is not None else ",".join(
            sorted({getattr(t, "spec", t.name) for t in transforms.values()}))
        self.mode = mode
        self.fit_info = dict(fit_info or {})
        self.dim = next(iter(dims.values()))

    # -- the encoder surface ---------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.inner.architecture

    @property
    def head_names(self) -> tuple[str, ...]:
        return tuple(self.inner.head_names)

    @property
    def tokenizer(self) -> ColBERTTokenizer:
        return self.inner.tokenizer

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def label(self) -> str:
        """A short name for tables: ``<architecture>+<spec>``."""
        return f"{self.architecture}+{self.spec}"

    def transform_batch(self, batch: EncodedBatch) -> EncodedBatch:
        """An encoded batch of the wrapped encoder with each head's transform applied (heads without one unchanged).

        The mask and token ids are kept; positions outside ``batch.mask`` stay 0, as the encoder leaves them.
        """
        heads = {}
        for head, vectors in batch.heads.items():
            transform = self.transforms.get(head)
            heads[head] = vectors if transform is None else transform.transform(vectors, mask=batch.mask.bool())
        return EncodedBatch(heads, batch.mask, batch.input_ids)

    def encode(self, batch: TokenizedBatch, is_query: bool) -> EncodedBatch:
        return self.transform_batch(self.inner.encode(batch, is_query))

    def encode_queries(self, texts: Sequence[str]) -> EncodedBatch:
        return self.transform_batch(self.inner.encode_queries(texts))

    def encode_documents(self, texts: Sequence[str]) -> EncodedBatch:
        return self.transform_batch(self.inner.encode_documents(texts))

    def score(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        return self.inner.score(queries, docs)

    def score_pairs(self, queries: EncodedBatch, docs: EncodedBatch) -> Tensor:
        return self.inner.score_pairs(queries, docs)

    def score_heads(self, queries: EncodedBatch, docs: EncodedBatch, all_pairs: bool = True) -> dict[str, Tensor]:
        return self.inner.score_heads(queries, docs, all_pairs)

    @property
    def normalizes_per_query(self) -> bool:
        return self.inner.normalizes_per_query

    def raw_head_scores(self, queries: EncodedBatch, docs: EncodedBatch) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        return self.inner.raw_head_scores(queries, docs)

    def normalize_per_query(self, sums: dict[str, tuple[Tensor, Tensor, Tensor]]) -> dict[str, Tensor]:
        return self.inner.normalize_per_query(sums)

    def transform_settings(self) -> dict[str, Any]:
        """What ``settings()["post_transform"]`` holds: spec, mode, per-head settings and parameter fingerprints."""
        return {"spec": self.spec, "mode": self.mode,
                "heads": {head: {"settings": t.settings(), "fingerprint": transform_fingerprint(t),
                                 "output_dim": int(t.output_dim), "fit_info": dict(getattr(t, "fit_info", {}))}
                          for head, t in self.transforms.items()},
                "fit": self.fit_info}

    def settings(self) -> dict[str, Any]:
        """The wrapped encoder's settings plus ``post_transform`` (so the index fingerprint changes with it)."""
        return {**self.inner.settings(), "dim": self.dim, "post_transform": self.transform_settings()}

    # -- files -----------------------------------------------------------------------------------------------------
    def save_transforms(self, directory: str | os.PathLike) -> dict[str, Path]:
        """``transform_<head>.pt`` per transformed head and ``transforms.json`` (settings, fingerprints) in a folder."""
        return save_transforms(self.transforms, directory, spec=self.spec, mode=self.mode, fit_info=self.fit_info)

    @classmethod
    def from_directory(cls, encoder: Encoder, directory: str | os.PathLike) -> "TransformedEncoder":
        """Wrap ``encoder`` with the transforms saved in ``directory`` (by :meth:`save_transforms`)."""
        transforms, meta = load_transforms(directory)
        return cls(encoder, transforms, spec=meta.get("spec"), mode=meta.get("mode", "token"),
                   fit_info=meta.get("fit", {}))


def save_transforms(transforms: Mapping[str, PostTransform], directory: str | os.PathLike, *,
                    spec: str | None = None, mode: str = "token",
                    fit_info: Mapping[str, Any] | None = None) -> dict[str, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {head: transform.save(directory / transform_file_name(head)) for head, transform in transforms.items()}
    write_json_atomic(directory / TRANSFORMS_JSON, provenance(
        {"spec": spec, "mode": mode}, spec=spec, mode=mode, fit=dict(fit_info or {}),
        heads={head: {"file": path.name, "fingerprint": transform_fingerprint(transforms[head]),
                      "settings": transforms[head].settings()} for head, path in paths.items()}))
    return paths


def load_transforms(directory: str | os.PathLike) -> tuple[dict[str, PostTransform], dict[str, Any]]:
    """The transforms saved in ``directory`` and the ``transforms.json`` record; fingerprints are checked."""
    directory = Path(directory)
    meta_path = directory / TRANSFORMS_JSON
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory}: no {TRANSFORMS_JSON} (not a folder written by save_transforms)")
    with open(meta_path, encoding="utf-8") as handle:
        meta = json.load(handle)
    transforms = {}
    for head, record in meta.get("heads", {}).items():
        transform = load_transform(directory / record["file"])
        found = transform_fingerprint(transform)
        if found != record.get("fingerprint"):
            raise ValueError(f"{directory / record['file']}: parameters fingerprint {found} does not match "
                             f"{meta_path} (heads.{head}.fingerprint = {record.get('fingerprint')})")
        transforms[head] = transform
    return transforms, meta


# -- fitting ----------------------------------------------------------------------------------------------------

def sample_token_vectors(store: TokenStore, head: str, max_tokens: int = DEFAULT_MAX_TOKENS,
                         seed: int = 0) -> Tensor:
    """Up to ``max_tokens`` stored token vectors of ``head``, drawn uniformly without replacement. -> (N, D) fp32

    Rows are read in ascending order (kind to a memory-mapped index).
    """
    if head not in store.embeddings:
        raise KeyError(f"token store has no head {head!r} (heads: {list(store.head_names)})")
    n = store.n_tokens
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    rows = np.arange(n) if n <= max_tokens else np.sort(
        np.random.default_rng(seed).choice(n, size=max_tokens, replace=False))
    return torch.from_numpy(np.asarray(store.embeddings[head][rows], dtype=np.float32))


def sample_sequence_vectors(store: TokenStore, head: str, max_docs: int = DEFAULT_MAX_DOCS,
                            seed: int = 0) -> Tensor:
    """Mean token vector of up to ``max_docs`` sampled documents (000's sequence-wise statistics). -> (S, D) fp32

    Documents without stored tokens are skipped (they have no mean).
    """
    if head not in store.embeddings:
        raise KeyError(f"token store has no head {head!r} (heads: {list(store.head_names)})")
    docs = np.arange(store.n_docs) if store.n_docs <= max_docs else np.sort(
        np.random.default_rng(seed).choice(store.n_docs, size=max_docs, replace=False))
    docs = docs[store.doc_lengths[docs] > 0]
    array = store.embeddings[head]
    pooled = np.empty((len(docs), array.shape[1]), dtype=np.float32)
    for row, doc in enumerate(docs.tolist()):
        start, end = int(store.doc_offsets[doc]), int(store.doc_offsets[doc + 1])
        pooled[row] = np.asarray(array[start:end], dtype=np.float32).mean(axis=0)
    return torch.from_numpy(pooled)


def encode_sample(encoder: Encoder, texts: Sequence[str], max_docs: int = 2000, seed: int = 0,
                  batch_size: int = 32) -> TokenStore:
    """Encode up to ``max_docs`` sampled documents into an in-memory token store (fitting without an index)."""
    n = len(texts)
    if n == 0:
        raise ValueError("encode_sample: no documents")
    picks = np.arange(n) if n <= max_docs else np.sort(np.random.default_rng(seed).choice(n, max_docs, replace=False))
    with eval_mode(encoder):
        tokens = encode_document_tokens(encoder, [texts[i] for i in picks.tolist()], batch_size=batch_size,
                                        dtype=np.float32)
    return tokens.to_store([str(i) for i in picks.tolist()])


def fit_head_transforms(store: TokenStore, spec: str, *, mode: str = "token", heads: Iterable[str] | None = None,
                        max_tokens: int = DEFAULT_MAX_TOKENS, max_docs: int = DEFAULT_MAX_DOCS, seed: int = 0,
                        renormalize: bool = True) -> dict[str, TransformPipeline]:
    """Fit the pipeline ``spec`` (e.g. ``"whitening"``, ``"whitening:k=64"``, ``"nice"``) on each head's corpus vectors.

    ``mode="token"``: on up to ``max_tokens`` sampled stored token vectors; ``"sequence"``: on the mean vectors of
    up to ``max_docs`` sampled documents. Each pipeline's ``fit_info`` records the mode and the sample size.
    """
    if mode not in TRANSFORM_MODES:
        raise ValueError(f"fit_head_transforms: mode must be one of {TRANSFORM_MODES}, got {mode!r}")
    chosen = list(store.head_names if heads is None else heads)
    fitted = {}
    for head in chosen:
        if mode == "token":
            vectors = sample_token_vectors(store, head, max_tokens=max_tokens, seed=seed)
        else:
            vectors = sample_sequence_vectors(store, head, max_docs=max_docs, seed=seed)
        pipeline = fit_transform_from_config(spec, vectors, mode="token", renormalize=renormalize)
        if not len(pipeline):
            raise ValueError(f"transform spec {spec!r} has no step")
        pipeline.fit_info.update(mode=mode, n_vectors=int(vectors.shape[0]), seed=seed)
        fitted[head] = pipeline
    return fitted


def fit_transformed_encoder(encoder: Encoder, spec: str, *, store: TokenStore | None = None,
                            texts: Sequence[str] | None = None, mode: str = "token",
                            max_tokens: int = DEFAULT_MAX_TOKENS, max_docs: int = DEFAULT_MAX_DOCS,
                            encode_docs: int = 2000, seed: int = 0) -> TransformedEncoder:
    """Fit ``spec`` on ``store`` (an index's stored vectors) or, without one, on ``encode_docs`` sampled ``texts``,
    and wrap ``encoder`` with the result."""
    source: dict[str, Any]
    if store is None:
        if texts is None:
            raise ValueError("fit_transformed_encoder: give a token store (index) or document texts to fit on")
        store = encode_sample(encoder, texts, max_docs=encode_docs, seed=seed)
        source = {"source": "encoded sample", "documents": store.n_docs}
    else:
        source = {"source": str(getattr(store, "directory", "token store")), "documents": store.n_docs,
                  "encoder_fingerprint": getattr(store, "meta", {}).get("encoder_fingerprint")}
    transforms = fit_head_transforms(store, spec, mode=mode, max_tokens=max_tokens, max_docs=max_docs, seed=seed)
    info = {**source, "max_tokens": max_tokens, "max_docs": max_docs, "seed": seed,
            "n_vectors": {head: t.fit_info.get("n_vectors") for head, t in transforms.items()}}
    return TransformedEncoder(encoder, transforms, spec=spec, mode=mode, fit_info=info)


# -- a derived index --------------------------------------------------------------------------------------------

def derive_transformed_index(base: TokenIndex, encoder: TransformedEncoder, directory: str | os.PathLike, *,
                             backend: str | IndexConfig = "flat", block_tokens: int = 1 << 16,
                             overwrite: bool = False, progress: bool = False, faiss_kind: str | None = None,
                             faiss_params: dict[str, Any] | None = None) -> TokenIndex:
    """Write a token index at ``directory`` holding ``base``'s stored vectors passed through ``encoder``'s transforms.

    ``base`` must have been built by ``encoder.inner`` (checked by fingerprint). Documents, offsets and token ids
    are copied; each transformed head is mapped in blocks of ``block_tokens`` (bounded memory) and stored in fp16.
    The folder is written under ``<dir>.tmp-derive`` and renamed when complete, with the transforms saved in it and
    every file recorded in ``index.json`` (:func:`~hil.retrieval.index.seal_index`); under ``<dir>.lock``.
    ``backend``: the search structures' build-time settings (``faiss_kind`` / ``faiss_params``: deprecated).
    """
    directory = Path(directory)
    config = backend_from(backend, faiss_kind, faiss_params)
    with file_lock(lock_path(directory), what=f"deriving {directory.name}"):
        index = _derive(base, encoder, directory, block_tokens, overwrite)
        if config != FlatIndexConfig():
            index = rebuild_search_structures(index, config, progress=progress)
        return index


def _derive(base: TokenIndex, encoder: TransformedEncoder, directory: Path, block_tokens: int,
            overwrite: bool) -> TokenIndex:
    """:func:`derive_transformed_index`'s folder with flat search (the caller holds the lock)."""
    if not isinstance(encoder, TransformedEncoder):
        raise TypeError("derive_transformed_index needs a TransformedEncoder")
    inner_fp = encoder_fingerprint(encoder.inner)
    if base.encoder_fingerprint != inner_fp:
        raise ValueError(f"{base.directory}: built by encoder {base.encoder_fingerprint}, but the transformed "
                         f"encoder wraps {inner_fp}; derive from the base encoder's own index")
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
    missing = [head for head in encoder.head_names if head not in base.embeddings]
    if missing:
        raise ValueError(f"{base.directory}: no stored vectors for head(s) {missing}")
    base.stored_token_ids()  # a base that stores none is refused before any work
    work = directory.with_name(directory.name + ".tmp-derive")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    n_tokens = base.n_tokens
    dims = {}
    for head in encoder.head_names:
        transform = encoder.transforms.get(head)
        source = base.embeddings[head]
        dim = int(source.shape[1]) if transform is None else int(transform.output_dim)
        target = np.lib.format.open_memmap(work / f"{head}.embeddings.npy", mode="w+", dtype=np.float16,
                                           shape=(n_tokens, dim))
        for start in range(0, n_tokens, block_tokens):
            block = torch.from_numpy(np.asarray(source[start: start + block_tokens], dtype=np.float32))  # (b, D)
            if transform is not None:
                block = transform.transform(block)  # stored tokens are all scored: no mask needed
                check_finite_vectors(block.numpy(), f"the {encoder.spec} transform of head {head}'s vectors",
                                     "the fitted transform is unstable (a singular fit?); nothing was derived",
                                     first_row=start)
            target[start: start + block_tokens] = block.numpy().astype(np.float16)
        target.flush()
        del target
        dims[head] = dim
    save_npy_atomic(work / TOKEN_IDS_NPY, np.asarray(base.stored_token_ids()))
    save_npy_atomic(work / DOC_OFFSETS_NPY, np.asarray(base.doc_offsets))
    write_json_atomic(work / DOC_IDS_JSON, list(base.doc_ids))
    encoder.save_transforms(work)
    settings = json.loads(json.dumps(encoder.settings(), default=str))
    meta = provenance(settings, format=INDEX_FORMAT, format_version=INDEX_FORMAT_VERSION, n_docs=base.n_docs,
                      n_tokens=n_tokens, heads=list(encoder.head_names), dims=dims,
                      dim=next(iter(dims.values())) if len(set(dims.values())) == 1 else None,
                      embedding_dtype="float16",
                      backend={"kind": "flat", "params": {}, "factory": "Flat", "metric": "inner_product",
                               "stored": False},
                      corpus_fingerprint=base.corpus_fingerprint, encoder_fingerprint=encoder_fingerprint(encoder),
                      derived_from={"directory": str(base.directory), "encoder_fingerprint": base.encoder_fingerprint,
                                    "transform": encoder.spec, "mode": encoder.mode,
                                    "transform_files": {h: transform_file_name(h) for h in encoder.transforms}})
    seal_index(work, meta)
    replace_directory(work, directory)
    return TokenIndex.load(directory, verify="sizes")  # checksums just computed from these files


def open_or_derive_index(base: TokenIndex, encoder: TransformedEncoder, directory: str | os.PathLike, *,
                         backend: str | IndexConfig = "flat", progress: bool = False, verify: str = "auto",
                         faiss_kind: str | None = None, faiss_params: dict[str, Any] | None = None) -> TokenIndex:
    """Reuse the derived index at ``directory`` when its fingerprints match ``encoder`` and ``base`` and its files
    are intact (checked as ``verify`` says: :meth:`TokenIndex.load`); else derive it (a damaged one, or one written
    before indexes recorded their files, with a warning). Under ``<dir>.lock``: a second process waits."""
    directory = Path(directory)
    config = backend_from(backend, faiss_kind, faiss_params)
    with file_lock(lock_path(directory), what=f"deriving {directory.name}"):
        if (directory / INDEX_JSON).is_file():
            try:
                index = TokenIndex.load(directory, expect_corpus_fingerprint=base.corpus_fingerprint,
                                        expect_encoder_fingerprint=encoder_fingerprint(encoder), verify=verify)
            except ValueError as error:  # another base or encoder, or damaged files (IndexIntegrityError)
                logger.warning("%s; deriving it again", error)
            else:
                if index.verified == "none":
                    logger.warning("%s: deriving it again so that it records its files", directory)
                elif same_search_structures(index, config):
                    return index
                else:
                    return rebuild_search_structures(index, config, progress=progress)
        return derive_transformed_index(base, encoder, directory, backend=config, overwrite=True, progress=progress)
