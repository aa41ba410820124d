"""``hil teacher``: make distillation data here -- mine each query's candidates, score them
with a teacher, write an n-way examples file that the training readers take (``hil.data.nway_files``).

    hil teacher --dataset scifact --split train --teacher cross-encoder/ms-marco-MiniLM-L-6-v2 \\
        --output data/scifact-train.ce.jsonl
    hil teacher --queries msmarco/queries.dev.small.tsv --collection collection.tsv \\
        --miner bm25 --depth 100 --nway 32 --teacher all-MiniLM-L6-v2 --teacher-kind dense --output dev.jsonl
    hil teacher --dataset scifact --split train --miner runs/colbert/export \\
        --teacher runs/colbert/export --positives first --output scifact.self.jsonl

Steps. (1) The queries (``qid TAB text``, or a BEIR dataset's queries judged in ``--split``) and the collection
(``pid TAB text``, or the dataset's corpus: ``title text``); documents with an empty text are left out, and with a
BEIR dataset a document whose id is the query's is never its candidate (BEIR's ``ignore_identical_ids``). (2) Each
query's ``--depth`` best candidates from the miner: ``bm25`` (:mod:`hil.data.bm25`, Pyserini's settings) or any
``hil`` model, by exact late interaction over the whole collection held in memory, or through an index built under
``--index-root`` (full ranking, :func:`hil.retrieval.full_ranking.full_rank`). (3) With ``--positives first`` (needs
qrels: ``--qrels`` or the dataset's), each query's judged positive -- the highest grade >= ``--relevance-level``,
then the best mined, then the smallest id -- joins the candidates when the miner missed it. (4) The teacher scores
every candidate (:mod:`hil.experiments.teacher_models`: ``colbert`` for any model hil loads, ``cross-encoder``,
``dense``; a dense teacher encodes each distinct passage once for the whole run), its progress counted in what
costs (passages, pairs or queries) batch by batch. (5) Each query's line holds its ``--nway`` best candidates by
teacher score (ties: the miner's order),
best first; with ``--positives first``, the positive first and the ``--nway - 1`` best of the candidates not judged
positive after it (ColBERTv2's examples are positive-first). A query with fewer candidates than that is left out
(counted in the sidecar).

Output (each file written atomically, all or none; refused before any work where one exists, unless
``--overwrite``): ``--output`` in ``--format`` ``colbert`` (ColBERTv2's
``[qid, [pid, score], ...]``, ids written as JSON integers where they are canonical integers, as Stanford's files
hold them), ``pylate`` (``{"query_id", "document_ids", "scores"}``) or ``trec`` (a run; one query's lines
together); with a BEIR dataset also ``<output stem>.queries.tsv`` and ``<output stem>.collection.tsv`` (the texts of
the ids written, line breaks as spaces), which the readers need; and ``<output>.meta.json``: settings, miner,
teacher, counts, files, versions.

A user error (an option, a file, a line, a model) is one line, ``<prog>: error: ...``, exit status 2.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hil.data.beir import BeirDataset, load_beir, load_collection_tsv, load_topics_tsv
from hil.data.bm25 import BM25Index
from hil.data.id_texts import integer_id
from hil.data.run_examples import read_qrels
from hil.errors import MissingInputError, UserError
from hil.evaluation.evaluate import EvaluationSettings, document_store
from hil.evaluation.runs import ranked
from hil.experiments.teacher_models import Teacher, load_teacher
from hil.experiments.teacher_settings import TeacherSettings, output_files
from hil.modeling.loading import load_encoder
from hil.paths import resolve_data_file
from hil.provenance import atomic_output, provenance
from hil.retrieval.devices import resolve_device
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.progress import progress_bar
from hil.retrieval.search import exact_rank

_LINE_BREAKS = str.maketrans({"\n": " ", "\r": " "})


def check_device(settings: TeacherSettings) -> torch.device:
    """The device ``settings.device`` names (the other settings were checked when they were made); a bad name is
    refused naming the setting."""
    try:
        return resolve_device(settings.device)
    except ValueError as error:
        raise UserError(f"`device`: {error}") from None


@dataclass
class Inputs:
    """Texts by id, the judgments (or None), and what they were read from."""

    name: str
    queries: dict[str, str]
    documents: dict[str, str]
    qrels: dict[str, dict[str, int]] | None
    sources: dict[str, str]
    is_beir: bool
    empty_documents: int


def _file(key: str, value: str, data_dir: str | None) -> Path:
    try:
        return resolve_data_file(value, data_dir)
    except FileNotFoundError as error:
        raise MissingInputError(f"`{key}`: {error}") from None


def load_inputs(args: TeacherSettings) -> Inputs:
    if args.dataset is not None:
        dataset = load_beir(args.dataset, split=args.split, data_dir=args.data_dir, judged_outside_corpus="keep")
        queries, texts = dataset.queries, {pid: dataset.doc_text(pid) for pid in dataset.corpus}
        qrels, sources = dataset.qrels, {"dataset": dataset.source, "split": args.split}
        name = dataset.name
    else:
        query_path, collection_path = _file("queries", args.queries, args.data_dir), _file("collection",
                                                                                           args.collection,
                                                                                           args.data_dir)
        queries = load_topics_tsv(query_path)
        texts = {pid: doc["text"] for pid, doc in load_collection_tsv(collection_path).items()}
        qrels = read_qrels(_file("qrels", args.qrels, args.data_dir)) if args.qrels else None
        sources = {"queries": str(query_path), "collection": str(collection_path)}
        if args.qrels:
            sources["qrels"] = str(_file("qrels", args.qrels, args.data_dir))
        name = collection_path.stem
    if args.max_queries is not None:
        queries = dict(list(queries.items())[: args.max_queries])
    documents = {pid: text for pid, text in texts.items() if text.strip()}
    return Inputs(name, queries, documents, qrels, sources, args.dataset is not None, len(texts) - len(documents))


# -- mining --------------------------------------------------------------------------------------------------------

def mine(args: TeacherSettings, inputs: Inputs, device: torch.device) -> tuple[dict[str, list[str]], dict]:
    """Each query's ``depth`` best candidates, best first, and what mined them."""
    depth = args.depth + (1 if inputs.is_beir else 0)  # room for a self match dropped below
    qids = list(inputs.queries)
    if args.miner == "bm25":
        index = BM25Index.build(list(inputs.documents), list(inputs.documents.values()))
        hits = index.search([inputs.queries[qid] for qid in qids], depth)
        mined = {qid: [pid for pid, _ in found] for qid, found in zip(qids, hits)}
        record: dict[str, Any] = {"miner": "bm25", **index.settings()}
    else:
        encoder = load_encoder(args.miner)
        encoder.to(device)
        corpus = {pid: {"title": "", "text": text} for pid, text in inputs.documents.items()}
        dataset = BeirDataset(inputs.name, corpus, inputs.queries, {}, "teacher", inputs.sources.get("dataset", ""))
        settings = EvaluationSettings(mode="full" if args.index_root else "exhaustive", k=depth,
                                      index_root=args.index_root, batch_size=args.batch_size, device=args.device,
                                      progress=not args.quiet)
        with torch.inference_mode():
            store = document_store(encoder, dataset, settings)
            search = full_rank if args.index_root else exact_rank
            run = search(encoder, store, inputs.queries, k=depth, progress=not args.quiet).run
        mined = {qid: [pid for pid, _ in ranked(run.get(qid, {}))] for qid in qids}
        record = {"miner": args.miner, "architecture": encoder.architecture,
                  "search": "full ranking (index)" if args.index_root else "exact, in memory"}
    if inputs.is_beir:
        mined = {qid: [pid for pid in docs if pid != qid] for qid, docs in mined.items()}
    return {qid: docs[: args.depth] for qid, docs in mined.items()}, record


def judged_positive(qid: str, mined: list[str], inputs: Inputs, level: int) -> str | None:
    """The query's positive: highest grade >= ``level``, then best mined, then smallest id; None without one."""
    rank = {pid: i for i, pid in enumerate(mined)}
    judged = [(-grade, rank.get(pid, len(rank)), pid) for pid, grade in (inputs.qrels or {}).get(qid, {}).items()
              if grade >= level and pid in inputs.documents and pid != (qid if inputs.is_beir else None)]
    return min(judged)[2] if judged else None


# -- the examples ----------------------------------------------------------------------------------------------------

def select(qid: str, candidates: list[str], scores: list[float], positive: str | None, nway: int,
           inputs: Inputs, level: int) -> list[tuple[str, float]] | None:
    """The query's line: ``nway`` (pid, score) by teacher score, ties in the miner's order; the positive first and
    no other judged positive after it with ``positive``; None when there are too few."""
    order = sorted(range(len(candidates)), key=lambda i: -scores[i])  # stable: ties keep the miner's order
    pairs = [(candidates[i], float(scores[i])) for i in order]
    if positive is None:
        return pairs[:nway] if len(pairs) >= nway else None
    judged = (inputs.qrels or {}).get(qid, {})
    first = [pair for pair in pairs if pair[0] == positive]
    others = [pair for pair in pairs if judged.get(pair[0], 0) < level]
    return first + others[: nway - 1] if len(others) >= nway - 1 else None


def _json_id(identifier: str) -> str | int:
    """Stanford's files hold integer ids as JSON integers."""
    value = integer_id(identifier)
    return value if value is not None else identifier


def example_line(fmt: str, qid: str, pairs: list[tuple[str, float]]) -> str:
    if fmt == "colbert":
        return json.dumps([_json_id(qid), *([_json_id(pid), score] for pid, score in pairs)]) + "\n"
    if fmt == "pylate":
        return json.dumps({"query_id": qid, "document_ids": [p for p, _ in pairs],
                           "scores": [s for _, s in pairs]}) + "\n"
    return "".join(f"{qid} Q0 {pid} {rank} {score!r} teacher\n" for rank, (pid, score) in enumerate(pairs, 1))


def write_outputs(args: TeacherSettings, inputs: Inputs, lines: dict[str, list[tuple[str, float]]],
                  record: dict[str, Any]) -> dict[str, str]:
    """Every output through :func:`atomic_output`, renamed into place together at the end (an error leaves none)."""
    files = output_files(args.output, inputs.is_beir)
    record["files"] = {name: str(path) for name, path in files.items()}
    with ExitStack() as stack:
        handles = {name: stack.enter_context(open(stack.enter_context(atomic_output(path)), "w", encoding="utf-8",
                                                  newline="\n")) for name, path in files.items()}
        for qid, pairs in lines.items():
            handles["examples"].write(example_line(args.format, qid, pairs))
        if inputs.is_beir:
            for qid in lines:
                handles["queries"].write(f"{qid}\t{inputs.queries[qid].translate(_LINE_BREAKS)}\n")
            for pid in dict.fromkeys(pid for pairs in lines.values() for pid, _ in pairs):
                handles["collection"].write(f"{pid}\t{inputs.documents[pid].translate(_LINE_BREAKS)}\n")
        json.dump(record, handles["meta"], indent=2, default=str)
        handles["meta"].write("\n")
        for handle in handles.values():
            handle.close()  # flushed before the renames
    return record["files"]


def settings_record(args: TeacherSettings) -> dict[str, Any]:
    names = ("queries", "collection", "dataset", "split", "qrels", "positives", "relevance_level", "miner",
             "index_root", "depth", "nway", "teacher", "teacher_kind", "batch_size", "max_length", "max_queries",
             "format", "output", "device")
    return {name: getattr(args, name) for name in names}


def run(args: TeacherSettings) -> dict[str, Any]:
    """The examples ``args`` asks for, written (module docstring); -> the record written beside them. A user error
    names the setting in backquotes (``nway``), which ``hil teacher`` shows as its option."""
    device = check_device(args)
    inputs = load_inputs(args)
    if not inputs.queries:
        raise UserError("no queries to mine for")
    teacher: Teacher = load_teacher(args.teacher, args.teacher_kind, device, args.batch_size, args.max_length,
                                    not args.quiet)  # before mining: a wrong teacher fails fast
    say = (lambda message: None) if args.quiet else (lambda message: print(f"[teacher] {message}", file=sys.stderr,
                                                                            flush=True))
    say(f"mining {len(inputs.queries)} queries with {args.miner} (depth {args.depth}) over "
        f"{len(inputs.documents)} documents")
    started = time.perf_counter()
    mined, miner = mine(args, inputs, device)
    say(f"mined in {time.perf_counter() - started:.1f} s; scoring with {args.teacher}")
    level, candidates, positives = args.relevance_level, {}, {}
    for qid, docs in mined.items():
        positive = judged_positive(qid, docs, inputs, level) if args.positives == "first" else None
        positives[qid] = positive
        candidates[qid] = docs + ([positive] if positive is not None and positive not in docs else [])
    scored = [qid for qid in inputs.queries if candidates[qid] and (args.positives == "none" or positives[qid])]
    to_score = {qid: candidates[qid] for qid in scored}
    work = teacher.work(to_score, inputs.documents)
    say(f"scoring {sum(map(len, to_score.values()))} candidates of {len(scored)} queries: {work} {teacher.unit} "
        f"through the teacher")
    # The bar counts what costs: a dense teacher's passages (each encoded once), a cross-encoder's pairs; it moves
    # with each batch (rate and ETA; a line every 30 s off a terminal).
    bar = progress_bar(work, "teacher", teacher.unit, enabled=not args.quiet)
    scores = teacher.score({qid: inputs.queries[qid] for qid in scored}, to_score, inputs.documents,
                           advance=bar.update)
    bar.close()
    lines = {}
    for qid in scored:
        line = select(qid, candidates[qid], scores[qid], positives[qid], args.nway, inputs, level)
        if line is not None:
            lines[qid] = line
    if not lines:
        raise UserError(f"no query has {args.nway} candidates{' and a judged positive' * (args.positives == 'first')}"
                        f" (lower `nway`, or raise `depth`)")
    counts = {"queries": len(inputs.queries), "written": len(lines), "left_out": len(inputs.queries) - len(lines),
              "without_positive": sum(p is None for p in positives.values()) if args.positives == "first" else 0,
              "empty_documents_left_out": inputs.empty_documents,
              "mean_candidates": float(np.mean([len(c) for c in candidates.values()]))}
    record = provenance(settings_record(args), inputs=inputs.sources, miner=miner, teacher=teacher.record(),
                        counts=counts, device=str(device))
    write_outputs(args, inputs, lines, record)
    return record
