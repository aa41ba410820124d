"""An index's search structures: the files a back-end writes beside the vectors, and rewriting them in place.

:func:`write_search_files` is the last stage of a build from fp16 vectors (:mod:`hil.retrieval.builder`);
:func:`rebuild_search_structures` replaces the structures of a finished index (the vectors stay), as
:func:`~hil.retrieval.builder.open_or_build_index` does when only the back-end's build-time settings changed.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch

from hil.errors import UserError
from hil.provenance import StageClock, file_lock, lock_path
from hil.retrieval.backends.configs import IndexConfig, PlaidIndexConfig, configs_from_params, index_config
from hil.retrieval.backends.registry import backend_class, backend_classes
from hil.retrieval.codec import CompressedEmbeddings
from hil.retrieval.index import TokenIndex, plaid_paths, seal_index
from hil.retrieval.progress import progress_bar
from hil.retrieval.store import TokenTable

# -- search structures ------------------------------------------------------------------------------------------

def backend_from(backend: str | IndexConfig = "flat", faiss_kind: str | None = None,
                 faiss_params: dict[str, Any] | None = None) -> IndexConfig:
    """The build-time settings asked for: ``backend`` (a config, or a kind with its defaults), or, in the spelling
    before 0.2, ``faiss_kind`` and ``faiss_params`` (with a deprecation notice). Search-time keys in
    ``faiss_params`` (``nprobe``, ``ndocs``, ...) are refused: an index no longer holds them, so a search would not
    use them; give them to the search."""
    if faiss_kind is None and faiss_params is None:
        return index_config(backend)
    warnings.warn("faiss_kind / faiss_params are deprecated: pass backend=<kind or IndexConfig> "
                  "(hil.retrieval.backends.configs)", DeprecationWarning, stacklevel=3)
    kind = faiss_kind or (backend.kind if isinstance(backend, IndexConfig) else backend)
    build, search = configs_from_params(kind, faiss_params)
    misplaced = sorted(set(faiss_params or {}) - type(build).field_names())
    if misplaced:
        raise UserError(f"{misplaced} are search-time settings, not part of an index: give them to the search "
                        f"({type(search).__name__}), not to the index build")
    return build


def _remove_stale_files(directory: Path, head: str, kept: set[Path]) -> None:
    """Remove the files every other kind may have left for ``head`` (an earlier build of another kind)."""
    for backend in backend_classes():
        for path in backend.head_files(directory, head):
            if path not in kept:
                path.unlink(missing_ok=True)


def write_search_files(directory: Path, embeddings: dict[str, TokenTable], config: IndexConfig, use_gpu: bool,
                       progress: bool, gpu_device: int = 0, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Write the files of ``config``'s back-end for every head; -> the ``"backend"`` part of ``index.json``.

    ``device``: where the build's torch work may run (the encoder's device: PLAID's k-means there on a GPU); the
    choices that depend on it are recorded as made (:meth:`SearchBackend.resolve_machine_params`). Files of another
    kind left from an earlier build are removed, except, for a head stored compressed only, the centroid files:
    they hold its vectors.
    """
    kind = config.kind
    backend = backend_class(kind)
    device = torch.device(device)
    resolved: dict[str, Any] = {}
    codecs: dict[str, Any] = {}
    # k-means and the codes take tens of seconds even on SciFact: a line when they start, and one per head done.
    bar = progress_bar(len(embeddings), f"{kind} structures (k-means, codes, inverted file)", "head",
                       enabled=progress and backend.stores_files, every_s=0.0)
    for head, vectors in embeddings.items():
        resolved = backend.resolve_machine_params(backend.resolve_params(config, vectors.shape[0], vectors.shape[1]),
                                                  device=device, use_gpu=use_gpu, gpu_device=gpu_device)
        started = time.perf_counter()
        codec = backend.build_head(directory, head, vectors, resolved, use_gpu=use_gpu, gpu_device=gpu_device,
                                   device=device)
        kept = set(backend.head_files(directory, head))
        if isinstance(vectors, CompressedEmbeddings):
            codec = vectors.codec
            kept |= set(plaid_paths(directory, head).values())
        if codec is not None:
            codecs[head] = codec.settings()
        _remove_stale_files(directory, head, kept)
        bar.set_postfix_str(f"{head}: {time.perf_counter() - started:.1f} s", refresh=False)
        bar.update(1)
    bar.close()
    settings = {"kind": kind, "params": resolved, "factory": backend.factory(resolved),
                "metric": "inner_product", "stored": backend.stores_files}
    if codecs:
        settings["codecs"] = codecs
    return settings


def rebuild_search_structures(index: TokenIndex, backend: str | IndexConfig, *, use_gpu: bool = False,
                              progress: bool = True, gpu_device: int = 0,
                              device: torch.device | str = "cpu") -> TokenIndex:
    """Replace the search structures of a finished index (the vectors stay), updating ``index.json`` and its file
    records; ``device`` as :func:`write_search_files`'s. In place, under the index's lock: a process killed meanwhile
    leaves files that disagree with ``index.json``, which the next open reports (and :func:`open_or_build_index`
    rebuilds)."""
    with file_lock(lock_path(index.directory), what="rebuilding its search structures"):
        seconds = StageClock()
        config, choice = index_config(backend), None
        if isinstance(config, PlaidIndexConfig) and config.storage_left_to_corpus:  # this corpus's size, known
            config, choice = config.sized(index.n_tokens, 2 * sum(index.dims.values()))
        settings = write_search_files(index.directory, index.embeddings, config, use_gpu, progress,
                                      gpu_device, device)
        seconds.stage("search_structures")
        meta = {key: value for key, value in index.meta.items() if key not in ("faiss", "storage_choice")}
        if choice is not None:
            meta["storage_choice"] = dict(choice, tokens_per_doc="counted")
        # The encoding's and join's seconds belong to the earlier build: only what this one did is recorded.
        seal_index(index.directory, dict(meta, backend=settings, build_seconds=seconds.stages))
        # The checksums were just computed from these very files: the sizes say they are the ones recorded.
        return TokenIndex.load(index.directory, mmap=index.memory_mapped, verify="sizes")


def rebuild_faiss(index: TokenIndex, faiss_kind: str, faiss_params: dict[str, Any] | None = None,
                  **kwargs: Any) -> TokenIndex:
    """:func:`rebuild_search_structures` in the spelling before 0.2 (deprecated)."""
    return rebuild_search_structures(index, backend_from(faiss_kind=faiss_kind, faiss_params=faiss_params or {}),
                                     **kwargs)
