"""A small ColBERTv2 n-way examples file for tests that train from one (tests/test_configs.py, test_training.py)."""

from __future__ import annotations

import json
from pathlib import Path


def write_nway_examples(folder: Path, n_queries: int = 8, nway: int = 4, scored: bool = True) -> list[str]:
    """A small ColBERTv2 n-way file (``[qid, [pid, score], ...]``, or ``[qid, pid, ...]`` without ``scored``) with
    its queries and collection, made from the shared triples; the data arguments that train from it instead of the
    smoke preset's triples (its reader as ``data.source``, by ``class_path``)."""
    from hil.data.triples import read_triples
    from hil.paths import resolve_data_file

    triples = read_triples(resolve_data_file("msmarco/triples.train.small.head1000.tsv"), limit=40)
    passages = list(dict.fromkeys(text for t in triples for text in (t.positive, t.negative)))
    pid = {text: f"p{k}" for k, text in enumerate(passages)}
    lines = []
    for q, triple in enumerate(triples[:n_queries]):
        others = [text for text in passages[q * 5:] + passages[:q * 5]
                  if text not in (triple.positive, triple.negative)][:nway - 2]  # distinct, none of its own two
        ranked = [(triple.positive, 9.0), (triple.negative, 2.0), *((text, 1.0 - j) for j, text in enumerate(others))]
        entries = ([pid[text], score] for text, score in ranked) if scored else (pid[text] for text, _ in ranked)
        lines.append(json.dumps([f"q{q}", *entries]))
    (folder / "examples.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "queries.tsv").write_text("".join(f"q{q}\t{t.query}\n" for q, t in enumerate(triples[:n_queries])))
    (folder / "collection.tsv").write_text("".join(f"{pid[text]}\t{text}\n" for text in passages))
    return ["--data.source", "hil.data.nway_files.NWayExamples", "--data.source.path", str(folder / "examples.jsonl"),
            "--data.source.queries", str(folder / "queries.tsv"), "--data.source.collection",
            str(folder / "collection.tsv"), "--data.nway", str(nway), "--data.cache_dir", str(folder / "cache")]


def nway_settings(folder: Path) -> dict:
    """The data module's settings of the file :func:`write_nway_examples` wrote in ``folder`` (its reader, the
    cache folder; ``nway`` left to the caller)."""
    from hil.data.nway_files import NWayExamples

    return {"source": NWayExamples(str(folder / "examples.jsonl"), str(folder / "queries.tsv"),
                                   str(folder / "collection.tsv")), "cache_dir": str(folder / "cache")}
