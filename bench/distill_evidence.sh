#!/usr/bin/env bash
# The distillation evidence of issue 22 at this machine's scale (README, "Distillation and n-way training"): about
# 2.5 h on 2 CPU cores. Needs the `make demo` ColBERT (runs/demo/export) as the triples-trained baseline.
#   bash bench/distill_evidence.sh [WORK]        # WORK default distill/; the table goes to docs/distill-cpu/
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-distill}"
PY="${PYTHON:-.venv/bin/python}"
HIL="${HIL:-.venv/bin/hil}"
# 1. data: the MS MARCO sample's queries, every shipped MS MARCO passage as the collection
"$PY" bench/distill_prep.py --out "$WORK/data"
# 2. teacher: BM25 candidates (depth 64), all-MiniLM-L6-v2 as a dense (mean-pooled cosine) teacher, 16 per query
"$PY" -m hil teacher --queries "$WORK/data/queries.tsv" --collection "$WORK/data/collection.tsv" \
  --qrels "$WORK/data/qrels.tsv" --positives first --miner bm25 --depth 64 --nway 16 --teacher all-MiniLM-L6-v2 \
  --teacher-kind dense --output "$WORK/data/examples.jsonl" --quiet
# 3. students, the cpu preset's backbone and lengths: 60 steps of 16 queries x 8 documents (about one pass over the
#    994 queries). The teacher's cosines (0.3-0.8) are nearly flat under a softmax at temperature 1, so the teacher
#    is sharpened with T = 0.05 (the scale of 20 sentence-transformers trains MiniLM's cosines with).
COMMON=(--config configs/presets/cpu.yaml --data.source TeacherOutput --data.source.path "$WORK/data/examples.jsonl" --data.nway 8
        --data.batch_size 16 --trainer.max_steps 60 --model.loss.init_args.teacher_temperature 0.05)
for variant in colbert_distill colbert_hil_distill colbert_distill_iso; do
  "$PY" train.py fit --config configs/colbert.yaml --config "configs/variants/$variant.yaml" "${COMMON[@]}" \
    --trainer.default_root_dir "$WORK/runs/$variant" --export_dir "$WORK/runs/$variant/export"
done
# 4. Table 2 layout: BM25, the triples-trained demo ColBERT (the baseline), the three distilled students; SciFact and
#    NFCorpus full ranking, DL19 re-ranking its BM25 top 100; intervals, paired tests vs BM25 and the baseline, Holm.
"$HIL" beir --model triples=runs/demo/export --model distill="$WORK/runs/colbert_distill/export" \
  --model hil_distill="$WORK/runs/colbert_hil_distill/export" --model iso_distill="$WORK/runs/colbert_distill_iso/export" \
  --baseline triples --datasets scifact,nfcorpus,dl19 --out "$WORK/beir" --index-root "$WORK/indexes" --quiet
mkdir -p docs/distill-cpu && cp "$WORK/beir/table.json" "$WORK/beir/table.md" docs/distill-cpu/
# 5. the teacher's own quality on SciFact: re-ranking BM25's top 100, its best 10 per query, scored as a run
"$PY" -m hil teacher --dataset scifact --split test --miner bm25 --depth 100 --nway 10 \
  --teacher all-MiniLM-L6-v2 --teacher-kind dense --format trec --output "$WORK/teacher/scifact.trec" --quiet
printf 'datasets:\n  - {name: scifact, first_stage_run: %s, first_stage_name: teacher}\nmodels: []\noutput: %s\nstatistics: {enabled: false}\n' \
  "$WORK/teacher/scifact.trec" "$WORK/teacher/eval" > "$WORK/teacher/eval.yaml"
"$HIL" evaluate --config "$WORK/teacher/eval.yaml"
cp "$WORK/teacher/eval/scifact/metrics.json" docs/distill-cpu/teacher-scifact-metrics.json
