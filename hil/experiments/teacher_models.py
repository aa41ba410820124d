"""The teachers of ``hil teacher``: what scores each (query, candidate document) pair.

- ``colbert``: any model ``hil`` loads (:func:`hil.modeling.loading.load_encoder`: our exports and checkpoints,
  Stanford ColBERT and PyLate folders), scored with ``encoder.score`` through
  :func:`hil.retrieval.search.rerank` (the candidates' texts encoded on the fly in fp32, groups of queries at a
  time: bounded memory).
- ``cross-encoder``: a Hugging Face ``AutoModelForSequenceClassification`` with its tokenizer, on (query,
  document) pairs in batches (of pairs of similar length: little padding), eval mode, no gradients; the score is
  the logit (one label) or the log-odds of label 1
  against label 0 (two labels). Pairs are truncated longest-first to ``max_length`` tokens (sentence-transformers'
  ``CrossEncoder`` does the same).
- ``dense``: a Hugging Face encoder (``AutoModel``) as a bi-encoder: mean of the last hidden states over the
  attention mask, L2-normalised, cosine similarity (the pooling of sentence-transformers' ``all-MiniLM-L6-v2``).
  Each distinct passage is encoded once for the whole run, however many queries mined it (SciFact's 809 training
  queries at depth 100 share 5,154 passages among 80,900 candidates): the vectors are kept between groups of
  queries, up to ``_CACHE_BYTES``, the least recently used dropped beyond.

Each returns, for every query, the scores of its candidates in the order given, and moves a progress bar in the
unit that costs (``unit``: queries, pairs, passages), batch by batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hil.errors import UserError
from hil.modeling.contracts import Encoder
from hil.modeling.formats import model_layout
from hil.modeling.hub import local_model_dir
from hil.modeling.loading import load_encoder
from hil.retrieval.search import rerank

Candidates = dict[str, list[str]]
Advance = Callable[[int], object]  # moves the progress bar by that many units of work done
# Queries scored together: a cross-encoder's pairs and a dense teacher's new vectors held at once (bounded memory).
_QUERY_CHUNK = 256
_RERANK_CHUNK = 64  # queries per call of rerank (a ColBERT teacher): the progress bar's step
# A dense teacher's passage vectors kept for the run: 1 GiB is 700,000 passages of MiniLM (384 floats).
_CACHE_BYTES = 1 << 30
SENTENCE_BERT_CONFIG = "sentence_bert_config.json"  # sentence-transformers' own settings file of a model folder


def _no_progress(done: int) -> None:
    """The ``advance`` of a call without a progress bar."""


class Teacher(Protocol):
    kind: str
    unit: str  # what the progress bar counts: the teacher's unit of work

    def work(self, candidates: Candidates, texts: dict[str, str]) -> int:
        """How many ``unit`` scoring ``candidates`` costs: the progress bar's total."""

    def score(self, queries: dict[str, str], candidates: Candidates, texts: dict[str, str],
              advance: Advance = _no_progress) -> dict[str, list[float]]:
        """For each query, the score of each of its candidates, in the order of ``candidates[qid]``;
        ``advance(n)`` after each ``n`` units done."""

    def record(self) -> dict[str, object]:
        """What the teacher was (for the sidecar)."""


def by_length(lengths: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Row indices in batches of ``batch_size``, by length (characters): little padding per batch."""
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    return [order[start: start + batch_size] for start in range(0, len(order), batch_size)]


def teacher_kind(source: str, kind: str) -> str:
    """``kind``, or for ``auto`` the kind ``source`` is: a model ``hil`` loads (export, checkpoint, Stanford or
    PyLate folder) is ``colbert``; a Hugging Face folder whose architecture is ``*ForSequenceClassification`` a
    ``cross-encoder``; a sentence-transformers folder ``dense``; a bare backbone is refused (its ColBERT head would
    be untrained, and nothing says how to pool it)."""
    if kind != "auto":
        return kind
    path = Path(source).expanduser()
    if path.is_file():
        return "colbert"  # a Lightning checkpoint (load_encoder refuses anything else)
    directory = local_model_dir(source)
    layout = model_layout(directory)
    if layout in ("hil", "stanford", "pylate"):
        return "colbert"
    if layout == "sentence-transformers":
        return "dense"
    architectures = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return "cross-encoder"
    raise UserError(f"`teacher` {source}: a bare backbone ({', '.join(architectures) or 'no architecture'}); say "
                    f"what it is with `teacher_kind` dense or cross-encoder (colbert would add an untrained head)")


class ColBERTTeacher:
    """A ``hil`` encoder's ``score`` (module docstring)."""

    kind, unit = "colbert", "queries"

    def __init__(self, source: str, device: torch.device, batch_size: int, progress: bool):
        self.source, self.batch_size, self.progress = source, batch_size, progress
        self.encoder: Encoder = load_encoder(source)
        self.encoder.to(device)

    def work(self, candidates: Candidates, texts: dict[str, str]) -> int:
        return len(candidates)

    def score(self, queries: dict[str, str], candidates: Candidates, texts: dict[str, str],
              advance: Advance = _no_progress) -> dict[str, list[float]]:
        depth = max((len(docs) for docs in candidates.values()), default=1)
        qids, out = list(queries), {}
        for start in range(0, len(qids), _RERANK_CHUNK):
            chunk = qids[start: start + _RERANK_CHUNK]
            with torch.inference_mode():
                run = rerank(self.encoder, None, {qid: queries[qid] for qid in chunk},
                             {qid: candidates[qid] for qid in chunk}, texts, k=depth, batch_size=self.batch_size,
                             doc_batch_size=self.batch_size, progress=self.progress).run
            out.update({qid: [run[qid][pid] for pid in candidates[qid]] for qid in chunk})
            advance(len(chunk))
        return out

    def record(self) -> dict[str, object]:
        from hil.retrieval.index import encoder_fingerprint

        return {"kind": self.kind, "source": self.source, "architecture": self.encoder.architecture,
                "settings": self.encoder.settings(), "fingerprint": encoder_fingerprint(self.encoder)}


def _hugging_face(source: str, what: str):
    """(folder, tokenizer) of a Hugging Face model; a :class:`UserError` naming it when it cannot be read."""
    from transformers import AutoTokenizer

    directory = local_model_dir(source)
    try:
        return directory, AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as error:
        raise UserError(f"`teacher` {source}: cannot load its tokenizer as a {what} ({error})") from None


def _max_length(tokenizer, max_length: int | None, directory: Path | None = None) -> int:
    """The tokens a text is cut to: ``max_length`` when given; else the model's own sentence-transformers setting
    (``sentence_bert_config.json``'s ``max_seq_length``: 256 for all-MiniLM-L6-v2 on the hub, what
    sentence-transformers encodes it with), else 512; never above the tokenizer's limit."""
    if max_length is None and directory is not None:
        config = Path(directory) / SENTENCE_BERT_CONFIG
        try:
            max_length = int(json.loads(config.read_text())["max_seq_length"]) if config.is_file() else None
        except (ValueError, KeyError, TypeError) as error:
            raise UserError(f"{config}: no integer max_seq_length ({error})") from None
    limit = getattr(tokenizer, "model_max_length", None) or 512
    return min(max_length or 512, limit if limit < 1_000_000 else 512)


class CrossEncoderTeacher:
    """A Hugging Face sequence classifier on (query, document) pairs (module docstring)."""

    kind, unit = "cross-encoder", "pairs"

    def __init__(self, source: str, device: torch.device, batch_size: int, max_length: int | None):
        from transformers import AutoModelForSequenceClassification

        self.source, self.device, self.batch_size = source, device, batch_size
        directory, self.tokenizer = _hugging_face(source, "cross-encoder")
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(str(directory)).to(device).eval()
        except (OSError, ValueError) as error:
            raise UserError(f"`teacher` {source}: not a sequence classifier ({error})") from None
        self.labels = int(self.model.config.num_labels)
        if self.labels not in (1, 2):
            raise UserError(f"`teacher` {source}: {self.labels} labels; a cross-encoder teacher has 1 (a relevance "
                            f"logit) or 2 (not relevant, relevant)")
        self.max_length = _max_length(self.tokenizer, max_length, directory)

    def pair_scores(self, queries: Sequence[str], documents: Sequence[str],
                    advance: Advance = _no_progress) -> np.ndarray:
        """The score of each (queries[i], documents[i]), in batches of pairs of similar length. -> (n,) float32"""
        out = np.empty(len(queries), dtype=np.float32)
        with torch.inference_mode():
            for batch_rows in by_length([len(q) + len(d) for q, d in zip(queries, documents)], self.batch_size):
                batch = self.tokenizer([queries[i] for i in batch_rows], [documents[i] for i in batch_rows],
                                       padding=True, truncation=True, max_length=self.max_length,
                                       return_tensors="pt")
                logits = self.model(**batch.to(self.device)).logits.float()
                scores = logits[:, 0] if self.labels == 1 else logits[:, 1] - logits[:, 0]
                out[batch_rows] = scores.cpu().numpy()
                advance(len(batch_rows))
        return out

    def work(self, candidates: Candidates, texts: dict[str, str]) -> int:
        return sum(len(docs) for docs in candidates.values())

    def score(self, queries: dict[str, str], candidates: Candidates, texts: dict[str, str],
              advance: Advance = _no_progress) -> dict[str, list[float]]:
        qids, out = list(queries), {}
        for start in range(0, len(qids), _QUERY_CHUNK):
            chunk = qids[start: start + _QUERY_CHUNK]
            pairs = [(qid, pid) for qid in chunk for pid in candidates[qid]]
            scores = self.pair_scores([queries[q] for q, _ in pairs], [texts[p] for _, p in pairs], advance).tolist()
            out.update({qid: [] for qid in chunk})
            for (qid, _), value in zip(pairs, scores):
                out[qid].append(value)
        return out

    def record(self) -> dict[str, object]:
        return {"kind": self.kind, "source": self.source, "num_labels": self.labels, "max_length": self.max_length,
                "architecture": type(self.model).__name__}


class DenseTeacher:
    """A Hugging Face encoder as a mean-pooled cosine bi-encoder (module docstring)."""

    kind, unit = "dense", "passages"

    def __init__(self, source: str, device: torch.device, batch_size: int, max_length: int | None):
        from transformers import AutoModel

        self.source, self.device, self.batch_size = source, device, batch_size
        directory, self.tokenizer = _hugging_face(source, "dense encoder")
        try:
            self.model = AutoModel.from_pretrained(str(directory)).to(device).eval()
        except (OSError, ValueError) as error:
            raise UserError(f"`teacher` {source}: cannot load it as an encoder ({error})") from None
        self.max_length = _max_length(self.tokenizer, max_length, directory)
        # passage text -> its vector, least recently used first: one encoder pass per distinct passage of the run
        self.passages: dict[str, torch.Tensor] = {}
        self.capacity = max(1, _CACHE_BYTES // (4 * self.model.config.hidden_size))

    def embed(self, texts: Sequence[str], advance: Advance = _no_progress) -> torch.Tensor:
        """Mean-pooled, L2-normalised last hidden states, in batches of texts of similar length.
        -> (n, hidden) float32 on the CPU"""
        out = torch.empty(len(texts), self.model.config.hidden_size)
        with torch.inference_mode():
            for rows in by_length([len(text) for text in texts], self.batch_size):
                batch = self.tokenizer([texts[i] for i in rows], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt").to(self.device)
                hidden = self.model(**batch).last_hidden_state.float()           # (b, L, h)
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)     # (b, L, 1)
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
                out[torch.from_numpy(rows)] = F.normalize(mean, dim=-1).cpu()
                advance(len(rows))
        return out

    def work(self, candidates: Candidates, texts: dict[str, str]) -> int:
        """The distinct passages not encoded yet (more when the cache overflows and drops some)."""
        return len({texts[pid] for docs in candidates.values() for pid in docs} - self.passages.keys())

    def score(self, queries: dict[str, str], candidates: Candidates, texts: dict[str, str],
              advance: Advance = _no_progress) -> dict[str, list[float]]:
        qids, out = list(queries), {}
        for start in range(0, len(qids), _QUERY_CHUNK):
            chunk = qids[start: start + _QUERY_CHUNK]
            wanted = list(dict.fromkeys(texts[pid] for qid in chunk for pid in candidates[qid]))
            for text in wanted:  # kept ones move to the recent end
                if text in self.passages:
                    self.passages[text] = self.passages.pop(text)
            new = [text for text in wanted if text not in self.passages]
            # a copy of each row: a view would keep its whole batch alive after the row is dropped from the cache
            self.passages.update((text, row.clone()) for text, row in zip(new, self.embed(new, advance)))
            query_vectors = self.embed([queries[q] for q in chunk])
            for i, qid in enumerate(chunk):
                rows = [self.passages[texts[pid]] for pid in candidates[qid]]
                out[qid] = (torch.stack(rows) @ query_vectors[i]).tolist() if rows else []  # (n, hidden) @ (hidden,)
            while len(self.passages) > self.capacity:
                del self.passages[next(iter(self.passages))]
        return out

    def record(self) -> dict[str, object]:
        return {"kind": self.kind, "source": self.source, "pooling": "mean, L2-normalised (cosine)",
                "max_length": self.max_length, "architecture": type(self.model).__name__}


def load_teacher(source: str, kind: str, device: torch.device, batch_size: int, max_length: int | None,
                 progress: bool) -> Teacher:
    kind = teacher_kind(source, kind)
    if kind == "colbert":
        return ColBERTTeacher(source, device, batch_size, progress)
    if kind == "cross-encoder":
        return CrossEncoderTeacher(source, device, batch_size, max_length)
    return DenseTeacher(source, device, batch_size, max_length)
