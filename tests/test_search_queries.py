"""``hil search`` over queries without judgments (issue 39, build item 2): ``--query TEXT`` and ``--queries FILE``
(BEIR jsonl or id<TAB>text) against an index folder ``hil index`` built, or a model and a dataset.

The rankings are checked against an independent reference: the same model's token vectors (documents rounded to
fp16, as an index stores them) and MaxSim written out as loops over tokens, never the search code itself.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from hil.cli.main import main as hil_main

WORDS = ["cell", "gene", "protein", "tumor", "vaccine", "dose", "brain", "heart", "blood", "lung", "risk", "insulin",
         "growth", "therapy"]
QUIET = ["--settings.progress", "false", "--quiet", "true"]


def write_corpus(folder: Path, n_docs: int = 30) -> dict[str, str]:
    """A BEIR folder whose judged queries (t0..t2) are none of the queries searched below; -> its documents."""
    rng = random.Random(7)
    corpus = {f"d{i:02d}": " ".join(rng.sample(WORDS, 6)) for i in range(n_docs)}
    assert len(set(corpus.values())) == n_docs  # no two documents alike: no exact ties in the rankings
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": f"T{d}", "text": t}) + "\n"
                                                 for d, t in corpus.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"t{i}", "text": WORDS[i]}) + "\n"
                                                  for i in range(3)))
    (folder / "qrels" / "test.tsv").write_text("".join(f"t{i}\td{i:02d}\t1\n" for i in range(3)))
    return {doc_id: f"T{doc_id} {text}" for doc_id, text in corpus.items()}


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """A tiny model's export, a tiny BEIR folder, and the index ``hil index`` built of them."""
    from hil.modeling.loading import load_encoder

    root = tmp_path_factory.mktemp("search")
    torch.manual_seed(0)
    export = load_encoder(str(tiny_model_dir), dim=16, query_maxlen=12, doc_maxlen=24).save_pretrained(
        root / "model" / "export")
    documents = write_corpus(root / "beir" / "tiny")
    index_root = root / "indexes"
    assert hil_main(["index", "--model", str(export), "--dataset", str(root / "beir" / "tiny"),
                     "--settings.index_root", str(index_root), *QUIET]) == 0
    (index,) = [path.parent for path in index_root.glob("*/*/index.json")]
    return {"export": export, "beir": root / "beir" / "tiny", "index_root": index_root, "index": index,
            "documents": documents}


@pytest.fixture(scope="module")
def reference(built):
    """Each document's exact MaxSim score for a query text: sum over the query's tokens of the best dot product
    with any of the document's tokens (documents' vectors rounded to fp16 as stored), by loops."""
    from hil.modeling.loading import load_encoder

    encoder = load_encoder(str(built["export"])).eval()
    doc_ids = list(built["documents"])
    with torch.inference_mode():
        docs = encoder.encode_documents([built["documents"][d] for d in doc_ids])
    (head,) = encoder.head_names

    def scores(text: str) -> dict[str, float]:
        with torch.inference_mode():
            query = encoder.encode_queries([text])
        q = [vector for vector, kept in zip(query.heads[head][0], query.mask[0]) if kept]
        found = {}
        for j, doc_id in enumerate(doc_ids):
            d = [vector.half().float() for vector, kept in zip(docs.heads[head][j], docs.mask[j]) if kept]
            found[doc_id] = sum(max(float(qi @ dt) for dt in d) for qi in q)
        return found

    return scores


def read_run(path: Path) -> dict[str, list[tuple[str, int, float]]]:
    """The run file checked as a TREC run: 6 columns, Q0, ranks 1..n in order, scores not increasing."""
    run: dict[str, list[tuple[str, int, float]]] = {}
    for line in path.read_text().splitlines():
        columns = line.split()
        assert len(columns) == 6 and columns[1] == "Q0", line
        run.setdefault(columns[0], []).append((columns[2], int(columns[3]), float(columns[4])))
    for hits in run.values():
        assert [rank for _, rank, _ in hits] == list(range(1, len(hits) + 1))
        assert all(a[2] >= b[2] for a, b in itertools.pairwise(hits))
    return run


def assert_exact_ranking(hits: list[tuple[str, int, float]], scores: dict[str, float], k: int) -> None:
    """The run's top k is the reference's: the same documents in the same order, with the same scores."""
    expected = sorted(scores, key=lambda doc_id: -scores[doc_id])[:k]
    assert [doc_id for doc_id, _, _ in hits] == expected
    assert [score for _, _, score in hits] == pytest.approx([scores[d] for d in expected], abs=1e-4)


def test_typed_queries_rank_an_index_as_exact_maxsim_and_print_their_top_hits(built, reference, tmp_path, capsys):
    texts = ["gene protein therapy", "heart blood: lung?"]  # a colon and a question mark: a text, not YAML
    run_file = tmp_path / "typed.trec"
    assert hil_main(["search", "--index", str(built["index"]), "--query", texts[0], "--query", texts[1],
                     "--output", str(run_file), "--settings.k", "7", "--hits", "3", *QUIET]) == 0
    out = capsys.readouterr().out
    run = read_run(run_file)
    assert sorted(run) == ["q1", "q2"]  # no judgments: ids made from the order given
    for qid, text in zip(("q1", "q2"), texts, strict=True):
        assert_exact_ranking(run[qid], reference(text), 7)
        assert {line.split()[-1] for line in run_file.read_text().splitlines()} == {"model"}
    printed = out[out.index("q1: gene protein therapy"):].splitlines()
    for rank, (doc_id, _, score) in enumerate(run["q1"][:3], start=1):  # rank, score, doc id, the text's start
        assert printed[rank].split()[:3] == [str(rank), f"{score:.4f}", doc_id]
        assert built["documents"][doc_id].startswith(" ".join(printed[rank].split()[3:]))
    assert printed[4] == "" and "q2: heart blood: lung?" in out


@pytest.mark.parametrize("form", ["jsonl", "tsv", "tsv-named-txt", "jsonl-without-suffix"])
def test_a_queries_file_in_either_format_ranks_as_exact_maxsim(form, built, reference, tmp_path):
    queries = {"my-1": "insulin dose", "my-2": "tumor growth cell"}
    if form.startswith("jsonl"):
        text = "".join(json.dumps({"_id": qid, "text": t, "metadata": {}}) + "\n" for qid, t in queries.items())
    else:
        text = "\ufeff" + "".join(f"{qid}\t{t}\r\n" for qid, t in queries.items()) + "\n"  # BOM, CRLF, blank line
    name = {"jsonl": "q.jsonl", "tsv": "q.tsv", "tsv-named-txt": "q.txt", "jsonl-without-suffix": "queries"}[form]
    (tmp_path / name).write_text(text, encoding="utf-8")
    assert hil_main(["search", "--index", str(built["index"]), "--queries", str(tmp_path / name),
                     "--output", str(tmp_path / "run.trec"), "--settings.k", "5", *QUIET]) == 0
    run = read_run(tmp_path / "run.trec")
    assert sorted(run) == sorted(queries)
    for qid, query in queries.items():
        assert_exact_ranking(run[qid], reference(query), 5)


def test_model_and_dataset_rank_a_queries_file_in_the_index_hil_index_built(built, reference, tmp_path):
    (tmp_path / "q.tsv").write_text("x7\tbrain heart risk\n")
    searched = ["search", "--queries", str(tmp_path / "q.tsv"), "--settings.k", "6", *QUIET]
    assert hil_main([*searched, "--model", str(built["export"]), "--dataset", str(built["beir"]),
                     "--settings.index_root", str(built["index_root"]), "--output", str(tmp_path / "a.trec")]) == 0
    assert [path.parent for path in built["index_root"].glob("*/*/index.json")] == [built["index"]]  # no 2nd build
    assert_exact_ranking(read_run(tmp_path / "a.trec")["x7"], reference("brain heart risk"), 6)
    assert hil_main([*searched, "--index", str(built["index"]), "--output", str(tmp_path / "b.trec")]) == 0
    assert (tmp_path / "a.trec").read_text() == (tmp_path / "b.trec").read_text()
    # exhaustive search ranks every document exactly: the same ranking
    assert hil_main([*searched, "--index", str(built["index"]), "--settings.mode", "exhaustive",
                     "--output", str(tmp_path / "c.trec")]) == 0
    assert (tmp_path / "c.trec").read_text() == (tmp_path / "b.trec").read_text()


def test_jsonl_holds_each_querys_top_hits_with_their_texts(built, tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"_id": "a", "text": "vaccine lung"}) + "\n"
                                      + json.dumps({"_id": "b", "text": "growth"}) + "\n")
    assert hil_main(["search", "--index", str(built["index"]), "--queries", str(tmp_path / "q.jsonl"), "--output",
                     str(tmp_path / "run.trec"), "--jsonl", str(tmp_path / "hits.jsonl"), "--hits", "4", *QUIET]) == 0
    run = read_run(tmp_path / "run.trec")
    lines = [json.loads(line) for line in (tmp_path / "hits.jsonl").read_text().splitlines()]
    assert [(line["query_id"], line["rank"]) for line in lines] == [(q, r) for q in "ab" for r in range(1, 5)]
    for line in lines:
        doc_id, _, score = run[line["query_id"]][line["rank"] - 1]
        assert (line["doc_id"], line["score"]) == (doc_id, score)
        assert f"{line['title']} {line['text']}" == built["documents"][doc_id]
        assert line["query"] == {"a": "vaccine lung", "b": "growth"}[line["query_id"]]


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: what is refused must be refused before it."""
    import hil.evaluation.runner

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hil.evaluation.runner, "load_model", refuse)


@pytest.mark.parametrize("name, text, where", [
    ("q.jsonl", '{"_id": "a", "text": "gene"}\n{"_id": "b", "text": "cell"\n', "q.jsonl:2: malformed JSON"),
    ("q.jsonl", '{"_id": "a", "text": "gene"}\n\n{"_id": "b", "text": "  "}\n',
     "q.jsonl:3: query 'b' has an empty text"),
    ("q.jsonl", '{"_id": "a", "text": "gene"}\n{"text": "cell"}\n', "q.jsonl:2: missing field '_id'"),
    ("q.tsv", "a\tgene\nb cell\n", "q.tsv:2: expected id<TAB>text"),
    ("q.tsv", "a\tgene\nb\t \n", "q.tsv:2: query 'b' has an empty text"),
    ("q.tsv", "a\tgene\nb\tcell\na\tblood\n", "q.tsv:3: duplicate id 'a' (first on line 1)"),
    ("q.tsv", "a b\tgene\n", "q.tsv:1: id 'a b' contains whitespace"),
])
def test_a_bad_queries_line_is_refused_naming_file_and_line(name, text, where, built, tmp_path, capsys,
                                                           no_model_load):
    (tmp_path / name).write_text(text)
    assert hil_main(["search", "--index", str(built["index"]), "--queries", str(tmp_path / name),
                     "--output", str(tmp_path / "run.trec"), *QUIET]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and where in err[0], err
    assert not (tmp_path / "run.trec").exists()


@pytest.mark.parametrize("extra, words", [
    (["--query", "x", "--output", "{tmp}/there.trec"], "--output {tmp}/there.trec: the file is there"),
    (["--query", "x", "--output", "{tmp}/new.trec", "--jsonl", "{tmp}/there.trec"],
     "--jsonl {tmp}/there.trec: the file is there"),
    (["--query", "x", "--output", "{tmp}/new.trec", "--jsonl", "/proc/hits.jsonl"],
     "--jsonl /proc/hits.jsonl: /proc is not writable"),
    (["--query", "x", "--output", "{tmp}/new.trec", "--jsonl", "{tmp}/new.trec"], "the same file as --output"),
    (["--queries", "{tmp}/absent.tsv", "--output", "{tmp}/new.trec"], "--queries {tmp}/absent.tsv: no such file"),
    (["--query", "x", "--queries", "{tmp}/there.trec", "--output", "{tmp}/new.trec"], "not both"),
    (["--query", " ", "--output", "{tmp}/new.trec"], "--query: query 1 of 1 is empty"),
    (["--output", "{tmp}/new.trec"], "add --query TEXT or --queries FILE"),
    (["--query", "x", "--output", "{tmp}/new.trec", "--dataset", "scifact"], "leave out --dataset"),
    (["--query", "x", "--output", "{tmp}/new.trec", "--max_docs", "5"], "leave out --dataset and --max_docs"),
    (["--query", "x", "--output", "{tmp}/new.trec", "--settings.mode", "rerank"], "--settings.mode rerank"),
    (["--query", "x", "--output", "{tmp}/new.trec", "--settings.backend", "ivfflat"], "was built as flat"),
    (["--query", "x", "--output", "{tmp}/new.trec", "--hits", "0"], "--hits must be >= 1"),
])
def test_every_input_and_output_is_checked_before_the_model_loads(extra, words, built, tmp_path, capsys,
                                                                 no_model_load):
    (tmp_path / "there.trec").write_text("kept\n")
    argv = ["search", "--index", str(built["index"]), *[arg.format(tmp=tmp_path) for arg in extra], *QUIET]
    assert hil_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words.format(tmp=tmp_path) in err[0], err
    assert (tmp_path / "there.trec").read_text() == "kept\n" and not (tmp_path / "new.trec").exists()


def test_index_folder_and_dataset_refusals_name_what_to_give(built, tmp_path, capsys, no_model_load):
    common = ["--query", "x", "--output", str(tmp_path / "r.trec"), *QUIET]
    assert hil_main(["search", "--index", str(tmp_path), *common]) == 2
    assert f"--index {tmp_path}: not an index folder (no index.json)" in capsys.readouterr().err
    assert hil_main(["search", "--model", str(built["export"]), "--dataset", str(tmp_path / "nowhere"),
                     *common]) == 2
    assert "nowhere: no such dataset folder" in capsys.readouterr().err


def test_another_model_than_the_index_was_built_with_is_refused(built, tiny_model_dir, tmp_path, capsys):
    assert hil_main(["search", "--index", str(built["index"]), "--model", str(tiny_model_dir), "--query", "gene",
                     "--output", str(tmp_path / "r.trec"), *QUIET]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (loading bars aside)
    assert len(err) == 1 and "built with another model" in err[0] and "give the model it was built with" in err[0]
    assert not (tmp_path / "r.trec").exists()


def test_an_index_without_its_corpus_record_ranks_but_refuses_jsonl(built, tmp_path, capsys):
    import shutil

    index = tmp_path / "copy" / built["index"].name  # the folder alone: no corpus.json beside it
    shutil.copytree(built["index"], index)
    assert hil_main(["search", "--index", str(index), "--query", "gene", "--output", str(tmp_path / "r.trec"),
                     "--jsonl", str(tmp_path / "h.jsonl"), *QUIET]) == 2
    assert "no record of its corpus" in capsys.readouterr().err and not (tmp_path / "r.trec").exists()
    assert hil_main(["search", "--index", str(index), "--query", "gene", "--output", str(tmp_path / "r.trec"),
                     *QUIET]) == 0
    assert "no texts" in capsys.readouterr().out and len(read_run(tmp_path / "r.trec")["q1"]) == 30


def test_print_config_fed_back_is_the_same_search(built, tmp_path, capsys):
    from hil.cli.main import parse_command

    (tmp_path / "q.tsv").write_text("a\tgene: cell\n")
    argv = ["--index", str(built["index"]), "--query", "lung, heart?", "--query", "[dose]", "--settings.k", "4",
            "--output", str(tmp_path / "run.trec"), "--jsonl", str(tmp_path / "hits.jsonl"), "--hits", "2", *QUIET]
    assert hil_main(["search", *argv, "--print_config"]) == 0
    (tmp_path / "search.yaml").write_text(capsys.readouterr().out)
    direct = parse_command(argv, "hil search", "search")[1]["request"]
    again = parse_command(["--config", str(tmp_path / "search.yaml")], "hil search", "search")[1]["request"]
    assert again == direct and direct.queries == {"q1": "lung, heart?", "q2": "[dose]"}
    assert hil_main(["search", "--config", str(tmp_path / "search.yaml")]) == 0
    first = (tmp_path / "run.trec").read_text(), (tmp_path / "hits.jsonl").read_text()
    assert hil_main(["search", *argv, "--overwrite"]) == 0
    assert ((tmp_path / "run.trec").read_text(), (tmp_path / "hits.jsonl").read_text()) == first
    assert len(read_run(tmp_path / "run.trec")["q2"]) == 4


def test_an_index_whose_recorded_dataset_changed_is_refused_for_texts(built, tmp_path, capsys):
    import shutil

    beir = tmp_path / "beir"
    shutil.copytree(built["beir"], beir)
    index = tmp_path / "indexes" / built["index"].parent.name / built["index"].name
    shutil.copytree(built["index"], index)
    record = json.loads((built["index"].parent / "corpus.json").read_text())
    record["dataset"]["name"] = str(beir)
    (index.parent / "corpus.json").write_text(json.dumps(record))
    with open(beir / "corpus.jsonl", "a") as corpus:  # a document added since the index was built
        corpus.write(json.dumps({"_id": "new", "title": "", "text": "gene"}) + "\n")
    assert hil_main(["search", "--index", str(index), "--query", "gene", "--output", str(tmp_path / "r.trec"),
                     *QUIET]) == 2
    assert "no longer gives the corpus the index was built from" in capsys.readouterr().err
    assert not (tmp_path / "r.trec").exists()


def test_a_run_file_another_process_wrote_during_the_search_is_kept(built, tmp_path, capsys, monkeypatch):
    from hil.evaluation import search_run

    searched = search_run.run_query_search

    def meanwhile(request):  # the search runs; another process takes the --output name before it ends
        result = searched(request)
        request.run_file.write_text("theirs\n")
        return result

    monkeypatch.setattr(search_run, "run_query_search", meanwhile)
    run_file = tmp_path / "run.trec"
    assert hil_main(["search", "--index", str(built["index"]), "--query", "gene", "--output", str(run_file),
                     *QUIET]) == 2
    assert "written by another process while this search ran" in capsys.readouterr().err
    assert run_file.read_text() == "theirs\n" and sorted(p.name for p in tmp_path.iterdir()) == ["run.trec"]


def test_the_documented_own_query_searches_run(built, tmp_path, capsys):
    """The README's and the guide's ``hil search`` lines with --query / --queries / --index (inline, in prose, or in
    a bash block), run with the tiny model, dataset and index in place of theirs."""
    import re
    import shlex

    root = Path(__file__).resolve().parents[1]
    text = "\n".join((root / name).read_text(encoding="utf-8") for name in ("README.md", "docs/guide.md"))
    spans = re.findall(r"`(hil search [^`]*)`", text)
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        spans += [shlex.join(shlex.split(line, comments=True)) for line in block.replace("\\\n", " ").splitlines()
                  if line.startswith("hil search")]
    commands = [" ".join(span.split()) for span in spans if re.search(r"--(query|queries|index) ", span)]
    assert len(commands) >= 3, commands
    (tmp_path / "q.tsv").write_text("a\tgene therapy\n")
    swap = {"--model": str(built["export"]), "--dataset": str(built["beir"]), "--index": str(built["index"]),
            "--queries": str(tmp_path / "q.tsv"), "--output": str(tmp_path / "run.trec"),
            "--jsonl": str(tmp_path / "hits.jsonl")}
    for command in commands:
        args = shlex.split(command)[2:]
        argv = [swap.get(args[i - 1], arg) if i else arg for i, arg in enumerate(args)]
        assert hil_main(["search", *argv, "--settings.index_root", str(built["index_root"]), "--overwrite",
                         *QUIET]) == 0, command
        assert read_run(tmp_path / "run.trec"), command
    assert [path.parent for path in built["index_root"].glob("*/*/index.json")] == [built["index"]]


def test_print_config_of_a_judged_search_fed_back_is_the_same_search(built, tmp_path, capsys):
    from dataclasses import replace

    from hil.cli.main import parse_command

    argv = ["--model", str(built["export"]), "--dataset", str(built["beir"]), "--max_docs", "20", "--output",
            str(tmp_path / "run.trec"), "--settings.k", "5", "--settings.index_root", str(built["index_root"]), *QUIET]
    assert hil_main(["search", *argv, "--print_config"]) == 0
    (tmp_path / "search.yaml").write_text(capsys.readouterr().out)
    direct, own = parse_command(argv, "hil search", "search")
    again, own_again = parse_command(["--config", str(tmp_path / "search.yaml")], "hil search", "search")
    assert replace(again, command={}) == replace(direct, command={}) and own_again == own
    assert direct.datasets[0].max_docs == 20 and direct.settings.k == 5 and "request" not in own


def test_an_index_built_from_a_relative_model_path_is_searched_from_another_folder(built, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(built["export"], tmp_path / "here" / "export")
    monkeypatch.chdir(tmp_path / "here")
    assert hil_main(["index", "--model", "export", "--dataset", str(built["beir"]), "--max_docs", "12",
                     "--settings.index_root", "indexes", *QUIET]) == 0
    (index,) = [path.parent for path in (tmp_path / "here" / "indexes").glob("*/*/index.json")]
    assert json.loads((index / "index.json").read_text())["settings"]["backbone"] == str(tmp_path / "here" / "export")
    monkeypatch.chdir(tmp_path)  # elsewhere: the model it records is still found
    assert hil_main(["search", "--index", str(index), "--query", "gene", "--output", "r.trec", *QUIET]) == 0
    assert len(read_run(tmp_path / "r.trec")["q1"]) == 12
