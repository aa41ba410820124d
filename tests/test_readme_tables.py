"""The README's tables of figures are the rendering of the committed results files (``python -m
hil.experiments.readme_tables``): a stale figure, or a results file changed without ``--write``, fails here."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from hil.errors import UserError
from hil.experiments.readme_tables import (
    DISTILL_TABLE,
    DOCUMENTS,
    ENGINES_TABLE,
    MEASURED_HERE,
    PAPER_SUMMARY,
    README,
    RESULTS,
    SEEDS_TABLE,
    main,
    render_measured_here,
    render_paper_cpu_fidelity,
    rendered,
    table_blocks,
)

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted({PAPER_SUMMARY, DISTILL_TABLE, SEEDS_TABLE, ENGINES_TABLE, *(row.results for row in MEASURED_HERE)})


def committed_copy(root: Path) -> Path:
    """README.md and the results files the tables name, as far as git tracks them (a local ``make demo`` output
    that is not committed must not make the README look right or wrong)."""
    try:
        tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "--", *SOURCES], capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: which results files are committed is unknown")
    for relative in [*DOCUMENTS, *tracked]:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / relative, root / relative)
    return root


def test_the_readme_tables_are_the_rendering_of_the_committed_results_files(tmp_path):
    root = committed_copy(tmp_path)
    names = set()
    for document in DOCUMENTS:
        text = (root / document).read_text(encoding="utf-8")
        names |= set(table_blocks(text))
        new, changed = rendered(text, root, document)
        assert changed == [], (f"{document} tables {changed} differ from their results files: run "
                               "python -m hil.experiments.readme_tables --write")
        assert new == text
    assert names == {"paper-cpu-fidelity", "measured-here", "distill-cpu", "seeds-cpu", "engines"}


def test_a_changed_results_file_makes_the_readme_stale_until_written(tmp_path, capsys):
    root = committed_copy(tmp_path)
    summary = json.loads((root / PAPER_SUMMARY).read_text())
    summary["statistics"]["scifact"]["hil"]["mean"] += 0.01
    (root / PAPER_SUMMARY).write_text(json.dumps(summary))
    assert main(["--root", str(root)]) == 1
    assert "paper-cpu-fidelity differ" in capsys.readouterr().err
    assert main(["--root", str(root), "--write"]) == 0
    assert main(["--root", str(root)]) == 0
    assert "| ColBERT-HIL (paper recipe) | 62.33 (+0.80, p 0.51, holm 1) |" in (root / RESULTS).read_text()
    # the distillation table follows its file (hil beir's table.json) the same way
    table = json.loads((root / DISTILL_TABLE).read_text())
    table["rows"][-1]["scores"]["distill"] += 0.01
    (root / DISTILL_TABLE).write_text(json.dumps(table))
    assert main(["--root", str(root)]) == 1
    assert "distill-cpu differ" in capsys.readouterr().err
    assert main(["--root", str(root), "--write"]) == 0
    assert "| SciFact | 67.62 | 64.16 | 64.56 |" in (root / RESULTS).read_text()


def summary_fixture() -> dict:
    """A paper summary with round numbers, whose rendering is written out by hand below."""
    def row(mean, diff=None, p=None, **extra):
        return {"mean": mean, **({"diff_vs_colbert": diff, "p_t_vs_colbert": p} if diff is not None else {}), **extra}

    statistics = {
        "scifact": {"bm25": row(0.675, 0.075, 0.0004), "colbert": row(0.6), "hil": row(0.6125, 0.0125, 0.51234),
                    "hil_authors": row(0.63, 0.03, 0.0032, p_t_vs_colbert_adjusted=0.0128)},
        "nfcorpus": {"bm25": row(0.325, 0.075, 0.0001), "colbert": row(0.25), "hil": row(0.24, -0.01, 0.04),
                     "hil_authors": row(0.27, 0.02, 0.2, p_t_vs_colbert_adjusted=0.6)},
        "dl19": {"bm25": row(0.5058), "colbert": row(0.6), "hil": row(0.61), "hil_authors": row(0.625)},
    }
    table2 = {"bm25": {"avg": 0.5}, "colbert": {"avg": 0.425}, "hil": {"avg": 0.42625}, "hil_authors": {"avg": 0.45}}
    return {"statistics": statistics, "table2": table2, "significance": {"p_adjust": "holm"}}


def test_the_paper_table_by_hand(tmp_path):
    (tmp_path / PAPER_SUMMARY).parent.mkdir(parents=True)
    (tmp_path / PAPER_SUMMARY).write_text(json.dumps(summary_fixture()))
    assert render_paper_cpu_fidelity(tmp_path) == [
        "| nDCG@10 | SciFact | NFCorpus | Avg. | DL19 (BM25 top 100, graded) |",
        "|---|---|---|---|---|",
        "| BM25 | 67.50 | 32.50 | 50.00 | 50.58 (the official run; published 0.5058) |",
        "| ColBERT | 60.00 | 25.00 | 42.50 | 60.00 |",
        "| ColBERT-HIL (paper recipe) | 61.25 (+1.25, p 0.51) | 24.00 (-1.00, p 0.04) | 42.62 (+0.3%) | 61.00 |",
        "| ColBERT-HIL (authors' code) | 63.00 (+3.00, p 0.0032, holm 0.013) | 27.00 (+2.00, p 0.2, holm 0.6) | "
        "45.00 (+5.9%) | 62.50 |",
    ]


def test_measured_rows_come_from_their_files_and_a_missing_one_says_so(tmp_path):
    demo = tmp_path / "results" / "demo" / "metrics.json"
    demo.parent.mkdir(parents=True)
    demo.write_text(json.dumps({"results": {
        "bm25": {"metrics": {"ndcg@10": 0.6762, "mrr@10": 0.6412, "recall@100": 0.9133}},
        "export": {"metrics": {"ndcg@10": 0.6416, "mrr@10": 0.6021, "recall@100": 0.8874}}}}))
    lines = render_measured_here(tmp_path)
    assert lines[2] == "| BM25 (bm25s, as above) | 0.676 | 0.641 | 0.913 |"
    assert lines[3] == "| ColBERT, untrained head (random 128-d projection, seed 12345) | - | - | - |"
    assert lines[4] == ("| ColBERT, `configs/presets/cpu.yaml` (64 steps x 32 MS MARCO triples) | 0.642 | 0.602 | "
                        "0.887 |")
    assert lines[8] == "- BM25 and ColBERT: `results/demo/metrics.json` from `make demo DEMO_RESULTS=results/demo`"
    assert lines[9].startswith("- untrained head: `results/demo-untrained/metrics.json` from `python evaluate.py")
    assert lines[9].endswith(", not measured yet")

    demo.write_text(json.dumps({"results": {"export": {"metrics": {}}}}))
    with pytest.raises(UserError, match=r"results/demo/metrics.json: no bm25 run among export"):
        render_measured_here(tmp_path)


def test_marker_mistakes_are_one_line(tmp_path, capsys):
    for text, message in (("<!-- table: nope -->\n<!-- /table -->\n", "unknown table nope"),
                          ("<!-- table: measured-here -->\n| x |\n", "has no <!-- /table -->"),
                          ("<!-- /table -->\n", "without a table marker")):
        with pytest.raises(UserError, match=message):
            table_blocks(text)
    (tmp_path / README).write_text("<!-- table: nope -->\n<!-- /table -->\n")
    assert main(["--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown table nope" in err[0]
