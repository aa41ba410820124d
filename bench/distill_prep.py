"""The distillation evidence's training data (issue 22, README "Distillation and n-way training"): the MS MARCO
sample's 994 queries, and as collection every MS MARCO passage shipped with the shared data (the sample's passages
and TREC DL19's 4,297), written as ColBERTv2's ``queries.tsv`` / ``collection.tsv`` plus the sample's positives as
``qrels.tsv``. The teacher (``hil teacher``) then mines and scores candidates for them.

    python bench/distill_prep.py --out distill/data      # reads $HIL_DATA_DIR/msmarco

Query and passage ids are assigned in order of first appearance (``q0``, ``p0``, ...): the sample ships texts, not
MS MARCO's ids. DL19's passages join the collection as candidates only; DL19's queries and judgments are not used.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--msmarco", default=str(Path(os.environ.get("HIL_DATA_DIR", "data")) / "msmarco"))
    parser.add_argument("--triples", default="triples.train.small.head1000.tsv")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    root, out = Path(args.msmarco), Path(args.out)
    queries: dict[str, str] = {}
    passages: dict[str, str] = {}
    qid_of: dict[str, str] = {}
    pid_of: dict[str, str] = {}
    qrels: set[tuple[str, str]] = set()

    def pid(text: str) -> str:
        if text not in pid_of:
            pid_of[text] = f"p{len(pid_of)}"
            passages[pid_of[text]] = text
        return pid_of[text]

    for line in (root / args.triples).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        query, positive, negative = line.split("\t")
        if query not in qid_of:
            qid_of[query] = f"q{len(qid_of)}"
            queries[qid_of[query]] = query
        qrels.add((qid_of[query], pid(positive)))
        pid(negative)
    for line in (root / "dl19" / "corpus.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        pid((record.get("title", "") + " " + record["text"]).strip())
    out.mkdir(parents=True, exist_ok=True)

    def clean(text: str) -> str:
        return " ".join(text.split())

    (out / "queries.tsv").write_text("".join(f"{q}\t{clean(t)}\n" for q, t in queries.items()), encoding="utf-8")
    (out / "collection.tsv").write_text("".join(f"{p}\t{clean(t)}\n" for p, t in passages.items()), encoding="utf-8")
    (out / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{p}\t1\n" for q, p in sorted(qrels)),
                                   encoding="utf-8")
    print(f"{len(queries)} queries, {len(passages)} passages, {len(qrels)} judgments -> {out}")


if __name__ == "__main__":
    main()
