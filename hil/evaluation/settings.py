"""How a model is evaluated, as settings (:class:`EvaluationSettings`, recorded with every result), apart from the
machinery that evaluates (:mod:`hil.evaluation.evaluate`, which re-exports them): building a parser of them, and a
command's ``--help``, import neither torch nor the models."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from hil.errors import UserError
from hil.evaluation.metrics import DEFAULT_METRICS, canonical_metrics
from hil.retrieval.backends.configs import (
    IndexConfig,
    SearchConfig,
    check_search,
    configs_from_params,
    index_config,
    with_search_values,
)
from hil.retrieval.choices import PRECISIONS, QUERY_ENCODINGS, check_verify

MODES = ("full", "rerank", "exhaustive")  # hil.evaluation.evaluate's docstring says what each does


# The sizes EvaluationSettings leaves None, by device: a CPU's (the values measured in bench/README.md), and an
# accelerator's, where the encoder and the batched search need large batches and tokenization must run ahead.
DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"batch_size": 32, "query_batch_size": 64, "tokenizer_workers": 0},
    "accelerator": {"batch_size": 128, "query_batch_size": 1024, "tokenizer_workers": 2}}


@dataclass(frozen=True)
class EvaluationSettings:
    """How a model is evaluated (recorded with its results).

    Args:
        mode: ``full``, ``rerank`` or ``exhaustive`` (see the module docstring).
        k: documents ranked per query.
        metrics: what pytrec_eval measures.
        drop_self_matches: BEIR's rule for sets whose queries are also corpus documents: the document whose id is
            the query's is skipped before the top-k cut (k other documents are ranked, as BEIR retrieves k + 1 and
            skips it), by every search and by BM25; metrics drop it too.
        index_root: where indexes live (``<root>/<dataset>-<fp>/<encoder fp>``); None encodes in memory.
        backend: the index's search back-end: a registered kind with its defaults (``flat``, ``ivfflat``,
            ``ivfpq``, ``plaid``, ``muvera``, or one defined outside the package:
            :data:`~hil.retrieval.backends.configs.REGISTRY`) or its build-time settings (an
            :class:`~hil.retrieval.backends.configs.IndexConfig`); after construction always the latter. A reused
            index is compared on these only.
        search: the back-end's search-time settings (a :class:`~hil.retrieval.backends.configs.SearchConfig`;
            None: its defaults, :attr:`resolved_search`), applied at every search; the results record the values
            the back-end used.
        backend_params, ncandidates: the untyped spelling before 0.2 (deprecated): a dict split into build-time
            and search-time settings, and the token neighbours per query token; folded into ``backend`` and
            ``search`` at construction (then None).
        rerank_depth: candidates per query kept from a first stage (``first_stage``).
        batch_size, query_batch_size: documents / queries per encoding batch; full ranking also searches each batch
            of queries together. None: by device (:data:`DEVICE_DEFAULTS`: 32 / 64 on a CPU, 128 / 1024 on a GPU,
            where small batches leave it waiting).
        batched_search: full ranking searches a batch of queries at once (candidates, exact scores and the top k on
            the device; :mod:`hil.retrieval.full_ranking`); False: one query at a time (the same rankings, for
            latency measurements). Not part of a result's identity: it changes the speed, not the numbers.
        document_encoding: encode the corpus through a cheaper encoder (``"onnx-int8"``, ...; queries keep the
            model), in an index folder of its own.
        query_encoding: full ranking on a CPU: encode the queries through ONNX Runtime (``"onnx"``: fused fp32,
            the same vectors to float rounding; :func:`hil.retrieval.onnx_encode.onnx_query_encoder`), for search
            latency. None: the model itself.
        keep_candidate_sources: record which heads retrieved every first-stage candidate (full mode).
        keep_head_scores: exhaustive mode: keep each head's dense (queries, documents) score matrix.
        progress: progress bars.
        device: where the encoder runs (``auto``: the GPU when there is one; ``cpu``, ``cuda``, ``cuda:N``;
            :func:`hil.retrieval.devices.resolve_device`); ``evaluate`` moves the encoder there. FAISS searches on
            that GPU where faiss-gpu sees it (``faiss_gpu=None``), else on the CPU.
        precision: the corpus encoding's autocast (``fp32``, ``fp16`` on a GPU, ``bf16``); queries stay fp32.
            Recorded in the index, which is rebuilt when it differs.
        processes: processes that encode the corpus (one per GPU, or CPU processes), through Lightning Fabric;
            the index is the same as a one-process build's.
        tokenizer_workers: DataLoader workers that tokenize the corpus's chunks ahead of the encoder (0: in the
            encoding process); the index is the same whatever the number. None: by device (0 on a CPU, whose cores
            encode; 2 on a GPU, which would otherwise wait for the tokenizer).
        faiss_gpu: FAISS on the GPU (True), on the CPU (False), or on the encoder's GPU where faiss-gpu sees
            it (None).
        verify_index: how much of a reused index is checked against the sizes and checksums it recorded:
            ``auto`` (checksums up to 1 GiB of files, sizes above), ``sizes`` or ``full``
            (:mod:`hil.retrieval.integrity`); a damaged index is rebuilt, with a warning.
    """

    mode: str = "full"
    k: int = 1000
    metrics: tuple[str, ...] = tuple(DEFAULT_METRICS)
    drop_self_matches: bool = True
    index_root: str | Path | None = "indexes"
    backend: str | IndexConfig = "flat"
    search: SearchConfig | None = None
    backend_params: Mapping[str, Any] | None = None
    ncandidates: int | None = None
    rerank_depth: int = 100
    batch_size: int | None = None
    query_batch_size: int | None = None
    batched_search: bool = True
    document_encoding: str | None = None
    query_encoding: str | None = None
    keep_candidate_sources: bool = False
    keep_head_scores: bool = False
    progress: bool = True
    device: str = "auto"
    precision: str = "fp32"
    processes: int = 1
    tokenizer_workers: int | None = None
    faiss_gpu: bool | None = None
    verify_index: str = "auto"

    def __post_init__(self) -> None:
        check_verify(self.verify_index)
        if self.precision not in PRECISIONS:
            raise UserError(f"precision must be one of {PRECISIONS} (got {self.precision!r})")
        if self.mode not in MODES:
            raise UserError(f"mode must be one of {MODES} (got {self.mode!r})")
        if self.mode == "full" and self.index_root is None:
            raise UserError("full ranking searches an index: give index_root")
        if self.keep_head_scores and self.mode != "exhaustive":
            raise UserError("keep_head_scores needs mode='exhaustive' (dense score matrices)")
        if self.query_encoding is not None:
            if self.query_encoding not in QUERY_ENCODINGS:
                raise UserError(f"query_encoding must be one of {QUERY_ENCODINGS} "
                                f"or None (got {self.query_encoding!r})")
            if self.mode != "full":
                raise UserError("query_encoding is a full-ranking (search latency) setting; mode is "
                                f"{self.mode!r}")
        if self.tokenizer_workers is not None and self.tokenizer_workers < 0:
            raise UserError(f"tokenizer_workers must be >= 0 (got {self.tokenizer_workers})")
        for name in ("k", "rerank_depth", "batch_size", "query_batch_size", "processes", "ncandidates"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name} must be >= 1 (got {value})")
        # checked before any work; one spelling in every result
        object.__setattr__(self, "metrics", canonical_metrics(self.metrics, "metrics"))
        self._fold_backend_settings()

    def for_device(self, device_type: str) -> "EvaluationSettings":
        """These settings with the sizes left None set for a device of ``device_type`` (``torch.device.type``:
        ``cpu``, ``cuda``, ...; :data:`DEVICE_DEFAULTS`): what runs, and what the results record."""
        defaults = DEVICE_DEFAULTS["cpu" if device_type == "cpu" else "accelerator"]
        return replace(self, **{name: value for name, value in defaults.items() if getattr(self, name) is None})

    def _fold_backend_settings(self) -> None:
        """``backend`` as an IndexConfig and ``search`` as the matching SearchConfig, the deprecated
        ``backend_params`` / ``ncandidates`` folded into them (frozen: set once, here); ``search`` stays None when
        none was given (:attr:`resolved_search` is what a search applies)."""
        backend, search = index_config(self.backend), self.search
        if self.backend_params is not None or self.ncandidates is not None:
            warnings.warn("EvaluationSettings(backend_params=..., ncandidates=...) is deprecated: pass "
                          "backend=<IndexConfig> and search=<SearchConfig> (hil.retrieval.backends.configs)",
                          DeprecationWarning, stacklevel=4)
        if self.backend_params:
            if backend.given() != type(backend)().given():
                raise UserError("give build-time settings either as backend=<IndexConfig> or in backend_params, "
                                "not both")
            backend, from_params = configs_from_params(backend.kind, self.backend_params)
            search = with_search_values(backend.kind, search, from_params.given()) if search is not None \
                else from_params
        if self.ncandidates is not None:
            search = with_search_values(backend.kind, search, {"ncandidates": self.ncandidates})
        if search is not None:
            check_search(backend.kind, search)  # settings of another back-end are refused here
        for name, value in (("backend", backend), ("search", search), ("backend_params", None),
                            ("ncandidates", None)):
            object.__setattr__(self, name, value)

    @property
    def resolved_search(self) -> SearchConfig:
        """The search-time settings applied: ``search``, or the back-end's defaults when it is None (kept None in
        the settings so that a default is never recorded or compared as a request), with the defaults that depend
        on the ranking depth (PLAID's) taken for ``k``: what is recorded and compared is what a search applies."""
        return check_search(self.backend.kind, self.search).for_depth(self.k)


def run_name(text: str) -> str:
    """``text`` made safe as a run name (a TREC tag and a file name): runs of other characters become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "_", text).strip("_") or "run"
