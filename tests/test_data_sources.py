"""The training data is one setting, ``data.source``: a reader chosen by ``class_path`` (hil.data.examples.
ExampleReader). The spelling before 0.3 -- a key per reader and per reader setting (``data.triples``,
``data.run_depth``, ...) -- still works until 0.4.0 (hil.data.old_source_keys): each old key means the reader it
names, with one deprecation line naming the new spelling; the old refusals stay; in ``hil fit`` the config files are
read in their order and ``--print_config`` prints the new spelling, which fed back is the same run."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from hil.data.datamodule import TrainingDataModule
from hil.data.nway_files import NWayExamples
from hil.data.old_source_keys import source_from_old_keys
from hil.data.run_examples import TrecRun
from hil.data.triples_file import TextTriples
from hil.errors import UserError

TEXTS = {"queries": "q.tsv", "collection": "c.tsv"}
RUN_SETTINGS = {"qrels": "qrels.tsv", "run_depth": 5, "run_selection": "sample", "run_positives": "first",
                "run_targets": "qrels", "relevance_level": 2, "short_queries": "skip"}
# old keyword arguments -> the reader they mean (class name, settings)
OLD_TO_NEW = [
    ({"triples": "t.tsv"}, ("hil.data.triples_file.TextTriples", {"path": "t.tsv"})),
    ({"id_triples": "i.tsv", **TEXTS}, ("hil.data.triples_file.IdTriples", {"path": "i.tsv", **TEXTS})),
    ({"beir": "scifact", "beir_split": "dev", "negatives_per_query": 2, "bm25_depth": 50},
     ("hil.data.triples.MinedTriples", {"dataset": "scifact", "split": "dev", "negatives_per_query": 2, "depth": 50})),
    ({"nway_examples": "e.jsonl", **TEXTS}, ("hil.data.nway_files.NWayExamples", {"path": "e.jsonl", **TEXTS})),
    ({"run": "r.trec", **TEXTS, **RUN_SETTINGS},
     ("hil.data.run_examples.TrecRun", {"path": "r.trec", **TEXTS, "qrels": "qrels.tsv", "depth": 5,
                                        "selection": "sample", "positives": "first", "targets": "qrels",
                                        "relevance_level": 2, "short_queries": "skip"})),
    ({"pylate": "p.parquet", **TEXTS}, ("hil.data.pylate_files.PyLateExamples", {"path": "p.parquet", **TEXTS})),
    ({"triples": None, "teacher_output": "out.jsonl", "run_selection": "top", "bm25_depth": 100},  # old defaults
     ("hil.data.teacher_output.TeacherOutput", {"path": "out.jsonl"})),
]


@pytest.mark.parametrize("old, new", OLD_TO_NEW, ids=[next(k for k, v in o.items() if v) for o, _ in OLD_TO_NEW])
def test_each_old_key_means_the_reader_it_names(old, new):
    class_path, settings = new
    record, line = source_from_old_keys(old, None)
    assert record == {"class_path": class_path, "init_args": settings}
    assert line.startswith(f"data.{', data.'.join(old)} ") and "deprecated (removed in 0.4.0): write data.source:" \
        in line and class_path in line
    # the reader's own constructor takes exactly those settings
    module, _, name = class_path.rpartition(".")
    reader = getattr(__import__(module, fromlist=[name]), name)(**settings)
    assert reader.record() == {"class_path": class_path, "init_args": {**reader.settings(), **settings}}


def test_an_old_setting_applies_to_the_reader_already_chosen():
    """``data.run_depth`` alone (e.g. on the command line) changes the run that a config chose as ``data.source``;
    over another reader it is refused unless at its old default (the data module then passed every setting)."""
    run = {"class_path": "hil.data.run_examples.TrecRun", "init_args": {"path": "r", **TEXTS, "depth": None}}
    assert source_from_old_keys({"run_depth": 7}, run)[0]["init_args"] == {"path": "r", **TEXTS, "depth": 7}
    triples = {"class_path": "hil.data.triples_file.TextTriples", "init_args": {"path": "t"}}
    assert source_from_old_keys({"run_depth": None, "triples": None}, triples)[0] == triples
    with pytest.raises(UserError, match="data.run_depth only applies to TrecRun, not to TextTriples"):
        source_from_old_keys({"run_depth": 7}, triples)
    with pytest.raises(UserError, match="data.bm25_depth only applies to MinedTriples, not to NWayExamples"):
        source_from_old_keys({"nway_examples": "e", **TEXTS, "bm25_depth": 10}, None)


@pytest.mark.parametrize("old, message", [
    ({"triples": "t", "nway_examples": "e", **TEXTS}, r"exactly one of .* got \['triples', 'nway_examples'\]"),
    ({"nway_examples": "e", "queries": "q"}, "`nway_examples`, `queries` and `collection` go together"),
    ({"triples": "t", **TEXTS}, "`queries` and `collection` go together with `id_triples`"),
    ({"teacher_output": "o", "collection": "c"}, "reads `queries` and `collection` from its .meta.json"),
    ({"triples": None}, "data.source: give the training data's reader"),
])
def test_the_old_refusals_stay(old, message):
    with pytest.raises(UserError, match=message):
        source_from_old_keys(old, None)


def test_the_data_module_reads_old_keyword_arguments_with_a_warning(tmp_path):
    """``TrainingDataModule(triples=...)`` is ``TrainingDataModule(TextTriples(...))``, and says so; the old
    arguments replace a ``source`` given beside them, as an old key in a later config file did."""
    with pytest.warns(DeprecationWarning, match=r"data.triples is deprecated .* write data.source: .*TextTriples"):
        old = TrainingDataModule(triples="t.tsv", batch_size=4)
    assert old.reader == TextTriples("t.tsv") and old.hparams == TrainingDataModule(TextTriples("t.tsv"),
                                                                                   batch_size=4).hparams
    with pytest.warns(DeprecationWarning):
        nway = TrainingDataModule(TextTriples("t.tsv"), nway_examples="e.jsonl", **TEXTS, nway=3)
    assert nway.reader == NWayExamples("e.jsonl", "q.tsv", "c.tsv") and nway.hparams.nway == 3
    with pytest.raises(TypeError, match="unexpected arguments colour"):
        TrainingDataModule(TextTriples("t.tsv"), colour="red")


def test_a_reader_is_checked_when_the_data_module_is_made():
    """Settings that cannot work are refused before any file is opened or model loaded."""
    with pytest.raises(UserError, match="TrecRun needs data.nway"):
        TrainingDataModule(TrecRun("r.trec", "q.tsv", "c.tsv"))
    with pytest.raises(UserError, match="needs qrels"):
        TrainingDataModule(TrecRun("r.trec", "q.tsv", "c.tsv", positives="first"), nway=2)
    with pytest.raises(UserError, match="data.nway applies to n-way examples; TextTriples"):
        TrainingDataModule(TextTriples("t.tsv"), nway=2)
    with pytest.raises(UserError, match=r"data.source: give the reader .* \(got dict\)"):
        TrainingDataModule({"class_path": "hil.data.triples_file.TextTriples"})


# -- through hil fit ---------------------------------------------------------------------------------------------------

def printed(capsys, *configs: str) -> tuple[dict, str]:
    """``hil fit <configs> --print_config``: the printed config and what went to stderr."""
    from hil.cli.train import train_main

    capsys.readouterr()
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit) as done:
        train_main(["fit", *configs, "--print_config"])
    assert done.value.code in (0, None)
    return yaml.safe_load(buffer.getvalue()), capsys.readouterr().err


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_old_config_files_are_read_in_their_order_and_printed_in_the_new_spelling(tmp_path, capsys, shared_dir):
    """An old file (``data.triples: null``, ``data.teacher_output``) between new ones: a later file's reader wins,
    as a later file's key did, and an earlier one's is replaced; a file holding only a reader's setting changes the
    reader the files before chose. Each old file is one deprecation line naming the new spelling; the printed
    config, fed back, prints the same."""
    old = write(tmp_path / "old.yaml", "data: {triples: null, teacher_output: distill/examples.jsonl, batch_size: 8}\n")
    teacher = {"class_path": "hil.data.teacher_output.TeacherOutput", "init_args": {"path": "distill/examples.jsonl"}}
    config, err = printed(capsys, "--config", "colbert", "--config", old)
    assert config["data"]["source"] == teacher and config["data"]["batch_size"] == 8
    warnings = [line for line in err.splitlines() if "deprecated" in line]
    assert warnings == ['hil fit: warning: data.triples, data.teacher_output are deprecated (removed in 0.4.0): '
                        'write data.source: {"class_path": "hil.data.teacher_output.TeacherOutput", "init_args": '
                        '{"path": "distill/examples.jsonl"}}'], err
    later, _ = printed(capsys, "--config", "colbert", "--config", old, "--config", "presets/smoke")
    assert later["data"]["source"] == {"class_path": "hil.data.triples_file.TextTriples",
                                       "init_args": {"path": "msmarco/triples.train.small.head1000.tsv"}}
    new, err = printed(capsys, "--config", "colbert", "--config", "variants/colbert_distill")
    assert "deprecated" not in err and new["data"]["source"] == teacher
    run = write(tmp_path / "run.yaml", "data:\n  source:\n    class_path: hil.data.run_examples.TrecRun\n"
                "    init_args: {path: r.trec, queries: q.tsv, collection: c.tsv}\n  nway: 4\n")
    depth = write(tmp_path / "depth.yaml", "data: {run_depth: 9}\n")
    deeper, _ = printed(capsys, "--config", "colbert", "--config", run, "--config", depth)
    assert deeper["data"]["source"]["init_args"]["depth"] == 9
    assert printed(capsys, "--config", write(tmp_path / "printed.yaml", yaml.safe_dump(deeper)))[0] == deeper
    line, _ = printed(capsys, "--config", "colbert", "--config", run, "--data.run_depth", "3")
    assert line["data"]["source"]["init_args"]["depth"] == 3


def test_a_readers_settings_are_typed_on_the_command_line(tmp_path, capsys, shared_dir):
    """A reader's ``__init__`` types are its settings' types in ``hil fit``: a value outside them is one line, exit 2,
    when the command line is parsed (before any model loads), naming the setting; ``--help`` shows no setting
    unvalidated."""
    from hil.cli.train import train_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        train_main(["fit", "--config", "colbert", "--data.source", "TrecRun", "--data.source.path", "r.trec",
                    "--data.source.queries", "q.tsv", "--data.source.collection", "c.tsv", "--data.source.selection",
                    "random", "--trainer.default_root_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and 'key "selection": Expected a typing.Literal' in err and "random" in err, err
    assert "Loading weights" not in err
    with pytest.raises(SystemExit):
        train_main(["fit", "--data.source.help", "TrecRun"])
    shown = capsys.readouterr().out
    assert "--data.source.depth" in shown and "Unvalidated" not in shown


def test_every_documented_fit_command_parses_in_the_new_spelling(capsys, shared_dir):
    """Each ``hil fit`` / ``train.py fit`` line of the README's and docs/guide.md's command blocks resolves
    (``--print_config``) without a deprecation line: the documents spell the training data as ``data.source``."""
    import re
    import shlex

    root = Path(__file__).resolve().parents[1]
    text = "\n".join((root / name).read_text(encoding="utf-8") for name in ("README.md", "docs/guide.md"))
    commands = {}
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            start = 2 if argv[:1] == ["python"] else 1
            if argv[:3] == ["python", "train.py", "fit"] or argv[:2] == ["hil", "fit"]:
                commands[line] = [a for a in argv[start + 1:] if a != "--print_config"]
    assert len(commands) >= 12 and any("--data.source" in argv for argv in commands.values())
    for line, argv in commands.items():
        config, err = printed(capsys, *argv)
        assert "deprecated" not in err and config["data"]["source"]["class_path"].startswith("hil.data."), line


def test_mined_triples_are_what_bm25_mining_gives_with_the_data_seed(tmp_path):
    """``MinedTriples`` through the data module: the triples ``mine_bm25_triples`` gives for the split, the reader's
    negatives and depth, and ``data.seed``, cut to ``data.max_triples``."""
    import json

    from hil.data.beir import load_beir
    from hil.data.triples import MinedTriples, mine_bm25_triples

    folder = tmp_path / "mini"
    (folder / "qrels").mkdir(parents=True)
    words = ["cats purr", "dogs bark", "cats and dogs", "birds sing", "fish swim", "cats sleep", "dogs run far",
             "birds and cats", "fish and dogs", "cats climb trees"]
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n"
                                                 for i, text in enumerate(words)), encoding="utf-8")
    queries = {"q1": "cats", "q2": "dogs", "q3": "birds"}
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td0\t1\nq2\td1\t1\nq3\td3\t1\n")

    def mined(seed: int) -> list:
        return mine_bm25_triples(load_beir(str(folder), split="train"), negatives_per_query=2, depth=8, seed=seed)

    data = TrainingDataModule(MinedTriples(str(folder), negatives_per_query=2, depth=8), max_triples=4, seed=7)
    data.setup("fit")
    assert list(data.train_dataset) == mined(7)[:4] and len(mined(7)) == 5 and mined(7) != mined(12345)
    assert data.describe_source() == (f"data.source=MinedTriples(dataset={folder}, split=train, "
                                      f"negatives_per_query=2, depth=8)")
