"""``hil teacher``: the written scores are the teacher's, computed here by hand pair by pair
(a random tiny cross-encoder built from the shared tiny BERT's config, a random tiny ColBERT, a random tiny dense
encoder); the candidates are the miner's; the positive leads when asked; every format reads back through the
training readers; bad options and files are one line and exit 2, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hil.cli import teacher as teacher_cli
from hil.data.bm25 import BM25Index
from hil.data.nway_files import NWayFile
from hil.data.pylate_files import open_pylate
from hil.data.run_examples import RunExamples, RunSettings
from hil.experiments import teacher

QUERIES = {"q1": "which animals eat fish", "q2": "fast animals that run", "q3": "animals near ocean tides"}
DOCS = {"d1": "cats are animals that eat fish and mice", "d2": "dogs are fast animals and run in parks",
        "d3": "the moon pulls ocean tides where animals swim", "d4": "animals such as cats and dogs eat food",
        "d5": "cheetahs are the fastest animals on land", "d6": "tides rise and seabirds and other animals feed",
        "d7": "quantum chromodynamics of quarks"}


@pytest.fixture
def texts(tmp_path) -> dict[str, Path]:
    queries, collection = tmp_path / "queries.tsv", tmp_path / "collection.tsv"
    queries.write_text("".join(f"{k}\t{v}\n" for k, v in QUERIES.items()), encoding="utf-8")
    collection.write_text("".join(f"{k}\t{v}\n" for k, v in DOCS.items()), encoding="utf-8")
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("q1\td1\t1\nq3\td7\t2\nq3\td3\t1\n", encoding="utf-8")
    return {"queries": queries, "collection": collection, "qrels": qrels}


@pytest.fixture
def cross_encoder(tmp_path, tiny_model_dir, hf_tokenizer) -> Path:
    """A randomly initialised one-label cross-encoder with the shared tiny BERT's config and tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig.from_pretrained(tiny_model_dir, num_labels=1))
    folder = tmp_path / "cross-encoder"
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return folder


def run_teacher(texts: dict[str, Path], output: Path, *extra: str) -> int:
    return teacher_cli.main(["--queries", str(texts["queries"]), "--collection", str(texts["collection"]),
                         "--output", str(output), "--quiet", "--device", "cpu", *extra])


def written(path: Path) -> dict[str, list[tuple[str, float]]]:
    """The ColBERTv2 lines as plain JSON, independently of the readers."""
    lines = {}
    for text in path.read_text(encoding="utf-8").splitlines():
        qid, *pairs = json.loads(text)
        lines[str(qid)] = [(str(pid), score) for pid, score in pairs]
    return lines


def test_cross_encoder_scores_are_its_logits(tmp_path, texts, cross_encoder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    output = tmp_path / "out" / "ce.jsonl"
    assert run_teacher(texts, output, "--teacher", str(cross_encoder), "--depth", "5", "--nway", "4",
                       "--batch-size", "3") == 0
    lines = written(output)
    model = AutoModelForSequenceClassification.from_pretrained(cross_encoder).eval()
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    bm25 = BM25Index.build(list(DOCS), list(DOCS.values())).search(list(QUERIES.values()), 5)
    assert set(lines) == set(QUERIES)
    for (qid, pairs), hits in zip(lines.items(), bm25):
        assert len(pairs) == 4 and {pid for pid, _ in pairs} <= {pid for pid, _ in hits}  # the miner's candidates
        with torch.no_grad():  # one pair at a time, no padding
            by_hand = {pid: model(**tokenizer(QUERIES[qid], DOCS[pid], return_tensors="pt")).logits[0, 0].item()
                       for pid, _ in hits}
        assert [pid for pid, _ in pairs] == sorted(by_hand, key=lambda p: -by_hand[p])[:4]  # the teacher's best
        for pid, score in pairs:
            assert score == pytest.approx(by_hand[pid], abs=1e-5)
    meta = json.loads(output.with_name("ce.jsonl.meta.json").read_text())
    assert meta["teacher"]["kind"] == "cross-encoder" and meta["miner"]["miner"] == "bm25"
    assert meta["settings"]["nway"] == 4 and "torch" in meta["versions"] and meta["counts"]["written"] == 3
    examples = NWayFile(output, texts["queries"], texts["collection"])  # the round trip
    assert [(e.ids[0], e.ids[1:], e.scores) for e in (examples[i] for i in range(len(examples)))] == \
        [(qid, tuple(p for p, _ in pairs), tuple(s for _, s in pairs)) for qid, pairs in lines.items()]


def test_colbert_teacher_and_model_miner(tmp_path, texts, tiny_random_colbert):
    """A hil model as miner (exact ranking of the whole collection) and as teacher (``encoder.score``)."""
    folder = tiny_random_colbert.save_pretrained(tmp_path / "colbert")
    output = tmp_path / "colbert.jsonl"
    assert run_teacher(texts, output, "--teacher", str(folder), "--miner", str(folder), "--depth", "4",
                       "--nway", "3") == 0
    lines = written(output)
    encoder = tiny_random_colbert.eval()
    with torch.no_grad():
        for qid, pairs in lines.items():
            query = encoder.encode_queries([QUERIES[qid]])
            by_hand = {pid: encoder.score(query, encoder.encode_documents([text]))[0, 0].item()
                       for pid, text in DOCS.items()}
            best = sorted(by_hand, key=lambda p: -by_hand[p])
            assert [pid for pid, _ in pairs] == best[:3]  # mined top 4 by the model, then its 3 best
            for pid, score in pairs:
                assert score == pytest.approx(by_hand[pid], abs=1e-5)
    meta = json.loads(output.with_name("colbert.jsonl.meta.json").read_text())
    assert meta["teacher"]["kind"] == "colbert" and meta["miner"]["search"] == "exact, in memory"


def test_dense_teacher_is_mean_pooled_cosine(tmp_path, texts, hf_tokenizer):
    from conftest import random_bert

    folder = tmp_path / "dense"
    model = random_bert(seed=3)
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    output = tmp_path / "dense.jsonl"
    assert run_teacher(texts, output, "--teacher", str(folder), "--teacher-kind", "dense", "--depth", "3",
                       "--nway", "2") == 0

    def vector(text: str) -> torch.Tensor:  # a loop over tokens: the mean of the real ones, then unit length
        encoded = hf_tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            hidden = model.eval()(**encoded).last_hidden_state[0]
        total = sum(hidden[i] for i in range(hidden.shape[0]))
        return F.normalize(total / hidden.shape[0], dim=0)

    for qid, pairs in written(output).items():
        for pid, score in pairs:
            assert score == pytest.approx(float(vector(QUERIES[qid]) @ vector(DOCS[pid])), abs=1e-5)


def test_positive_first_even_when_the_miner_missed_it(tmp_path, texts, cross_encoder):
    output = tmp_path / "positives.jsonl"
    assert run_teacher(texts, output, "--teacher", str(cross_encoder), "--depth", "5", "--nway", "3",
                       "--qrels", str(texts["qrels"]), "--positives", "first") == 0
    lines = written(output)
    assert set(lines) == {"q1", "q3"}  # q2 has no judged positive: left out
    assert lines["q1"][0][0] == "d1"
    assert lines["q3"][0][0] == "d7"  # grade 2, not among BM25's candidates (no word in common): added
    assert "d3" not in [pid for pid, _ in lines["q3"][1:]]  # another judged positive is no negative
    meta = json.loads(output.with_name("positives.jsonl.meta.json").read_text())
    assert meta["counts"]["without_positive"] == 1 and meta["counts"]["left_out"] == 1


@pytest.mark.parametrize("fmt", ["pylate", "trec"])
def test_other_formats_read_back(tmp_path, texts, cross_encoder, fmt):
    reference, output = tmp_path / "ref.jsonl", tmp_path / f"out.{fmt}"
    common = ["--teacher", str(cross_encoder), "--depth", "5", "--nway", "3"]
    assert run_teacher(texts, reference, *common) == 0
    assert run_teacher(texts, output, *common, "--format", fmt) == 0
    expected = NWayFile(reference, texts["queries"], texts["collection"])
    if fmt == "pylate":
        found = open_pylate(output, texts["queries"], texts["collection"])
    else:
        found = RunExamples(output, texts["queries"], texts["collection"], RunSettings(3))
    assert [found[i] for i in range(len(found))] == [expected[i] for i in range(len(expected))]


def test_beir_dataset_writes_its_texts(tmp_path, cross_encoder):
    folder = tmp_path / "mini"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "T" if k == "d2" else "",
                                                             "text": v + ("\nmore" if k == "d1" else "")}) + "\n"
                                                 for k, v in DOCS.items()), encoding="utf-8")
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n"
                                                  for k, v in {**QUERIES, "d4": "animals eat"}.items()))
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\nd4\td1\t1\n")
    output = tmp_path / "beir.jsonl"
    assert teacher_cli.main(["--dataset", str(folder), "--teacher", str(cross_encoder), "--output", str(output),
                         "--depth", "5", "--nway", "3", "--quiet", "--device", "cpu"]) == 0
    lines = written(output)
    assert set(lines) == {"q1", "q2", "d4"} and "d4" not in [pid for pid, _ in lines["d4"]]  # no self match
    examples = NWayFile(output, tmp_path / "beir.queries.tsv", tmp_path / "beir.collection.tsv")
    # BEIR's "title text"; a line break inside a text becomes a space in the written collection
    expected = {pid: ("T " if pid == "d2" else "") + text + (" more" if pid == "d1" else "")
                for pid, text in DOCS.items()}
    for example in (examples[i] for i in range(len(examples))):
        assert example.query == {**QUERIES, "d4": "animals eat"}[example.ids[0]]
        assert list(example.documents) == [expected[pid] for pid in example.ids[1:]]


@pytest.mark.parametrize("options,message", [
    (["--nway", "1"], "--nway must be >= 2"),
    (["--nway", "8", "--depth", "4"], "--nway 8 is more than the --depth 4"),
    (["--depth", "0"], "--depth must be >= 1"),
    (["--positives", "first"], "--positives first needs judgments"),
    (["--dataset", "scifact"], "give --dataset, or --queries with --collection"),
    (["--device", "tpu"], "--device: device 'tpu'"),
    (["--teacher-kind", "magic"], 'Parser key "teacher_kind"'),
])
def test_option_errors_are_one_line(tmp_path, texts, cross_encoder, capsys, options, message):
    output = tmp_path / "x.jsonl"
    try:
        code = run_teacher(texts, output, "--teacher", str(cross_encoder), *options)
    except SystemExit as stop:  # argparse's own refusals (OneLineParser: one line, status 2)
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and message in err, err
    assert not output.exists() and not list(tmp_path.glob("x.jsonl*"))


def test_bad_files_and_models_are_one_line(tmp_path, texts, cross_encoder, tiny_model_dir, capsys):
    texts["queries"].write_text("q1\tfine\nq2 no tab here\n", encoding="utf-8")
    output = tmp_path / "x.jsonl"
    assert run_teacher(texts, output, "--teacher", str(cross_encoder)) == 2
    err = capsys.readouterr().err
    assert f"{texts['queries']}:2:" in err and err.count("\n") == 1
    texts["queries"].write_text("q1\tanimals\n", encoding="utf-8")
    assert teacher_cli.main(["--dataset", "scifact", "--collection", "c.tsv", "--teacher", "t", "--output", "o"]) == 2
    assert "--dataset brings its corpus and qrels" in capsys.readouterr().err
    assert teacher_cli.main(["--queries", "q.tsv", "--teacher", "t", "--output", "o"]) == 2
    assert "--queries needs --collection" in capsys.readouterr().err
    assert run_teacher(texts, output, "--teacher", str(tiny_model_dir), "--nway", "2") == 2  # auto: a bare backbone
    assert "--teacher_kind dense or cross-encoder" in capsys.readouterr().err
    assert run_teacher(texts, output, "--teacher", str(tmp_path / "nowhere")) == 2
    assert "nowhere" in capsys.readouterr().err
    assert not list(tmp_path.glob("x.jsonl*"))


def test_colbert_lines_hold_integer_ids_as_integers():
    """Stanford's examples files hold integer ids as JSON integers (its Queries/Collection key by int)."""
    assert teacher.example_line("colbert", "7", [("12", 0.5), ("x1", -1.0), ("007", 2.0)]) == \
        '[7, [12, 0.5], ["x1", -1.0], ["007", 2.0]]\n'
    assert teacher.example_line("trec", "7", [("12", 0.5), ("x1", -1.0)]) == \
        "7 Q0 12 1 0.5 teacher\n7 Q0 x1 2 -1.0 teacher\n"


def test_an_error_while_writing_leaves_no_file(tmp_path, texts, cross_encoder, monkeypatch):
    calls = []

    def failing(fmt, qid, pairs):
        calls.append(qid)
        if len(calls) == 2:
            raise OSError("disk full")
        return "[]\n"

    monkeypatch.setattr(teacher, "example_line", failing)
    with pytest.raises(OSError, match="disk full"):
        run_teacher(texts, tmp_path / "out" / "x.jsonl", "--teacher", str(cross_encoder), "--depth", "5", "--nway",
                    "3")
    assert list((tmp_path / "out").iterdir()) == []


def test_select_puts_the_positive_first_and_no_other_positive_after():
    inputs = teacher.Inputs("t", {"q": "x"}, {p: p for p in "abcdef"}, {"q": {"b": 2, "d": 1, "e": 0}}, {}, False, 0)
    candidates, scores = list("abcdef"), [5.0, 1.0, 4.0, 6.0, 3.0, 4.0]
    # by score: d 6, a 5, c 4, f 4 (ties: the miner's order), e 3, b 1; d is judged (1) and so not a negative
    assert teacher.select("q", candidates, scores, "b", 4, inputs, 1) == [("b", 1.0), ("a", 5.0), ("c", 4.0),
                                                                          ("f", 4.0)]
    assert teacher.select("q", candidates, scores, None, 3, inputs, 1) == [("d", 6.0), ("a", 5.0), ("c", 4.0)]
    assert teacher.select("q", candidates, scores, "b", 6, inputs, 1) is None  # 4 negatives for 5 places
    assert teacher.select("q", candidates, scores, "b", 5, inputs, 2) == [("b", 1.0), ("d", 6.0), ("a", 5.0),
                                                                          ("c", 4.0), ("f", 4.0)]  # grade 1 < 2


def test_progress_is_reported_and_changes_no_score(tmp_path, texts, cross_encoder, capsys, monkeypatch):
    """Without --quiet the teacher says what it mines and how far the scoring got, in pairs for a cross-encoder
    (lines off a terminal, rate and ETA); scoring a chunk of queries at a time gives the scores of one call for every
    query, to float rounding (a cross-encoder's batches pad otherwise)."""
    import re

    from hil.experiments import teacher_models

    quiet, loud = tmp_path / "quiet.jsonl", tmp_path / "loud.jsonl"
    assert run_teacher(texts, quiet, "--teacher", str(cross_encoder), "--depth", "5", "--nway", "4") == 0
    capsys.readouterr()
    monkeypatch.setattr(teacher_models, "_QUERY_CHUNK", 1)
    assert teacher_cli.main(["--queries", str(texts["queries"]), "--collection", str(texts["collection"]),
                        "--output", str(loud), "--device", "cpu", "--teacher", str(cross_encoder), "--depth", "5",
                        "--nway", "4"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"[teacher] loading {texts['queries']} and the teacher {cross_encoder}\n")
    assert f"[teacher] mining {len(QUERIES)} queries with bm25 (depth 5)" in err and "[teacher] mined in" in err
    pairs = int(re.search(rf"scoring (\d+) candidates of {len(QUERIES)} queries: \1 pairs", err).group(1))
    assert "teacher: 100%" in err and f"{pairs}/{pairs} [" in err and pairs > len(QUERIES)
    loud_lines, quiet_lines = written(loud), written(quiet)
    assert loud_lines.keys() == quiet_lines.keys()
    for qid, pairs in quiet_lines.items():
        assert [p for p, _ in loud_lines[qid]] == [p for p, _ in pairs]
        assert [s for _, s in loud_lines[qid]] == pytest.approx([s for _, s in pairs], abs=1e-6)


def test_a_two_label_cross_encoder_scores_the_log_odds_of_label_one(tmp_path, texts, tiny_model_dir, hf_tokenizer):
    """The documented score of a two-label classifier: ``logit[1] - logit[0]`` (log-odds of relevance), not the
    label-1 logit alone; checked pair by pair with the model run by hand."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(1)
    model = BertForSequenceClassification(BertConfig.from_pretrained(tiny_model_dir, num_labels=2)).eval()
    folder = tmp_path / "two-label"
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    output = tmp_path / "two.jsonl"
    assert run_teacher(texts, output, "--teacher", str(folder), "--depth", "4", "--nway", "4") == 0
    checked = 0
    for qid, pairs in written(output).items():
        for pid, score in pairs:
            with torch.no_grad():
                logits = model(**hf_tokenizer(QUERIES[qid], DOCS[pid], return_tensors="pt")).logits[0]
            assert abs(logits[1] - logits[0]) > 1e-3 and abs(logits[0]) > 1e-3  # the two rules differ here
            assert score == pytest.approx((logits[1] - logits[0]).item(), abs=1e-5), (qid, pid)
            checked += 1
    assert checked == 12


def test_a_beir_query_that_is_a_document_keeps_depth_candidates_besides_itself(tmp_path, cross_encoder):
    """A BEIR set whose queries are also documents (ArguAna, Quora): the query's own document is dropped, and
    ``depth + 1`` are mined so that ``depth`` others remain. With ``--nway`` equal to ``--depth`` every query is
    written, with BM25's best ``depth`` documents other than itself (BM25 searched by hand here)."""
    folder = tmp_path / "mini"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n"
                                                 for k, v in DOCS.items()), encoding="utf-8")
    queries = {"q1": QUERIES["q1"], "d4": DOCS["d4"]}  # d4's own text: it retrieves itself first
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nd4\td1\t1\n")
    output = tmp_path / "beir.jsonl"
    assert teacher_cli.main(["--dataset", str(folder), "--teacher", str(cross_encoder), "--output", str(output),
                         "--depth", "5", "--nway", "5", "--quiet", "--device", "cpu"]) == 0
    lines = written(output)
    bm25 = dict(zip(queries, BM25Index.build(list(DOCS), list(DOCS.values())).search(list(queries.values()), 6)))
    assert bm25["d4"][0][0] == "d4"  # the construction: the query's own document is its best match
    assert set(lines) == {"q1", "d4"}
    for qid, pairs in lines.items():
        others = [pid for pid, _ in bm25[qid] if pid != qid][:5]
        assert sorted(pid for pid, _ in pairs) == sorted(others), qid


def _examples(source) -> list:
    return [source[i] for i in range(len(source))]


@pytest.mark.parametrize("fmt", ["colbert", "pylate", "trec"])
def test_teacher_output_alone_trains_from_what_the_teacher_wrote(tmp_path, texts, cross_encoder, fmt, monkeypatch):
    """``TeacherOutput`` alone: the layout, texts and nway come from the ``.meta.json``; the examples are the
    ones the format's own reader gives with every setting spelled out (from another folder than the teacher ran
    in: written paths are taken beside the examples), and the data module records that reader as used."""
    from hil.data.datamodule import TrainingDataModule
    from hil.data.nway_files import NWayExamples
    from hil.data.pylate_files import PyLateExamples
    from hil.data.run_examples import TrecRun
    from hil.data.teacher_output import TeacherOutput

    output = tmp_path / "out" / f"examples.{'trec' if fmt == 'trec' else 'jsonl'}"
    assert run_teacher(texts, output, "--teacher", str(cross_encoder), "--depth", "5", "--nway", "4",
                       "--format", fmt) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    module = TrainingDataModule(TeacherOutput(str(output)), batch_size=2)
    module.setup("fit")
    reader = {"colbert": NWayFile, "pylate": open_pylate,
              "trec": lambda *paths: RunExamples(*paths, RunSettings(4))}[fmt]
    explicit = reader(output, texts["queries"], texts["collection"])
    assert _examples(module.train_dataset) == _examples(explicit) and len(explicit) == 3
    used = {"colbert": NWayExamples, "pylate": PyLateExamples, "trec": TrecRun}[fmt]
    assert module.reader == used(str(output), str(texts["queries"]), str(texts["collection"]))
    assert module.hparams.nway == 4 and module.hparams.source == module.reader.record()
    lower = TrainingDataModule(TeacherOutput(str(output)), nway=2)  # fewer documents per query than written
    lower.setup("fit")
    assert all(len(example.documents) == 2 for example in _examples(lower.train_dataset))


def test_teacher_output_of_a_beir_set_reads_the_texts_written_beside_it(tmp_path, cross_encoder, monkeypatch):
    from hil.data.datamodule import TrainingDataModule
    from hil.data.teacher_output import TeacherOutput

    folder = tmp_path / "mini"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n"
                                                 for k, v in DOCS.items()), encoding="utf-8")
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in QUERIES.items()))
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    monkeypatch.chdir(tmp_path)
    assert teacher_cli.main(["--dataset", str(folder), "--teacher", str(cross_encoder), "--output", "made/ex.jsonl",
                         "--depth", "5", "--nway", "3", "--quiet", "--device", "cpu"]) == 0
    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path / "later")  # the meta's relative paths name files beside the examples
    module = TrainingDataModule(TeacherOutput(str(tmp_path / "made" / "ex.jsonl")))
    module.setup("fit")
    made = tmp_path / "made"
    explicit = NWayFile(made / "ex.jsonl", made / "ex.queries.tsv", made / "ex.collection.tsv")
    assert _examples(module.train_dataset) == _examples(explicit) and len(explicit) == 1  # the split's one query


def test_teacher_output_refusals_name_the_setting(tmp_path, texts, cross_encoder):
    """Refused when the data module is made, before any model loads; the spelling before 0.3 keeps its own."""
    from hil.data.datamodule import TrainingDataModule
    from hil.data.teacher_output import TeacherOutput
    from hil.errors import UserError

    output = tmp_path / "ex.jsonl"
    assert run_teacher(texts, output, "--teacher", str(cross_encoder), "--depth", "5", "--nway", "3") == 0
    with pytest.raises(UserError, match="data.nway 4 is more than the 3"):
        TrainingDataModule(TeacherOutput(str(output)), nway=4)
    with pytest.raises(ValueError, match="give neither"):
        TrainingDataModule(teacher_output=str(output), queries=str(texts["queries"]))
    with pytest.raises(ValueError, match=r"exactly one of .*got \['triples', 'teacher_output'\]"):
        TrainingDataModule(triples="x.tsv", teacher_output=str(output))
    (tmp_path / "plain.jsonl").write_text(output.read_text())
    with pytest.raises(UserError, match=r"plain.jsonl.meta.json not found: not written by `hil teacher`"):
        TrainingDataModule(TeacherOutput(str(tmp_path / "plain.jsonl")))
    output.with_name("ex.jsonl.meta.json").write_text("{\"settings\": {}}")
    with pytest.raises(UserError, match="not a `hil teacher` record"):
        TrainingDataModule(TeacherOutput(str(output)))


@pytest.mark.integration
def test_hil_fit_trains_from_teacher_output_alone(tmp_path, texts, cross_encoder, shared_dir):
    """The command line a user runs (LightningCLI hands the data module its arguments as given): a distillation
    variant with ``TeacherOutput`` as ``data.source`` trains, and the data module records the reader the .meta.json
    resolved to."""
    from hil.cli.train import train_main

    output = tmp_path / "ex.jsonl"
    assert run_teacher(texts, output, "--teacher", str(cross_encoder), "--depth", "5", "--nway", "3") == 0
    cli = train_main(["fit", "--config", "colbert", "--config", "variants/colbert_distill", "--config",
                      "presets/smoke", "--data.source", "TeacherOutput", "--data.source.path", str(output),
                      "--data.batch_size", "2", "--trainer.max_steps", "2", "--trainer.logger", "false",
                      "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
                      "--trainer.default_root_dir", str(tmp_path / "run")])
    assert cli.trainer.global_step == 2
    hparams = cli.datamodule.hparams
    assert (hparams.source, hparams.nway) == ({"class_path": "hil.data.nway_files.NWayExamples", "init_args": {
        "path": str(output), "queries": str(texts["queries"]), "collection": str(texts["collection"])}}, 3)


def test_an_existing_output_is_refused_unless_overwrite_is_given(tmp_path, texts, cross_encoder, capsys,
                                                                 monkeypatch):
    """Nothing of the user's is replaced unasked (issue 40, row 3): an existing ``--output`` is refused before any
    work, in one line, exit 2, the file as it was; ``--overwrite`` replaces it (and the teacher's own files of a
    first run are refused the same way)."""
    output = tmp_path / "ex.jsonl"
    output.write_text("my notes\n")
    common = ["--teacher", str(cross_encoder), "--depth", "5", "--nway", "3"]
    with monkeypatch.context() as patched:
        patched.setattr(teacher, "load_inputs", lambda args: pytest.fail("refused after reading the inputs"))
        assert run_teacher(texts, output, *common) == 2
    assert capsys.readouterr().err == f"hil teacher: error: --output {output} exists; pass --overwrite to replace it\n"
    assert output.read_text() == "my notes\n" and not output.with_name("ex.jsonl.meta.json").exists()
    assert run_teacher(texts, output, *common, "--overwrite") == 0
    assert len(written(output)) == 3 and output.with_name("ex.jsonl.meta.json").is_file()
    output.unlink()  # the teacher's .meta.json of that run is still there
    assert run_teacher(texts, output, *common) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ex.jsonl.meta.json (written beside it) exists; pass --overwrite" in err


def test_a_file_the_teacher_writes_beside_the_output_is_refused_too(tmp_path, cross_encoder, capsys):
    """With a BEIR dataset the texts are written beside the examples (``<stem>.queries.tsv``): a file of the user's
    by that name is refused, named, unless ``--overwrite``."""
    folder = tmp_path / "mini"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n"
                                                 for k, v in DOCS.items()), encoding="utf-8")
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in QUERIES.items()))
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    mine = tmp_path / "ex.queries.tsv"
    mine.write_text("q\tmy own queries\n")
    argv = ["--dataset", str(folder), "--teacher", str(cross_encoder), "--output", str(tmp_path / "ex.jsonl"),
            "--depth", "5", "--nway", "3", "--quiet", "--device", "cpu"]
    assert teacher_cli.main(argv) == 2
    assert capsys.readouterr().err == (f"hil teacher: error: --output {tmp_path / 'ex.jsonl'}: {mine} (written beside "
                                       "it) exists; pass --overwrite to replace it\n")
    assert mine.read_text() == "q\tmy own queries\n" and not (tmp_path / "ex.jsonl").exists()
    assert teacher_cli.main([*argv, "--overwrite"]) == 0
    assert mine.read_text().startswith("q1\t")
