"""Where each kind of change goes (docs/design.md), shown by making each change outside the package:

- a new loss = one file (a ``Term``) + a config naming it by ``class_path``: it trains, and the export records it;
- a new index back-end = one file (its ``IndexConfig`` / ``SearchConfig`` beside its ``SearchBackend``, registered
  by being defined) + a recipe: ``hil evaluate`` builds, records and searches it, with no line of the package
  changed;
- a new metric = one entry in one file (``hil/evaluation/metrics.py``'s measure tables), equal to pytrec_eval's;
- a new training data reader = one file (an ``ExampleReader``: its typed settings and ``open``) named by
  ``class_path`` as ``data.source`` in a config: ``hil fit`` trains from it, records it, and prints it in a config
  that, fed back, is the same run, with no line of the package changed.

Broken on purpose, each failing here: back-end classes not registered when defined (``__init_subclass__``), a term
not called, the metric table entry left out, the data module opening anything but its ``data.source``.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import pytrec_eval

from hil.retrieval.backends.configs import REGISTRY

NEW_LOSS = '''
import torch
from hil.modeling.terms import LossOutput, Term


class ScoreHinge(Term):
    """max(0, margin - s(q, d+) + s(q, d-)) over every negative, summed over heads."""

    def __init__(self, weight: float = 1.0, margin: float = 1.0):
        super().__init__(weight)
        self.margin = float(margin)

    def forward(self, encoder, batch):
        scores = sum(batch.head_scores(encoder).values())  # (B, N)
        value = torch.relu(self.margin - scores[:, :1] + scores[:, 1:]).mean()
        return LossOutput(value, {"hinge": value.detach()})
'''

NEW_BACKEND = '''
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from hil.retrieval.backends.base import Candidates, SearchBackend
from hil.retrieval.backends.configs import IndexConfig, SearchConfig


@dataclass(frozen=True)
class EveryDocIndexConfig(IndexConfig):
    kind: ClassVar[str] = "every_doc"
    note: str = "nothing stored"


@dataclass(frozen=True)
class EveryDocSearchConfig(SearchConfig):
    kind: ClassVar[str] = "every_doc"
    limit: int | None = None  # at most this many documents (the first by row), None: all


class EveryDocBackend(SearchBackend):
    """Proposes every document (or the first ``limit``) to every head: exact search by another road."""

    kind = "every_doc"
    index_config = EveryDocIndexConfig
    search_config = EveryDocSearchConfig
    stores_files = False

    @classmethod
    def resolve_params(cls, config, n_tokens, dim) -> dict[str, Any]:
        return {"note": cls.check_config(config).note}

    @classmethod
    def factory(cls, params) -> str:
        return "EveryDoc"

    def candidates(self, queries, heads):
        n = self.index.n_docs if self.search.limit is None else min(self.search.limit, self.index.n_docs)
        docs = np.arange(n, dtype=np.int64)
        return [Candidates(docs, np.ones((n, len(heads)), dtype=bool)) for _ in range(len(queries))]
'''


NEW_READER = '''
from dataclasses import dataclass

from hil.data.examples import ExampleReader, ReadSettings, ScoredExample


class TabExamples(list):
    """Examples held in a list: indexed, as training reads them."""

    def iter_queries(self):
        return (example.query for example in self)

    def iter_passages(self):
        return (text for example in self for text in example.documents)

    def describe(self):
        return f"{len(self)} tab examples"


def _table(path):
    return dict(line.split("\\t") for line in path.read_text(encoding="utf-8").splitlines())


@dataclass(frozen=True)
class TabFile(ExampleReader):
    """``qid TAB pid TAB pid ...`` a line, the positive first, no scores; the texts in ``id TAB text`` files.

    Args:
        path: the examples.
        queries: the query texts.
        collection: the passage texts.
    """

    path: str
    queries: str
    collection: str

    def open(self, read: ReadSettings) -> TabExamples:
        queries, texts = _table(read.file("queries", self.queries)), _table(read.file("collection", self.collection))
        rows = [line.split("\\t") for line in read.file("path", self.path).read_text(encoding="utf-8").splitlines()]
        n = read.nway
        return TabExamples(ScoredExample(queries[row[0]], tuple(texts[pid] for pid in row[1:][:n]), None,
                                         (row[0], *row[1:][:n])) for row in rows[:read.limit])
'''

@pytest.fixture
def outside(tmp_path, monkeypatch):
    """A folder outside the package on ``sys.path``, with the new modules written into it."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "my_loss.py").write_text(textwrap.dedent(NEW_LOSS))
    (folder / "my_backend.py").write_text(textwrap.dedent(NEW_BACKEND))
    (folder / "my_reader.py").write_text(textwrap.dedent(NEW_READER))
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in ("my_loss", "my_backend", "my_reader"):
        sys.modules.pop(name, None)
    REGISTRY.pop("every_doc", None)  # defined again (a new class) by the next test that imports it


@pytest.mark.integration
def test_a_new_loss_is_one_file_and_a_config(outside, tmp_path, shared_dir):
    from hil.cli.train import train_main

    delta = outside / "hinge.yaml"
    delta.write_text("model:\n  loss:\n    class_path: my_loss.ScoreHinge\n    init_args: {margin: 0.5}\n")
    cli = train_main(["fit", "--config", "colbert", "--config", str(delta), "--config", "presets/smoke",
                      "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
                      "--trainer.max_steps", "2", "--trainer.enable_checkpointing", "false",
                      "--trainer.callbacks", "[]", "--export_dir", str(tmp_path / "export")])
    assert type(cli.model.loss).__module__ == "my_loss" and cli.model.loss.margin == 0.5
    assert cli.trainer.global_step == 2
    recorded = json.loads((tmp_path / "export" / "hil_config.json").read_text())["training"]["loss"]
    assert recorded["class"] == "my_loss.ScoreHinge"


@pytest.mark.integration
def test_a_new_backend_is_one_file_and_a_recipe(outside, tmp_path, tiny_model_dir):
    from hil.cli.main import main as hil_main

    recipe = outside / "every_doc.yaml"
    recipe.write_text("settings:\n  backend: {class_path: my_backend.EveryDocIndexConfig}\n"
                      "  search: {class_path: my_backend.EveryDocSearchConfig, init_args: {limit: null}}\n")
    common = ["--model", f"tiny={tiny_model_dir}", "--datasets", json.dumps([{"name": "scifact", "max_queries": 5,
                                                                               "max_docs": 60}]),
              "--settings.index_root", str(tmp_path / "indexes"), "--settings.progress", "false",
              "--settings.k", "10", "--statistics.enabled", "false", "--quiet", "true", "--folders", "flat"]
    assert hil_main(["evaluate", "--config", str(recipe), *common, "--output", str(tmp_path / "new")]) == 0
    assert hil_main(["evaluate", *common, "--settings.mode", "exhaustive", "--settings.index_root", "null",
                     "--output", str(tmp_path / "exact")]) == 0
    new = json.loads((tmp_path / "new" / "metrics.json").read_text())
    exact = json.loads((tmp_path / "exact" / "metrics.json").read_text())
    assert new["results"]["tiny"]["metrics"] == pytest.approx(exact["results"]["tiny"]["metrics"])
    assert new["results"]["tiny"]["search_stats"]["search"] == {"backend": "every_doc", "limit": None}
    assert new["settings"]["evaluation"]["backend"]["class_path"] == "my_backend.EveryDocIndexConfig"
    (index_json,) = (tmp_path / "indexes").rglob("index.json")
    assert json.loads(index_json.read_text())["backend"]["kind"] == "every_doc"
    # evaluate.py names it by its kind (its --backend choices are the registry's, read when the line is parsed)
    from hil.cli.evaluate_script import main as evaluate_script

    script = ["--model", str(tiny_model_dir), "--dataset", "scifact", "--max-queries", "5", "--max-docs", "60",
              "--k", "10", "--no-bm25", "--no-stats", "--quiet", "--index-root", str(tmp_path / "indexes")]
    assert evaluate_script([*script, "--backend", "every_doc", "--output", str(tmp_path / "script")]) == 0
    assert evaluate_script([*script, "--mode", "exhaustive", "--output", str(tmp_path / "script-exact")]) == 0
    by_kind, script_exact = (json.loads(next((tmp_path / name).rglob("metrics.json")).read_text())
                             for name in ("script", "script-exact"))
    (column,) = by_kind["results"].values()
    assert column["search_stats"]["search"] == {"backend": "every_doc", "limit": None}
    assert column["metrics"] == pytest.approx(next(iter(script_exact["results"].values()))["metrics"])


def test_a_new_backend_is_among_every_commands_backend_choices(outside, capsys):
    """evaluate.py, ``hil beir`` and ``hil analyze`` read their ``--backend`` choices from the registry when a
    command line is parsed: a back-end defined after their parsers were built, outside the package, is accepted by
    each and listed in its ``--help``."""
    from hil.cli import analyze, beir, evaluate_script

    parsers = {"evaluate.py": (evaluate_script.build_parser(), ["--model", "m", "--dataset", "scifact"]),
               "hil beir": (beir.build_parser(), ["--model", "m", "--datasets", "scifact"]),
               "hil analyze": (analyze.build_parser(), ["--model", "m", "--dataset", "scifact", "--output", "o"])}
    for name, (parser, argv) in parsers.items():
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--backend", "every_doc"])
        assert "every_doc" in capsys.readouterr().err, name
    import my_backend  # noqa: F401  (defining its back-end registers it)

    for name, (parser, argv) in parsers.items():
        assert parser.parse_args([*argv, "--backend", "every_doc"]).backend == "every_doc", name
        assert "every_doc" in parser.format_help(), name


def test_a_new_metric_is_one_entry_in_one_file(monkeypatch):
    import hil.evaluation.metrics as metrics

    monkeypatch.setitem(metrics._FULL_MEASURES, "bpref", "bpref")  # the whole change
    qrels = {"q1": {"a": 1, "b": 0, "c": 2}, "q2": {"b": 1}}
    run = {"q1": {"a": 0.2, "b": 0.9, "c": 0.5}, "q2": {"a": 3.0, "b": 2.0}}
    aggregate, per_query = metrics.evaluate_run(qrels, run, ["bpref"])
    direct = pytrec_eval.RelevanceEvaluator(qrels, {"bpref"}).evaluate(run)
    assert {q: v["bpref"] for q, v in per_query.items()} == pytest.approx({q: direct[q]["bpref"] for q in qrels})


@pytest.mark.integration
def test_a_new_training_data_reader_is_one_file_named_by_class_path(outside, tmp_path, shared_dir, capsys):
    """A format of ``qid TAB pid TAB pid ...`` lines defined outside the package (``my_reader.TabFile``), named by
    ``class_path`` in a config: ``hil fit`` trains from its examples (cut to ``data.nway``), records the reader it
    read, and ``--print_config`` prints a config that, fed back, is the same run."""
    from hil.cli.train import train_main

    (tmp_path / "q.tsv").write_text("q1\twhat is isotropy\nq2\tmaxsim over tokens\n", encoding="utf-8")
    (tmp_path / "c.tsv").write_text("a\tuniform directions\nb\tlate interaction\nc\tbm25 ranks terms\n",
                                    encoding="utf-8")
    (tmp_path / "ex.tab").write_text("q1\ta\tc\tb\nq2\tb\ta\tc\n", encoding="utf-8")
    delta = outside / "tab.yaml"
    delta.write_text(f"data:\n  source:\n    class_path: my_reader.TabFile\n    init_args: {{path: {tmp_path}/ex.tab, "
                     f"queries: {tmp_path}/q.tsv, collection: {tmp_path}/c.tsv}}\n  nway: 2\n  batch_size: 2\n")
    run = ["--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
           "--trainer.callbacks", "[]"]

    def fit(*configs: str, root: str) -> object:
        return train_main(["fit", *configs, *run, "--trainer.default_root_dir", str(tmp_path / root)])

    cli = fit("--config", "colbert", "--config", "presets/smoke", "--config", str(delta), root="run")
    assert type(cli.datamodule.reader).__module__ == "my_reader" and cli.trainer.global_step == 2
    dataset = cli.datamodule.train_dataset
    assert [(e.query, e.documents) for e in dataset] == [
        ("what is isotropy", ("uniform directions", "bm25 ranks terms")),
        ("maxsim over tokens", ("late interaction", "uniform directions"))]
    assert cli.datamodule.hparams.source == {"class_path": "my_reader.TabFile", "init_args": {
        "path": f"{tmp_path}/ex.tab", "queries": f"{tmp_path}/q.tsv", "collection": f"{tmp_path}/c.tsv"}}

    def printed(*configs: str) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            train_main(["fit", *configs, *run, "--print_config"])
        assert done.value.code in (0, None)
        return capsys.readouterr().out

    first = printed("--config", "colbert", "--config", "presets/smoke", "--config", str(delta))
    assert "class_path: my_reader.TabFile" in first
    (tmp_path / "printed.yaml").write_text(first)
    assert printed("--config", str(tmp_path / "printed.yaml")) == first
    again = fit("--config", str(tmp_path / "printed.yaml"), root="again")
    assert [(e.query, e.documents) for e in again.datamodule.train_dataset] == [(e.query, e.documents)
                                                                                for e in dataset]
    assert again.datamodule.hparams == cli.datamodule.hparams and again.trainer.global_step == 2

