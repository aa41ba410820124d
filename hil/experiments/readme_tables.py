"""The README's tables of measured figures, rendered from the results files that hold them.

    python -m hil.experiments.readme_tables            # check: exit 1 naming each table that differs from its files
    python -m hil.experiments.readme_tables --write    # rewrite those tables (README.md, docs/results.md)

Each table stands in ``README.md`` or ``docs/results.md`` between ``<!-- table: <name> ... -->`` and
``<!-- /table -->``; what is between
the markers is this module's rendering of the results files that :data:`TABLES` names, and nothing else, so a figure
changes only with the file (and the command) it comes from. ``tests/test_readme_tables.py`` checks that the README
equals the rendering of the committed files.

- ``paper-cpu-fidelity``: ``docs/paper-cpu-fidelity/summary.json``, written by ``hil paper``
  (``--publish docs/paper-cpu-fidelity``; ``--report-only`` recomputes it from the ``eval/`` records beside it).
- ``distill-cpu``: ``docs/distill-cpu/table.json``, written by ``hil beir`` over the distilled models (docs/results.md,
  "Distillation at CPU scale").
- ``measured-here``: the ``metrics.json`` of ``make demo DEMO_RESULTS=results/demo`` (a plain ``make demo`` writes
  under ``runs/``, leaving the committed record alone) and of the commands :data:`MEASURED_HERE` lists beside each
  row. A row whose file is not there is rendered as ``-`` and named under the table with its command, instead of a
  figure nobody can regenerate.

Why here and not under ``bench/``: the renderer reads the records of this package's own commands (``summary.json``
of the paper experiment, ``metrics.json`` of ``evaluate.py``) and formats them with the package's formatters
(:mod:`hil.evaluation.tables`), so it changes with them; it is not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hil.errors import UserError, one_line
from hil.evaluation.tables import adjustment_legend, markdown_table, p_value, pct, relative
from hil.provenance import write_text_atomic

README = "README.md"
RESULTS = "docs/results.md"
DOCUMENTS = (README, RESULTS)  # where marked tables may stand (the measured results live in docs/results.md)
BEGIN = re.compile(r"^<!-- table: (?P<name>[\w-]+)\b.*-->$")
END = "<!-- /table -->"
PAPER_SUMMARY = "docs/paper-cpu-fidelity/summary.json"
SEEDS_TABLE = "docs/seeds-cpu/seeds.json"
ENGINES_TABLE = "docs/engines-scifact/engines.json"


@dataclass(frozen=True)
class MeasuredRow:
    """A row of "Measured here": a run of an ``evaluate.py`` ``metrics.json`` (``bm25``, or the model's run: the
    first other one) and the command that writes that file."""

    label: str
    short: str    # the row's name in the list of sources
    results: str  # the metrics.json, relative to the repository root
    run: str      # "bm25" or "model"
    command: str


MEASURED_HERE: tuple[MeasuredRow, ...] = (
    MeasuredRow("BM25 (bm25s, as above)", "BM25", "results/demo/metrics.json", "bm25",
                "make demo DEMO_RESULTS=results/demo"),
    MeasuredRow("ColBERT, untrained head (random 128-d projection, seed 12345)", "untrained head",
                "results/demo-untrained/metrics.json", "model",
                "python evaluate.py --model sentence-transformers/all-MiniLM-L6-v2 --dataset scifact --dim 128 "
                "--output results/demo-untrained"),
    MeasuredRow("ColBERT, `configs/presets/cpu.yaml` (64 steps x 32 MS MARCO triples)", "ColBERT",
                "results/demo/metrics.json", "model", "make demo DEMO_RESULTS=results/demo"),
    MeasuredRow("ColBERT-HIL, `configs/variants/colbert_hil.yaml` + the same preset", "ColBERT-HIL",
                "results/demo-hil/metrics.json", "model",
                "python train.py fit --config configs/colbert.yaml --config configs/variants/colbert_hil.yaml "
                "--config configs/presets/cpu.yaml --trainer.default_root_dir runs/demo-hil --export_dir "
                "runs/demo-hil/export && python evaluate.py --model runs/demo-hil/export --dataset scifact "
                "--output results/demo-hil"),
)
MEASURED_METRICS = (("nDCG@10", "ndcg@10"), ("MRR@10", "mrr@10"), ("R@100", "recall@100"))

# (row label, model in summary.json, note after the DL19 cell); p-values and differences against ColBERT.
PAPER_ROWS = (("BM25", "bm25", " (the official run; published 0.5058)"), ("ColBERT", "colbert", ""),
              ("ColBERT-HIL (paper recipe)", "hil", ""), ("ColBERT-HIL (authors' code)", "hil_authors", ""))
PAPER_UNCOMPARED = ("bm25", "colbert")  # rows shown without a difference against ColBERT


def read_json(root: Path, relative_path: str) -> dict[str, Any] | None:
    """A results file under ``root`` (None when it is not there); unreadable JSON is a one-line :class:`UserError`."""
    path = root / relative_path
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise UserError(f"{path}: not a JSON results file ({one_line(error)})") from None


def _field(record: dict[str, Any], path: str, *keys: str) -> Any:
    value: Any = record
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise UserError(f"{path}: no {'.'.join(keys)} (is it the file of the command the README names?)")
        value = value[key]
    return value


def measured_run(record: dict[str, Any], path: str, run: str) -> dict[str, float]:
    """The metrics of the ``bm25`` run of an ``evaluate.py`` metrics.json, or of its model (the first other run)."""
    results = _field(record, path, "results")
    names = [name for name in results if (name == "bm25") == (run == "bm25")]
    if not names:
        raise UserError(f"{path}: no {run} run among {', '.join(results) or 'none'}")
    return _field(results, path, names[0], "metrics")


def render_measured_here(root: Path, document: str = README) -> list[str]:
    """The "Measured here" table and, under it, the command and file of each row (a row without its file: ``-``)."""
    rows = []
    for row in MEASURED_HERE:
        record = read_json(root, row.results)
        if record is None:
            rows.append([row.label] + ["-"] * len(MEASURED_METRICS))
            continue
        metrics = measured_run(record, row.results, row.run)
        rows.append([row.label] + [f"{_field(metrics, row.results, key):.3f}" for _, key in MEASURED_METRICS])
    lines = markdown_table(["model", *(title for title, _ in MEASURED_METRICS)], rows)
    lines += ["", "Each row is the `metrics.json` of a command (`-`: that file is not in this checkout yet):"]
    for path in dict.fromkeys(row.results for row in MEASURED_HERE):
        fed = [row for row in MEASURED_HERE if row.results == path]
        missing = "" if (root / path).is_file() else ", not measured yet"
        lines.append(f"- {' and '.join(row.short for row in fed)}: `{path}` from `{fed[0].command}`{missing}")
    return lines


def _paper_cell(summary: dict[str, Any], key: str, name: str) -> str:
    """A dataset's nDCG@10 in percent, with the difference and p-value against ColBERT for a compared row (and the
    adjusted p-value when the summary has one)."""
    row = _field(summary, PAPER_SUMMARY, "statistics", key, name)
    text = pct(_field(row, PAPER_SUMMARY, "mean"))
    if name in PAPER_UNCOMPARED:
        return text
    p = f"p {p_value(_field(row, PAPER_SUMMARY, 'p_t_vs_colbert'))}"
    if "p_t_vs_colbert_adjusted" in row:
        method = summary.get("significance", {}).get("p_adjust", "adjusted")
        p += f", {method} {p_value(row['p_t_vs_colbert_adjusted'])}"
    return f"{text} ({100 * _field(row, PAPER_SUMMARY, 'diff_vs_colbert'):+.2f}, {p})"


def render_paper_cpu_fidelity(root: Path, document: str = README) -> list[str]:
    """nDCG@10 of BM25, ColBERT and the two HIL recipes on SciFact, NFCorpus (their average) and DL19."""
    summary = read_json(root, PAPER_SUMMARY)
    if summary is None:
        raise UserError(f"{root / PAPER_SUMMARY}: not found (hil paper ... --publish "
                        f"{Path(PAPER_SUMMARY).parent} writes it)")
    table2 = _field(summary, PAPER_SUMMARY, "table2")
    colbert_avg = _field(table2, PAPER_SUMMARY, "colbert", "avg")
    rows = []
    for label, name, note in PAPER_ROWS:
        avg = _field(table2, PAPER_SUMMARY, name, "avg")
        average = pct(avg) if name in PAPER_UNCOMPARED else f"{pct(avg)} ({relative(avg, colbert_avg)})"
        rows.append([label, _paper_cell(summary, "scifact", name), _paper_cell(summary, "nfcorpus", name), average,
                     pct(_field(summary, PAPER_SUMMARY, "statistics", "dl19", name, "mean")) + note])
    return markdown_table(["nDCG@10", "SciFact", "NFCorpus", "Avg.", "DL19 (BM25 top 100, graded)"], rows)


DISTILL_TABLE = "docs/distill-cpu/table.json"


def render_distill_cpu(root: Path, document: str = README) -> list[str]:
    """The distillation evidence (issue 22): ``hil beir``'s Table 2 record of the triples-trained demo ColBERT and
    the distilled models beside BM25, rendered by the BEIR command's own renderer (intervals, p-values raw and
    adjusted, daggers, legend)."""
    from hil.experiments.beir_table import FAMILY, detail_lines, main_lines

    table = read_json(root, DISTILL_TABLE)
    if table is None:
        raise UserError(f"{root / DISTILL_TABLE}: not found (the hil beir command in docs/results.md, "
                        "'Distillation at CPU scale', writes it: --out docs/distill-cpu)")
    stats = _field(table, DISTILL_TABLE, "statistics")
    legend = (f"Baseline: {table['baseline']}. " + adjustment_legend(stats.get("p_adjust", "none"),
                                                                       stats.get("family", FAMILY),
                                                                       stats["significance"],
                                                                       test=stats["dagger_test"]))
    return [*main_lines(table), "", legend, "", *detail_lines(table)]


def render_seeds_cpu(root: Path, document: str = README) -> list[str]:
    """HIL against seed noise (issue 30): ``hil paper --seeds``'s ``seeds.json``, nDCG@10 per dataset, with the
    plain statements, rendered by the seed report's own renderers."""
    from hil.experiments.seed_report import seed_lines, statement_lines

    record = read_json(root, SEEDS_TABLE)
    if record is None:
        raise UserError(f"{root / SEEDS_TABLE}: not found (docs/results.md, 'Over training seeds': hil paper "
                        "--seeds ... --publish "
                        "docs/seeds-cpu writes it)")
    tables, seeds = _field(record, SEEDS_TABLE, "tables"), _field(record, SEEDS_TABLE, "settings", "seeds")
    return [*statement_lines(tables), "", *seed_lines(tables, seeds, metrics=("ndcg@10",))]


def render_engines(root: Path, document: str = README) -> list[str]:
    """The isotropy x engine study (issue 30): ``hil engines``'s ``engines.json``, rendered by its own renderer (the
    figure linked relative to ``document``)."""
    from hil.experiments.engines import summary_lines

    record = read_json(root, ENGINES_TABLE)
    if record is None:
        raise UserError(f"{root / ENGINES_TABLE}: not found (docs/results.md, 'Isotropy and engines': hil "
                        "engines --out "
                        f"{Path(ENGINES_TABLE).parent} writes it)")
    folder = Path(os.path.relpath(Path(ENGINES_TABLE).parent, Path(document).parent))
    return summary_lines(record, (folder / "engines_isotropy.png").as_posix(), (folder / "engines.md").as_posix())


TABLES: dict[str, Callable[[Path, str], list[str]]] = {
    "paper-cpu-fidelity": render_paper_cpu_fidelity,
    "measured-here": render_measured_here,
    "distill-cpu": render_distill_cpu,
    "seeds-cpu": render_seeds_cpu,
    "engines": render_engines,
}


def table_blocks(text: str, path: str = README) -> dict[str, tuple[int, int]]:
    """Each marked table's name -> (first line inside its markers, the end marker's line), 0-based."""
    lines, blocks, begin = text.splitlines(), {}, None
    for number, line in enumerate(lines):
        match = BEGIN.match(line.strip())
        if match:
            if begin is not None:
                raise UserError(f"{path}:{number + 1}: table {match['name']!r} begins inside table {begin[0]!r}")
            begin = (match["name"], number + 1)
        elif line.strip() == END:
            if begin is None:
                raise UserError(f"{path}:{number + 1}: {END} without a table marker before it")
            blocks[begin[0]] = (begin[1], number)
            begin = None
    if begin is not None:
        raise UserError(f"{path}: table {begin[0]!r} has no {END}")
    unknown = sorted(set(blocks) - set(TABLES))
    if unknown:
        raise UserError(f"{path}: unknown table {', '.join(unknown)} (known: {', '.join(TABLES)})")
    return blocks


def rendered(text: str, root: Path, document: str = README) -> tuple[str, list[str]]:
    """``text`` (``document``: the README or docs/results.md) with every marked table rendered from the files under
    ``root``, and the names of the tables that changed."""
    lines = text.splitlines()
    changed = []
    for name, (first, end) in sorted(table_blocks(text, document).items(), key=lambda item: -item[1][0]):
        block = TABLES[name](root, document)
        if lines[first:end] != block:
            changed.append(name)
            lines[first:end] = block
    return "\n".join(lines) + ("\n" if text.endswith("\n") else ""), sorted(changed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hil.experiments.readme_tables",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=".", help="the repository root (README.md, docs/, results/)")
    parser.add_argument("--write", action="store_true", help="rewrite the tables that differ (default: check)")
    args = parser.parse_args(argv)
    stale = 0
    for document in DOCUMENTS:
        path = Path(args.root) / document
        if document != README and not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
            new, changed = rendered(text, Path(args.root), document)
        except (OSError, UserError) as error:
            print(f"error: {one_line(error)}", file=sys.stderr)
            return 2
        if args.write and changed:
            write_text_atomic(path, new)
            print(f"{path}: rewrote {', '.join(changed)}")
        elif changed:
            print(f"{path}: {', '.join(changed)} differ from their results files "
                  "(python -m hil.experiments.readme_tables --write)", file=sys.stderr)
            stale = 1
    return stale


if __name__ == "__main__":
    raise SystemExit(main())
