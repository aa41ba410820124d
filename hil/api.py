"""The Python API, for notebooks and scripts; every name is re-exported from ``hil``.

    >>> import hil                                                         # doctest: +SKIP
    >>> model = hil.load_model("colbert-ir/colbertv2.0")                   # export, .ckpt, Stanford, PyLate, backbone
    >>> queries = hil.encode_queries(model, ["what is isotropy?"], batch_size=32, device="cpu")
    >>> documents = hil.encode_documents(model, texts, batch_size=64, progress=True)
    >>> index = hil.build_index(model, corpus, "indexes/scifact")          # {doc_id: text}; reopened when it matches
    >>> run = hil.search(model, index, {"q1": "what is isotropy?"}, k=10)  # {qid: {doc_id: score}}
    >>> metrics = hil.evaluate_run(run, qrels, metrics=("ndcg@10", "recall@100"))

``tests/test_api.py`` runs the same steps on the shared tiny model. Encoding returns, per text, the embeddings of
the tokens that take part in late interaction (``(tokens, dim)`` float32 tensors on the CPU); a model with several
heads (ColBERT-HIL: ``L`` and ``H``) returns one such tensor per head, as a dictionary, unless ``head`` names one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from hil.data.beir import BeirDataset, load_beir
from hil.errors import UserError
from hil.evaluation.metrics import DEFAULT_METRICS
from hil.evaluation.metrics import evaluate_run as _evaluate_run
from hil.modeling.contracts import Encoder
from hil.modeling.export import export_model
from hil.modeling.hub import push_to_hub, write_model_card
from hil.modeling.loading import load_encoder
from hil.retrieval.builder import open_or_build_index
from hil.retrieval.devices import resolve_device
from hil.retrieval.encoding import eval_mode
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.index import TokenIndex

Embeddings = list[Tensor] | list[dict[str, Tensor]]
__all__ = ["load_model", "encode_queries", "encode_documents", "score", "build_index", "open_index", "search",
           "evaluate_run", "load_dataset", "export_model", "push_to_hub", "write_model_card"]


def load_model(source: str | Path | Sequence[str | Path], device: str = "auto", **settings: Any) -> Encoder:
    """A model in eval mode on ``device`` ("auto": the GPU when there is one) from any layout
    (``hil.modeling.loading.load_encoder``: our export, a ``.ckpt``, Stanford ColBERT, PyLate, a backbone)."""
    return load_encoder(source, **settings).to(resolve_device(device))


def _check_batch(texts: Sequence[str], batch_size: int) -> None:
    if isinstance(texts, str):
        raise UserError("texts: give a list of strings, not one string")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be a positive integer, got {batch_size!r}")


def _encode(model: Encoder, texts: Sequence[str], is_query: bool, batch_size: int, device: str | None,
            progress: bool, head: str | None) -> Embeddings:
    _check_batch(texts, batch_size)
    if head is not None and head not in model.head_names:
        raise UserError(f"head {head!r}: this model's heads are {list(model.head_names)}")
    if device is not None:
        model.to(resolve_device(device))
    from tqdm.auto import tqdm

    rows: list[dict[str, Tensor]] = []
    starts = range(0, len(texts), batch_size)
    with eval_mode(model), torch.inference_mode():
        for start in tqdm(starts, desc="queries" if is_query else "documents", disable=not progress,
                          unit="batch"):
            batch = list(texts[start:start + batch_size])
            encoded = model.encode_queries(batch) if is_query else model.encode_documents(batch)
            mask = encoded.mask.cpu()
            heads = {name: value.float().cpu() for name, value in encoded.heads.items()}
            rows += [{name: value[i][mask[i]] for name, value in heads.items()} for i in range(len(batch))]
    if head is not None:
        return [row[head] for row in rows]
    if len(model.head_names) == 1:
        return [row[model.head_names[0]] for row in rows]
    return rows


def encode_queries(model: Encoder, texts: Sequence[str], *, batch_size: int = 32, device: str | None = None,
                   progress: bool = False, head: str | None = None) -> Embeddings:
    """Query embeddings, one ``(tokens, dim)`` tensor per text (``[MASK]`` expansion included), in batches of
    ``batch_size`` on ``device`` (None: where the model is), with a progress bar when ``progress``."""
    return _encode(model, texts, True, batch_size, device, progress, head)


def encode_documents(model: Encoder, texts: Sequence[str], *, batch_size: int = 32, device: str | None = None,
                     progress: bool = False, head: str | None = None) -> Embeddings:
    """Document embeddings, one ``(tokens, dim)`` tensor per text (punctuation and padding dropped)."""
    return _encode(model, texts, False, batch_size, device, progress, head)


def score(model: Encoder, queries: Sequence[str], documents: Sequence[str]) -> Tensor:
    """The model's relevance score of every query against every document: ``(len(queries), len(documents))``."""
    _check_batch(queries, 1)
    _check_batch(documents, 1)
    with eval_mode(model), torch.inference_mode():
        return model.score(model.encode_queries(list(queries)), model.encode_documents(list(documents))).float().cpu()


def _corpus_items(corpus: Mapping[str, str] | BeirDataset) -> tuple[list[str], list[str]]:
    if isinstance(corpus, BeirDataset):
        return corpus.doc_ids(), corpus.documents()
    if not isinstance(corpus, Mapping):
        raise UserError(f"corpus: give a {{doc_id: text}} mapping or a dataset, got {type(corpus).__name__}")
    return [str(doc_id) for doc_id in corpus], [str(text) for text in corpus.values()]


def build_index(model: Encoder, corpus: Mapping[str, str] | BeirDataset, directory: str | Path,
                **settings: Any) -> TokenIndex:
    """The index of ``corpus`` under ``model`` in ``directory``: opened when it already holds this corpus and
    model (and is intact), built otherwise. ``settings``: ``hil.retrieval.builder.build_index``'s (``backend``,
    ``batch_size``, ``quantize``, ``progress``...)."""
    doc_ids, texts = _corpus_items(corpus)
    return open_or_build_index(model, doc_ids, texts, Path(directory), **settings)


def open_index(directory: str | Path, verify: str = "auto") -> TokenIndex:
    """A finished index folder, its files checked against what it recorded: sizes always, checksums with
    ``verify="full"`` or, by default ("auto"), when the index is small enough for that to be cheap."""
    return TokenIndex.load(Path(directory), verify=verify)


def search(model: Encoder, index: TokenIndex, queries: Mapping[str, str], *, k: int = 10,
           **settings: Any) -> dict[str, dict[str, float]]:
    """Full ranking: each query's ``k`` best documents of the index, ``{qid: {doc_id: score}}`` (settings:
    ``hil.retrieval.full_ranking.full_rank``'s ``ncandidates``, ``batch_size``, ``progress``...)."""
    settings.setdefault("progress", False)
    return full_rank(model, index, dict(queries), k=k, **settings).run


def evaluate_run(run: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]], *,
                 metrics: Sequence[str] = DEFAULT_METRICS, relevance_level: int = 1) -> dict[str, float]:
    """The mean of each metric over the judged queries (pytrec_eval; ``"ndcg@10"``, ``"recall@100"``, ...)."""
    aggregate, _ = _evaluate_run(qrels, run, metrics=metrics, relevance_level=relevance_level)
    return aggregate


def load_dataset(name_or_path: str | Path, split: str | None = None, **settings: Any) -> BeirDataset:
    """A BEIR dataset by name (under ``HIL_DATA_DIR``, else the hub) or folder (``hil.data.beir.load_beir``); no
    ``split``: the dataset's own (``hil.data.beir.default_split``: ``dev`` for MS MARCO, as BEIR reports it)."""
    return load_beir(str(name_or_path), split=split, **settings)
