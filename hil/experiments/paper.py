"""Reproduce HIL (001) Tables 2, 3 and 5 and Figures 2, 3 and 5 at a chosen scale, in one resumable command.

    python -m hil.experiments.paper --profile cpu          # about two hours on 2 CPU cores
    python -m hil.experiments.paper --profile smoke        # minutes; the test suite runs it
    python -m hil.experiments.paper --profile paper        # 001's settings, for a GPU

Stages, each skipped when its output already exists (a rerun resumes; ``--force`` redoes everything):

1. train every variant of :data:`~hil.experiments.profiles.VARIANTS` with ``train.py``'s CLI in a subprocess,
   same budget for all (:class:`~hil.experiments.profiles.Profile`), exported to ``train/<variant>/export``;
   the export is written under a temporary name and renamed when training succeeded, so a killed run retrains
   that variant from the start;
2. evaluate every model on every dataset: BM25 (on TREC DL19 and DL20 the official BM25 run, ``bm25-top100.trec``,
   scored as given: nDCG@10 0.5058 on the whole of DL19); exact late interaction of every query against every
   document (``full``: the top ``k`` of the whole corpus, i.e. full ranking without first-stage approximation;
   ``rerank``: that run's top ``rerank_depth`` re-scored, TREC DL: :data:`~hil.experiments.profiles.RERANKING_SETS`;
   DL20 only when its folder is laid out, or when named); each head's score matrix is kept so that ColBERT-lambda is the
   sum of its trained members' matrices (no re-encoding) and Fig. 3 counts the documents each head puts in its
   own top ``overlap_depth``; InterIso of each head over (query, most relevant document) pairs (Table 3);
3. write ``report.md`` (tables with bootstrap intervals and paired tests against ColBERT), ``summary.json`` and
   the figures under ``results/<profile>/``.

Choices where 001 is vague: "ColBERT-cosreg" and "ColBERT-istar" are the isotropic settings of 001 A.3 (lambda
0.2): both methods were proposed to make embeddings isotropic. Delta InterIso is InterIso(anisotropic module) -
InterIso(isotropic module): H - L for ColBERT-HIL and its ablations, aniso - iso for ColBERT-lambda; one-module
models have no Delta and their own InterIso is shown instead. InterIso is measured on each query paired with its
most relevant judged document (highest grade, then smallest id), so every model is measured on the same pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Collection

import numpy as np
import torch

from hil.analysis.overlap import overlap_shares
from hil.data.beir import BeirDataset
from hil.data.errors import DEBUG_ENV, UserError, one_line, user_error
from hil.evaluation.evaluate import Evaluation, EvaluationSettings, evaluate, evaluate_bm25, first_stage, score_run
from hil.evaluation.runs import write_trec_run
from hil.evaluation.statistics import P_ADJUST_METHODS
from hil.experiments.profiles import (CORPUS_IDF, DATASETS, DEFAULT_VARIANTS, ENSEMBLES, PROFILES, REPO_CONFIGS,
                                      VARIANTS, Profile, default_datasets)
from hil.experiments.records import load_dataset, load_results, other_data, summarize
from hil.experiments.report import write_report
from hil.isotropy.metrics import inter_iso
from hil.modeling.encoder import CONFIG_NAME
from hil.modeling.hil import HILEncoder
from hil.modeling.loading import load_encoder
from hil.provenance import atomic_output, provenance, write_json_atomic
from hil.modeling.contracts import Encoder
from hil.paths import DATA_DIR_ENV
from hil.retrieval.devices import PRECISIONS, check_precision, resolve_device
from hil.retrieval.encoding import eval_mode
from hil.retrieval.search import rank_matrix
from hil.retrieval.store import gather_documents

class ExperimentError(RuntimeError):
    """A stage failed; the message names the log or file to look at."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- datasets ------------------------------------------------------------------------------------------------

def relevant_pairs(dataset: BeirDataset, limit: int, seed: int) -> list[tuple[str, str]]:
    """(query id, its most relevant document id) for up to ``limit`` judged queries, a seeded sample."""
    pairs = []
    for qid in dataset.queries:
        judged = {doc: grade for doc, grade in dataset.qrels.get(qid, {}).items()
                  if grade > 0 and doc in dataset.corpus}
        if judged:
            pairs.append((qid, min(judged, key=lambda doc: (-judged[doc], doc))))
    if len(pairs) > limit:
        keep = set(random.Random(seed).sample(range(len(pairs)), limit))
        pairs = [pair for i, pair in enumerate(pairs) if i in keep]
    return pairs


# -- training ------------------------------------------------------------------------------------------------

def train_variant(name: str, profile: Profile, out: Path, force: bool = False) -> Path:
    """Train ``name`` under ``profile`` (skipped when its export exists). -> the export folder."""
    workdir = out / "train" / name
    export = workdir / "export"
    if (export / CONFIG_NAME).is_file() and not force:
        log(f"train {name}: done before, skipped")
        return export
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    partial = workdir / "export.partial"
    command = [sys.executable, "-c", "from hil.cli import train_main; train_main()", "fit",
               *profile.config_args(name), "--trainer.default_root_dir", str(workdir), "--export_dir", str(partial)]
    budget = profile.training
    log(f"train {name}: {budget.max_steps} steps x {budget.batch_size} triples (log: {workdir / 'train.log'})")
    started = time.perf_counter()
    with open(workdir / "train.log", "w") as stream:
        completed = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    seconds = time.perf_counter() - started
    if completed.returncode != 0 or not (partial / CONFIG_NAME).is_file():
        tail = (workdir / "train.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise ExperimentError(f"training {name} failed (exit {completed.returncode}); see {workdir / 'train.log'}: "
                              + " | ".join(tail))
    partial.rename(export)
    write_json_atomic(workdir / "train.json", {
        "variant": name, "config": VARIANTS[name][0] or "colbert", "command": command[3:], "seconds": seconds,
        "peak_rss_mb_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024})
    log(f"train {name}: {seconds:.0f} s")
    return export


# -- evaluation ----------------------------------------------------------------------------------------------

def _save_npz_atomic(path: Path, **arrays: Any) -> None:
    with atomic_output(path) as tmp, open(tmp, "wb") as handle:
        np.savez(handle, **arrays)


def head_overlap(heads: dict[str, np.ndarray], depth: int) -> dict[str, Any] | None:
    """Fig. 3: over all queries, documents in only head a's top ``depth``, only head b's, or both."""
    if len(heads) != 2:
        return None
    (a, sa), (b, sb) = heads.items()
    depth = min(depth, sa.shape[1])
    only_a = only_b = both = 0
    for row in range(sa.shape[0]):
        top_a = set(np.argpartition(-sa[row], depth - 1)[:depth].tolist())
        top_b = set(np.argpartition(-sb[row], depth - 1)[:depth].tolist())
        both += len(top_a & top_b)
        only_a += len(top_a - top_b)
        only_b += len(top_b - top_a)
    return {**overlap_shares(only_a, only_b, both, (a, b)), "depth": depth}


def module_metrics(dataset: BeirDataset, qids: list[str], doc_ids: list[str], heads: dict[str, np.ndarray],
                   mode: str, candidates: dict[str, list[str]] | None, k: int) -> dict[str, dict[str, float]] | None:
    """Each module's own ranking quality (its score alone): how much each head contributes (001 Table 4's H)."""
    if len(heads) < 2:
        return None
    restrict = candidates if mode == "rerank" else None
    return {head: score_run(head, dataset, rank_matrix(values, qids, doc_ids, k, restrict)).aggregate
            for head, values in heads.items()}


def backfill_module_metrics(folder: Path, name: str, dataset: BeirDataset, mode: str,
                            candidates: dict[str, list[str]] | None, k: int) -> None:
    """Add ``module_metrics`` to an evaluation finished before they were recorded (from its saved score matrices)."""
    path, scores = folder / f"{name}.json", folder / f"{name}.scores.npz"
    record = json.loads(path.read_text())
    if "module_metrics" in record or not scores.is_file():
        return
    with np.load(scores) as saved:
        heads = {f[len("head_"):]: saved[f] for f in saved.files if f.startswith("head_")}
        qids, doc_ids = list(saved["qids"]), list(saved["doc_ids"])
    record["module_metrics"] = module_metrics(dataset, qids, doc_ids, heads, mode, candidates, k)
    write_json_atomic(path, record)


def _metrics_record(dataset: BeirDataset, evaluation: Evaluation, **extra: Any) -> dict[str, Any]:
    return {"model": evaluation.name, "dataset": dataset.name, "dataset_fingerprint": dataset.fingerprint(),
            "judged_outside_corpus": dataset.judged_outside_corpus, "relevance_level": dataset.relevance_level,
            "metrics": evaluation.aggregate, "per_query": evaluation.per_query, **extra}


def _stale(path: Path, dataset: BeirDataset) -> bool:
    """Whether a finished evaluation measured other data (another dataset version, e.g. the old DL19 pool)."""
    if not path.is_file():
        return False
    record = json.loads(path.read_text())
    return record.get("dataset") != dataset.name or record.get("dataset_fingerprint", dataset.fingerprint()) != \
        dataset.fingerprint()


def pair_inter_iso(encoder: Encoder, evaluation: Evaluation, pairs: list[tuple[str, str]]) -> dict[str, float]:
    """Table 3: InterIso (001 Eq. 2) of each head over (query, most relevant document) pairs, from the queries and
    documents exactly as the evaluation scored them."""
    scores, store = evaluation.head_scores, evaluation.store
    row_of = {q: i for i, q in enumerate(scores.qids)}
    rows = torch.tensor([row_of[q] for q, _ in pairs], dtype=torch.long)
    queries = scores.queries  # on the encoder's device
    docs = gather_documents(store, [store.doc_index[d] for _, d in pairs], heads=encoder.head_names,
                            device=queries.mask.device)
    return {head: float(inter_iso(queries.heads[head][rows].float(), docs.heads[head], queries.mask[rows],
                                  docs.mask).mean()) for head in encoder.head_names}


def evaluate_model(name: str, source: str, key: str, dataset: BeirDataset, profile: Profile, out: Path,
                   bm25_candidates: dict[str, list[str]] | None, figures: bool,
                   corpus_idf: bool = False) -> dict[str, Any]:
    """Score every query against every document (``hil.evaluation.evaluate``, exhaustive, each head's matrix
    kept), rank (all documents, or BM25's candidates for re-ranking), measure; writes ``eval/<key>/<name>.*``.

    ``corpus_idf``: recompute the model's query-term IDF on this dataset first (ColBERT-HIL): on its documents, or
    on its queries for a model whose IDF formula is the authors' (taken over queries).
    """
    mode, _ = DATASETS[key]
    folder = out / "eval" / key
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(profile.seed)
    encoder = load_encoder(source)
    if corpus_idf and isinstance(encoder, HILEncoder) and encoder.idf_from_queries:
        encoder.set_idf_from_texts(list(dataset.queries.values()), source=f"{dataset.name} queries")
    elif corpus_idf:
        encoder.set_idf_from_texts(dataset.documents(), source=f"{dataset.name} corpus")
    settings = EvaluationSettings(mode="exhaustive", k=profile.k, index_root=None, keep_head_scores=True,
                                  batch_size=profile.encode_batch_size, progress=False, device=profile.device,
                                  precision=profile.precision)
    candidates = bm25_candidates if mode == "rerank" else None
    with eval_mode(encoder):
        evaluation = evaluate(encoder, dataset, settings, name=name, candidates=candidates)
        pairs = relevant_pairs(dataset, profile.interiso_pairs, profile.seed)
        extras = figure_data(encoder, name, dataset, pairs[: profile.figure_pairs], folder) if figures else {}
        interiso = pair_inter_iso(encoder, evaluation, pairs)
    qids, heads, doc_ids = evaluation.head_scores.qids, evaluation.head_scores.heads, dataset.doc_ids()
    timings = {"encode_s": evaluation.details["index_seconds"], "score_s": evaluation.details["search_seconds"]}
    record = _metrics_record(dataset, evaluation, source=source, mode=mode, inter_iso=interiso,
                             overlap=head_overlap(heads, profile.overlap_depth),
                             module_metrics=module_metrics(dataset, qids, doc_ids, heads, mode, bm25_candidates,
                                                           profile.k),
                             timings={**timings, "docs_per_s": len(doc_ids) / max(timings["encode_s"], 1e-9)},
                             n_docs=len(doc_ids), n_tokens=int(evaluation.store.n_tokens), interiso_pairs=len(pairs),
                             **extras)
    _save_npz_atomic(folder / f"{name}.scores.npz", qids=np.array(qids), doc_ids=np.array(doc_ids),
                     **{f"head_{h}": v for h, v in heads.items()})
    write_trec_run(folder / f"{name}.trec", evaluation.run, tag=name)
    write_json_atomic(folder / f"{name}.json", record)
    return record


def figure_data(encoder: Encoder, name: str, dataset: BeirDataset, pairs: list[tuple[str, str]],
                folder: Path) -> dict[str, Any]:
    """Fig. 2 token cosines (saved to ``<name>.cosines.npz``) and Fig. 5 InterIso per layer of each backbone."""
    from hil.analysis.layers import encoder_layer_inter_iso
    from hil.analysis.similarity import token_cosines

    query_texts = [dataset.queries[q] for q, _ in pairs]
    doc_texts = [dataset.doc_text(d) for _, d in pairs]
    cosines = token_cosines(encoder, query_texts, doc_texts)
    _save_npz_atomic(folder / f"{name}.cosines.npz",
                     **{head: values.astype(np.float16) for head, values in cosines.all_pairs.items()})
    curves = encoder_layer_inter_iso(encoder, query_texts, doc_texts, label=name)
    return {"layer_inter_iso": {label: np.asarray(curve, float).tolist() for label, curve in curves.items()}}


def evaluate_ensemble(name: str, members: tuple[str, str], key: str, dataset: BeirDataset, profile: Profile,
                      out: Path, bm25_candidates: dict[str, list[str]] | None) -> dict[str, Any]:
    """ColBERT-lambda: the sum of its two members' score matrices (001 Section 3.2, weights 1 and 1)."""
    mode, _ = DATASETS[key]
    folder = out / "eval" / key
    heads, interiso, qids, doc_ids = {}, {}, None, None
    for member, head in zip(members, ("iso", "aniso")):
        with np.load(folder / f"{member}.scores.npz") as saved:
            if qids is not None and (list(saved["qids"]) != qids or list(saved["doc_ids"]) != doc_ids):
                raise ExperimentError(f"{name}: members scored different queries or documents on {key}")
            qids, doc_ids = list(saved["qids"]), list(saved["doc_ids"])
            (only,) = [saved[f] for f in saved.files if f.startswith("head_")]
            heads[head] = only
        (interiso[head],) = json.loads((folder / f"{member}.json").read_text())["inter_iso"].values()
    total = heads["iso"] + heads["aniso"]
    run = rank_matrix(total, qids, doc_ids, profile.k, bm25_candidates if mode == "rerank" else None)
    record = _metrics_record(dataset, score_run(name, dataset, run), source="+".join(members), mode=mode,
                             inter_iso=interiso,
                             overlap=head_overlap(heads, profile.overlap_depth))
    write_trec_run(folder / f"{name}.trec", run, tag=name)
    write_json_atomic(folder / f"{name}.json", record)
    return record


def _done(path: Path, force: bool) -> bool:
    return path.is_file() and not force


def run_profile(profile: Profile, out: Path, *, variants: list[str] | None = None,
                datasets: list[str] | None = None, force: bool = False, command: str = "") -> Path:
    """Every stage for ``profile`` into ``out``; returns the report path."""
    variants = variants or list(DEFAULT_VARIANTS)
    if not datasets:
        datasets, absent = default_datasets()
        for key in absent:  # e.g. TREC DL20, which is not in ../shared: evaluated once its folder is laid out
            log(f"{key}: {DATASETS[key][1]} not found under ${DATA_DIR_ENV}, left out "
                f"(README, 'TREC DL 2019 and 2020')")
    unknown = sorted(set(variants) - set(VARIANTS)) + sorted(set(datasets) - set(DATASETS))
    if unknown:
        raise ExperimentError(f"unknown variant or dataset {unknown}; variants {list(VARIANTS)}, "
                              f"datasets {list(DATASETS)}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    write_json_atomic(out / "profile.json", provenance(profile.budget(), command=command))
    exports = {name: train_variant(name, profile, out, force) for name in variants}
    ensembles = {name: spec for name, spec in ENSEMBLES.items() if spec[0] in exports and spec[1] in exports}
    for key in datasets:
        dataset, given = load_dataset(key, profile)
        folder = out / "eval" / key
        folder.mkdir(parents=True, exist_ok=True)
        redo = force or _stale(folder / "bm25.json", dataset)
        if redo and not force:
            log(f"evaluations on {key} measured other data ({folder / 'bm25.json'}): redone")
        if _done(folder / "bm25.json", redo):
            bm25 = json.loads((folder / "bm25.json").read_text())
        else:  # a re-ranking set's given first stage, else BM25 over the corpus
            evaluation = given or evaluate_bm25(dataset, k=max(profile.rerank_depth, profile.k))
            bm25 = _metrics_record(dataset, evaluation, mode=evaluation.details["mode"],
                                   run_file=evaluation.details.get("run_file"),
                                   run_top=first_stage(evaluation, profile.rerank_depth))
            write_trec_run(folder / "bm25.trec", evaluation.run, tag="bm25")
            write_json_atomic(folder / "bm25.json", bm25)
        candidates = bm25["run_top"] if DATASETS[key][0] == "rerank" else None
        for name, export in exports.items():
            if _done(folder / f"{name}.json", redo):
                backfill_module_metrics(folder, name, dataset, DATASETS[key][0], candidates, profile.k)
                continue
            log(f"evaluate {name} on {key} ({len(dataset.queries)} queries, {len(dataset.corpus)} documents)")
            record = evaluate_model(name, str(export), key, dataset, profile, out, candidates,
                                    figures=key == datasets[0])
            log(f"  nDCG@10 {record['metrics']['ndcg@10']:.4f}, InterIso {record['inter_iso']}, "
                f"encode {record['timings']['encode_s']:.0f} s, score {record['timings']['score_s']:.0f} s")
        for name, (base, _) in CORPUS_IDF.items():
            if base in exports and _done(folder / f"{name}.json", redo):
                backfill_module_metrics(folder, name, dataset, DATASETS[key][0], candidates, profile.k)
            elif base in exports:
                log(f"evaluate {name} on {key}")
                record = evaluate_model(name, str(exports[base]), key, dataset, profile, out, candidates,
                                        figures=False, corpus_idf=True)
                log(f"  nDCG@10 {record['metrics']['ndcg@10']:.4f}, InterIso {record['inter_iso']}")
        for name, (iso, aniso, _) in ensembles.items():
            if not _done(folder / f"{name}.json", redo):
                record = evaluate_ensemble(name, (iso, aniso), key, dataset, profile, out, candidates)
                log(f"evaluate {name} on {key}: nDCG@10 {record['metrics']['ndcg@10']:.4f}")
    report = write_outputs(out, profile, command=command, elapsed_s=time.perf_counter() - started)
    log(f"report: {report}")
    return report


def write_outputs(out: Path, profile: Profile, *, command: str = "", elapsed_s: float | None = None) -> Path:
    """``summary.json`` (every number, :func:`hil.experiments.records.summarize`) and ``report.md`` (rendered from
    it, with the figures) from the files the run left. -> the report path."""
    results = load_results(out)
    names = {}
    for key in results:
        try:
            names[key] = load_dataset(key, profile)[0].name
        except (OSError, ValueError):
            continue
    stale = other_data(results, names)
    if stale:
        raise ExperimentError(f"{out}: {len(stale)} evaluations measured other data than today's datasets "
                              f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}); rerun the experiment, "
                              "which redoes them")
    summary = summarize(out, results, profile, command=command, elapsed_s=elapsed_s)
    report = write_report(out, profile, summary, results)
    write_json_atomic(out / "summary.json", summary)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hil.experiments.paper", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--out", default=None, help="output folder (default results/<profile>)")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--datasets", default=None, help=f"comma-separated subset of {','.join(DATASETS)}")
    parser.add_argument("--max-steps", type=int, default=None, help="override the profile's training steps")
    parser.add_argument("--configs", default=str(REPO_CONFIGS),
                        help="config folder (colbert.yaml, variants/, presets/)")
    parser.add_argument("--device", default=None,
                        help="where models are evaluated: auto (the GPU when there is one; the default), cpu, cuda, "
                             "cuda:N")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="corpus encoding autocast at evaluation (default: the profile's, fp32)")
    parser.add_argument("--p-adjust", choices=P_ADJUST_METHODS, default=None,
                        help="multiple-comparison adjustment of the tests against ColBERT, shown beside the raw "
                             "p-values and used for the dagger: holm (Holm-Bonferroni; the default), bh "
                             "(Benjamini-Hochberg) or none")
    parser.add_argument("--force", action="store_true", help="redo finished stages instead of skipping them")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from finished stages")
    parser.add_argument("--publish", default=None, metavar="DIR",
                        help="then copy the report, summary.json, figures and per-model metric JSONs (no runs, "
                             "score matrices or models) to DIR, e.g. docs/paper-cpu")
    return parser


def publish(out: Path, target: Path) -> Path:
    """Copy what a reader of the report needs (small files) from ``out`` to ``target``; returns the copied report."""
    if not (out / "report.md").is_file():
        raise ExperimentError(f"{out}: no report.md to publish (run the experiment first)")
    if target.exists():
        shutil.rmtree(target)
    for pattern in ("report.md", "summary.json", "profile.json", "figures/*.png", "eval/*/*.json",
                    "train/*/train.json"):
        for path in sorted(out.glob(pattern)):
            destination = target / path.relative_to(out)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)
    return target / "report.md"


def main(argv: list[str] | None = None) -> int:
    """The command; -> its exit status: 2 and one line for a user error (an option, a variant or dataset name, a
    folder without results: ``hil.data.errors.user_error``), 1 and one line naming the log when a stage failed
    (:class:`ExperimentError`); ``HIL_DEBUG=1`` keeps the traceback."""
    try:
        return run_command(argv)
    except Exception as error:
        if os.environ.get(DEBUG_ENV):
            raise
        shown = error if isinstance(error, ExperimentError) else user_error(error)
        if shown is None:
            raise
        print(f"error: {one_line(shown)}", file=sys.stderr)
        return 1 if isinstance(shown, ExperimentError) else 2


def names(option: str, text: str | None, known: Collection[str]) -> list[str] | None:
    """The comma-separated names of ``option`` (None when not given), each one of ``known``."""
    if not text:
        return None
    given = [name for name in text.split(",") if name]
    unknown = [name for name in given if name not in known]
    if unknown:
        raise UserError(f"{option}: unknown {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
    return given


def run_command(argv: list[str] | None) -> int:
    from dataclasses import replace

    args = build_parser().parse_args(argv)
    profile = PROFILES[args.profile]
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise UserError(f"--max-steps must be at least 1 (got {args.max_steps})")
        profile = replace(profile, max_steps=args.max_steps)
    variants, datasets = names("--variants", args.variants, VARIANTS), names("--datasets", args.datasets, DATASETS)
    profile = replace(profile, configs=Path(args.configs))
    overrides = {k: v for k, v in (("device", args.device), ("precision", args.precision),
                                   ("p_adjust", args.p_adjust)) if v is not None}
    if overrides:
        profile = replace(profile, **overrides)
    try:
        check_precision(profile.precision, resolve_device(profile.device))
    except ValueError as error:
        raise UserError(f"--device/--precision: {error}") from None
    out = Path(args.out or Path("results") / profile.name)
    command = "python -m hil.experiments.paper " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.report_only:
        recorded = out / "profile.json"  # the command that ran the experiment, not this rewrite
        if recorded.is_file():
            command = json.loads(recorded.read_text()).get("command") or command
        print(write_outputs(out, profile, command=command))
    else:
        run_profile(profile, out, variants=variants, datasets=datasets, force=args.force, command=command)
    if args.publish:
        log(f"published {publish(out, Path(args.publish))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
