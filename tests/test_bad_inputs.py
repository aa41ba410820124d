"""Bad input, as a new user would give it, to ``evaluate.py``, ``train.py`` and the Python API: each one is refused
where it enters, with one line that names the file and line, the option or the key.

The table has three parts. Command-line rows run ``evaluate.py`` / ``train.py fit`` in this process (the same
``main`` the scripts call) and check the exit status (2), that nothing but one ``error:`` line reaches stderr (no
traceback, no usage screen) and the words of that line; a few of them run the scripts as real subprocesses too.
API rows call the functions and check that the exception is a :class:`~hil.errors.UserError` (the type every
command prints as one line) whose message holds the words. The bad files are small slices of the shared SciFact.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from hil.cli.evaluate_script import main as evaluate_command
from hil.cli.train import run_train, train_main
from hil.errors import DataFormatError, MissingInputError, UserError

REPO = Path(__file__).resolve().parents[1]
N_DOCS, N_JUDGED = 20, 6  # corpus.jsonl has 20 lines; qrels/test.tsv a header and 6 judgments (7 lines)

pytestmark = pytest.mark.integration


# -- the files everything starts from ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_dataset(shared_dir, tmp_path_factory) -> Path:
    """A BEIR folder from SciFact: 6 test judgments, their queries and documents, and other documents up to 20."""
    source = shared_dir / "data" / "beir" / "scifact"
    judged = [line.split("\t") for line in (source / "qrels" / "test.tsv").read_text().splitlines()[1:1 + N_JUDGED]]
    doc_ids = {doc_id for _, doc_id, _ in judged}
    documents, others = [], []
    with open(source / "corpus.jsonl", encoding="utf-8") as handle:
        for line in handle:
            (documents if json.loads(line)["_id"] in doc_ids else others).append(line)
            if len(documents) == len(doc_ids) and len(others) >= N_DOCS:
                break
    query_ids = {query_id for query_id, _, _ in judged}
    queries = [line for line in (source / "queries.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
               if json.loads(line)["_id"] in query_ids]
    folder = tmp_path_factory.mktemp("beir") / "slice"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(documents + others[: N_DOCS - len(documents)]), encoding="utf-8")
    (folder / "queries.jsonl").write_text("".join(queries), encoding="utf-8")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        "\t".join(row) + "\n" for row in judged), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny_export(tiny_model_dir, tmp_path_factory) -> Path:
    """The shared tiny BERT with a 16-dimensional ColBERT head, exported (loads without the untrained-head notice)."""
    from hil.modeling.loading import load_encoder

    torch.manual_seed(0)
    encoder = load_encoder(str(tiny_model_dir), dim=16, query_maxlen=16, doc_maxlen=32)
    return encoder.save_pretrained(tmp_path_factory.mktemp("model") / "export")


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def replace_line(path: Path, number: int, text: str) -> None:
    lines = lines_of(path)
    lines[number - 1] = text
    path.write_text("".join(lines), encoding="utf-8")


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


def truncate_line(path: Path, number: int) -> None:
    """Line ``number`` cut in the middle of its text, as a copy interrupted mid-write leaves it."""
    replace_line(path, number, lines_of(path)[number - 1][:40] + "\n")


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(data)


def mutated(good: Path, tmp_path: Path, mutate: Callable[[Path], None] | None) -> Path:
    folder = tmp_path / "data"
    shutil.copytree(good, folder)
    if mutate is not None:
        mutate(folder)
    return folder


@dataclass
class Places:
    """What a row's arguments and words name: ``{data}``, ``{model}``, ``{tmp}``."""

    data: Path
    model: Path
    tmp: Path

    def fill(self, text: str) -> str:
        for name in ("data", "model", "tmp"):
            text = text.replace(f"{{{name}}}", str(getattr(self, name)))
        return text


def assert_one_error_line(code: int, err: str, prefix: str) -> str:
    """Status 2, no traceback or usage screen, stderr exactly one line starting with ``prefix``; -> that line."""
    assert code == 2, err
    assert "Traceback" not in err and "usage:" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), err
    return lines[0]


def assert_words(line: str, words: list[str], places: Places) -> None:
    for word in words:
        assert places.fill(word) in line, (places.fill(word), line)


# -- evaluate.py ------------------------------------------------------------------------------------------------------

def corpus(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda folder: mutate(folder / "corpus.jsonl")


def queries(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda folder: mutate(folder / "queries.jsonl")


def qrels(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda folder: mutate(folder / "qrels" / "test.tsv")


def write_run(text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / "run.trec").write_text(text, encoding="utf-8")


def unreachable_hub(monkeypatch) -> None:
    """No network: the hub answers every dataset as unreachable (as the `datasets` library does offline)."""
    module = types.ModuleType("datasets")

    def load_dataset(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (offline)")

    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


# (id, mutation of the good folder, arguments after --model/--dataset, words of the one error line)
EVALUATE_ROWS = [
    ("malformed-corpus-line", corpus(lambda p: replace_line(p, 5, '{"_id": "x1", "text": \n')), [],
     ["{data}/corpus.jsonl:5: malformed JSON"]),
    ("truncated-corpus-line", corpus(lambda p: truncate_line(p, 9)), [], ["{data}/corpus.jsonl:9: malformed JSON"]),
    ("truncated-last-line", corpus(lambda p: append(p, '{"_id": "x1", "title": "", "text": "half')), [],
     [f"{{data}}/corpus.jsonl:{N_DOCS + 1}: malformed JSON"]),
    ("missing-text-field", corpus(lambda p: replace_line(p, 7, '{"_id": "x7", "title": "no text"}\n')), [],
     ["{data}/corpus.jsonl:7: missing field 'text'"]),
    ("duplicate-doc-id", corpus(lambda p: append(p, lines_of(p)[2])), [],
     [f"{{data}}/corpus.jsonl:{N_DOCS + 1}: duplicate _id", "(first on line 3)"]),
    ("corpus-invalid-utf8", corpus(lambda p: append_bytes(p, b'{"_id": "x2", "text": "caf\xe9"}\n')), [],
     [f"{{data}}/corpus.jsonl:{N_DOCS + 1}: invalid UTF-8"]),
    ("empty-queries", queries(lambda p: p.write_text("")), [], ["{data}/queries.jsonl: no queries"]),
    ("non-integer-score", qrels(lambda p: append(p, "1\t4983\t1.5\n")), [],
     [f"{{data}}/qrels/test.tsv:{N_JUDGED + 2}: score '1.5' is not an integer"]),
    ("huge-score", qrels(lambda p: append(p, "1\t4983\t99999999999999999999\n")), [],
     [f"{{data}}/qrels/test.tsv:{N_JUDGED + 2}: score 99999999999999999999 is outside the range"]),
    ("qrels-unknown-query", qrels(lambda p: append(p, "no-such-query\t4983\t1\n")), [],
     [f"{{data}}/qrels/test.tsv:{N_JUDGED + 2}: query id 'no-such-query' is not in the queries"]),
    ("qrels-two-columns", qrels(lambda p: replace_line(p, 3, "1\t4983\n")), [],
     ["{data}/qrels/test.tsv:3: expected 3 tab-separated columns"]),
    ("missing-split", None, ["--split", "dev"], ["{data}: no qrels/dev.tsv (splits found: test)"]),
    ("no-such-dataset-folder", None, ["--dataset", "{tmp}/nowhere"], ["{tmp}/nowhere: no such dataset folder"]),
    ("unknown-dataset-name", "hub", ["--dataset", "no-such-set"], ["BEIR dataset 'no-such-set'", "HIL_DATA_DIR"]),
    ("model-path-missing", None, ["--model", "{tmp}/no-such-model"], ["{tmp}/no-such-model"]),
    ("model-path-empty-folder", lambda folder: (folder / "empty-model").mkdir(), ["--model", "{data}/empty-model"],
     ["{data}/empty-model"]),
    ("model-path-junk-checkpoint", lambda folder: (folder / "junk.ckpt").write_text("not a checkpoint"),
     ["--model", "{data}/junk.ckpt"], ["{data}/junk.ckpt"]),
    ("k-zero", None, ["--k", "0"], ["--k must be >= 1 (got 0)"]),
    ("k-negative", None, ["--k", "-5"], ["--k must be >= 1 (got -5)"]),
    ("ncandidates-zero", None, ["--ncandidates", "0"], ["--ncandidates must be >= 1 (got 0)"]),
    ("faiss-params-not-json", None, ["--faiss-params", "{nlist: 4}"], ["--faiss-params: not valid JSON"]),
    ("faiss-params-unknown-key", None, ["--faiss", "ivfflat", "--faiss-params", '{"nlists": 4}'],
     ["--backend-params / --ncandidates with --backend ivfflat", "'nlists'"]),
    ("faiss-params-text-value", None, ["--faiss", "ivfflat", "--faiss-params", '{"nlist": "many"}'],
     ["--faiss-params: 'nlist' must be a number"]),
    ("ivf-nlist-above-the-tokens", None, ["--faiss", "ivfflat", "--faiss-params", '{"nlist": 100000}'],
     ["nlist=100000 needs at least 100000 training tokens", "lower nlist"]),
    ("ivfpq-m-not-dividing-dim", None, ["--faiss", "ivfpq", "--faiss-params", '{"m": 7}'],
     ["m=7 must divide the embedding dimension 16"]),
    ("first-stage-run-missing", None, ["--first-stage-run", "{tmp}/none.trec"], ["{tmp}/none.trec: no such run file"]),
    ("first-stage-run-five-fields", write_run("1 Q0 4983 1 2.5 bm25\n1 Q0 4983 2 1.5\n"),
     ["--first-stage-run", "{data}/run.trec"], ["{data}/run.trec:2: expected 6 fields"]),
    ("first-stage-run-nan-score", write_run("1 Q0 4983 1 NaN bm25\n"), ["--first-stage-run", "{data}/run.trec"],
     ["{data}/run.trec:1: score is NaN"]),
    ("idf-corpus-without-idf", None, ["--idf", "corpus"], ["--idf corpus needs a model with IDF weights"]),
    ("unknown-mode", None, ["--mode", "dense"], ["argument --mode: invalid choice: 'dense'"]),
    ("transform-with-bm25", None, ["--mode", "bm25", "--transform", "whitening"], ["--transform needs a model"]),
]


def run_evaluate(capsys, places: Places, extra: list[str]) -> tuple[int, str]:
    args = ["--model", str(places.model), "--dataset", str(places.data), "--no-bm25", "--no-stats", "--quiet",
            "--index-root", str(places.tmp / "indexes"), "--output", str(places.tmp / "results"),
            *[places.fill(arg) for arg in extra]]
    capsys.readouterr()
    code = evaluate_command(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("mutate, extra, words", [row[1:] for row in EVALUATE_ROWS],
                         ids=[row[0] for row in EVALUATE_ROWS])
def test_evaluate_refuses_in_one_line(good_dataset, tiny_export, tmp_path, capsys, monkeypatch, mutate, extra, words):
    monkeypatch.delenv("HIL_DEBUG", raising=False)
    if mutate == "hub":
        unreachable_hub(monkeypatch)
        mutate = None
    places = Places(mutated(good_dataset, tmp_path, mutate), tiny_export, tmp_path)
    code, err = run_evaluate(capsys, places, extra)
    line = assert_one_error_line(code, err, "evaluate.py: error: ")
    assert_words(line, words, places)
    assert not (tmp_path / "results").exists()  # nothing written


def test_evaluate_debug_env_keeps_the_traceback(good_dataset, tiny_export, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HIL_DEBUG", "1")
    places = Places(mutated(good_dataset, tmp_path, corpus(lambda p: truncate_line(p, 9))), tiny_export, tmp_path)
    with pytest.raises(DataFormatError) as raised:
        run_evaluate(capsys, places, [])
    assert (raised.value.path, raised.value.line) == (str(places.data / "corpus.jsonl"), 9)


# -- train.py fit -----------------------------------------------------------------------------------------------------

def train_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config", str(REPO / "configs/presets/smoke.yaml"),
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
            "--trainer.max_steps", "1", "--data.max_triples", "8", "--data.batch_size", "4", *extra]


def plain_state_dict(path: Path) -> None:
    torch.save({"weight": torch.zeros(2)}, path)


def triples_file(text: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(text)


# (id, file written at {tmp}/file before the run (or None), arguments, words of the one error line)
TRAIN_ROWS = [
    ("negative-learning-rate", None, ["--model.optimizer.init_args.lr=-0.001"],
     ["model.optimizer.init_args.lr must be a finite number >= 0 (got -0.001)"]),
    ("negative-eps", None, ["--model.optimizer.init_args.eps=-1e-8"], ["model.optimizer.init_args.eps must be"]),
    ("beta-above-one", None, ["--model.optimizer.init_args.betas", "[0.9, 1.5]"],
     ["model.optimizer.init_args.betas must be two numbers in [0, 1)"]),
    ("ckpt-path-missing", None, ["--ckpt_path", "{tmp}/none.ckpt"], ["--ckpt_path {tmp}/none.ckpt: no such file"]),
    ("ckpt-path-folder", None, ["--ckpt_path", "{tmp}"], ["--ckpt_path {tmp}: a folder, not a checkpoint file"]),
    ("ckpt-path-text-file", triples_file(b"not a checkpoint\n"), ["--ckpt_path", "{tmp}/file"],
     ["--ckpt_path {tmp}/file: not a PyTorch checkpoint"]),
    ("ckpt-path-plain-state-dict", plain_state_dict, ["--ckpt_path", "{tmp}/file"],
     ["--ckpt_path {tmp}/file: not a Lightning training checkpoint", "model.init_from"]),
    ("triples-invalid-utf8", triples_file(b"q\tpositive\tnegative\nq\tcaf\xe9\tnegative\n"),
     ["--data.source.path", "{tmp}/file"], ["{tmp}/file:2: invalid UTF-8"]),
    ("triples-empty-column", triples_file(b"q\tpositive\tnegative\n\nq\t \tnegative\n"),
     ["--data.source.path", "{tmp}/file"], ["{tmp}/file:3: empty positive column"]),
]


@pytest.mark.parametrize("prepare, extra, words", [row[1:] for row in TRAIN_ROWS], ids=[row[0] for row in TRAIN_ROWS])
def test_train_refuses_in_one_line(shared_dir, tmp_path, capsys, monkeypatch, prepare, extra, words):
    monkeypatch.delenv("HIL_DEBUG", raising=False)
    if prepare is not None:
        prepare(tmp_path / "file")
    places = Places(tmp_path, tmp_path, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        run_train(train_args(tmp_path, *[places.fill(arg) for arg in extra]))
    err = capsys.readouterr().err
    # Lightning may print its own notices (seed, accelerator) before the error: the error is one line, the last.
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert_one_error_line(done.value.code, errors[0], "error: ")
    assert "Traceback" not in err, err
    assert_words(errors[0], words, places)


def test_hil_train_console_script_exits_0_after_a_successful_run(shared_dir, tmp_path, monkeypatch):
    """``sys.exit(train_main())`` is what the ``hil-train`` script does: a returned object would print and exit 1."""
    monkeypatch.setattr(sys, "argv", ["hil-train", *train_args(tmp_path)])
    assert train_main() is None
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


# -- the Python API ---------------------------------------------------------------------------------------------------

def load_beir_call(path: str, **options: Any) -> Callable[[Places], Any]:
    from hil.data.beir import load_beir

    return lambda places: load_beir(places.fill(path), **options)


def settings_call(**options: Any) -> Callable[[Places], Any]:
    from hil.evaluation.evaluate import EvaluationSettings

    return lambda places: EvaluationSettings(**options)


def load_encoder_call(path: str) -> Callable[[Places], Any]:
    from hil.modeling.loading import load_encoder

    return lambda places: load_encoder(places.fill(path))


def empty_folder_then(call: Callable[[Places], Any]) -> Callable[[Places], Any]:
    def prepared(places: Places) -> Any:
        (places.tmp / "empty").mkdir()
        return call(places)

    return prepared


def rerank_without_candidates(places: Places) -> Any:
    from hil.data.beir import load_beir
    from hil.evaluation.evaluate import EvaluationSettings, evaluate
    from hil.modeling.loading import load_encoder

    return evaluate(load_encoder(str(places.model)), load_beir(places.data), EvaluationSettings(mode="rerank"))


def module_with_optimizer(**settings: Any) -> Callable[[Places], Any]:
    from hil.modeling.loading import load_encoder
    from hil.modeling.module import RetrieverModule

    return lambda places: RetrieverModule(load_encoder(str(places.model)),
                                          optimizer=functools.partial(torch.optim.AdamW, **settings))


def read_qrels_call(text: str) -> Callable[[Places], Any]:
    from hil.data.beir import read_qrels_tsv

    def call(places: Places) -> Any:
        path = places.tmp / "qrels.tsv"
        path.write_text(text, encoding="utf-8")
        return read_qrels_tsv(path)

    return call


def read_run_call(path: str) -> Callable[[Places], Any]:
    from hil.evaluation.runs import read_trec_run

    return lambda places: read_trec_run(places.fill(path))


def read_triples_call(text: str, **options: Any) -> Callable[[Places], Any]:
    from hil.data.triples import read_triples

    def call(places: Places) -> Any:
        path = places.tmp / "triples.tsv"
        path.write_text(text, encoding="utf-8")
        return read_triples(path, **options)

    return call


def damaged_index_json(places: Places) -> Any:
    from hil.retrieval.index import TokenIndex

    folder = places.tmp / "index"
    folder.mkdir()
    (folder / "index.json").write_text("{", encoding="utf-8")
    return TokenIndex.load(folder)


def build_index_call(**options: Any) -> Callable[[Places], Any]:
    from hil.modeling.loading import load_encoder
    from hil.retrieval.builder import build_index

    return lambda places: build_index(load_encoder(str(places.model)), ["d1", "d2"], ["one text", "another text"],
                                      places.tmp / "index", progress=False, **options)


# (id, call, the UserError subclass expected, words of its message)
API_ROWS = [
    ("load_beir-missing-folder", load_beir_call("{tmp}/nowhere"), MissingInputError, ["{tmp}/nowhere"]),
    ("load_beir-missing-split", load_beir_call("{data}", split="dev"), MissingInputError,
     ["no qrels/dev.tsv", "splits found: test"]),
    ("load_beir-relevance-level-0", load_beir_call("{data}", relevance_level=0), UserError,
     ["relevance_level must be an integer >= 1"]),
    ("load_beir-outside-corpus-option", load_beir_call("{data}", judged_outside_corpus="drop"), UserError,
     ["judged_outside_corpus must be 'error' or 'keep'"]),
    ("read_qrels_tsv-score-with-a-unit", read_qrels_call("q1\td1\t1\nq1\td2\t2pt\n"), DataFormatError,
     ["qrels.tsv:2: score '2pt' is not an integer"]),
    ("settings-k-zero", settings_call(k=0), UserError, ["k must be >= 1 (got 0)"]),
    ("settings-ncandidates-zero", settings_call(ncandidates=0), UserError, ["ncandidates must be >= 1 (got 0)"]),
    ("settings-unknown-mode", settings_call(mode="dense"), UserError, ["mode must be one of"]),
    ("settings-full-without-index", settings_call(mode="full", index_root=None), UserError, ["give index_root"]),
    ("evaluate-rerank-without-candidates", rerank_without_candidates, UserError, ["mode='rerank' needs candidates"]),
    ("load_encoder-missing-path", load_encoder_call("{tmp}/no-such-model"), UserError, ["{tmp}/no-such-model"]),
    ("load_encoder-empty-folder", empty_folder_then(load_encoder_call("{tmp}/empty")), UserError, ["{tmp}/empty"]),
    ("module-negative-learning-rate", module_with_optimizer(lr=-1.0), UserError,
     ["model.optimizer.init_args.lr must be a finite number >= 0 (got -1.0)"]),
    ("read_trec_run-missing", read_run_call("{tmp}/none.trec"), MissingInputError,
     ["{tmp}/none.trec: no such run file"]),
    ("read_triples-negative-limit", read_triples_call("q\tp\tn\n", limit=-1), UserError, ["limit must be >= 0"]),
    ("read_triples-four-columns", read_triples_call("q\tp\tn\nq\tp\tn\tx\n"), DataFormatError,
     ["triples.tsv:2: expected 3 tab-separated columns", "found 4"]),
    ("index-json-damaged", damaged_index_json, UserError, ["index.json"]),
    ("build_index-nlist-above-the-tokens", build_index_call(faiss_kind="ivfflat", faiss_params={"nlist": 100000}),
     UserError, ["nlist=100000"]),
]


@pytest.mark.parametrize("call, expected, words", [row[1:] for row in API_ROWS], ids=[row[0] for row in API_ROWS])
def test_api_raises_a_user_error_naming_the_problem(good_dataset, tiny_export, tmp_path, call, expected, words):
    places = Places(good_dataset, tiny_export, tmp_path)
    with pytest.raises(Exception) as raised:
        call(places)
    assert isinstance(raised.value, expected), f"{type(raised.value).__name__}: {raised.value}"
    assert "\n" not in str(raised.value)
    assert_words(str(raised.value), words, places)


# -- as real processes (the scripts, with their own interpreter start) ------------------------------------------------

def script(*args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HIL_DEBUG", None)
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture(scope="module")
def processes(good_dataset, tiny_export, tmp_path_factory) -> dict[str, tuple[int, str, Places]]:
    """The subprocess rows, started together (each spends 10 s or more importing torch) and then awaited; the
    in-process rows above cover every case, these only that the scripts' exit status and stderr are the same."""
    tmp = tmp_path_factory.mktemp("processes")
    data = tmp / "data"
    shutil.copytree(good_dataset, data)
    truncate_line(data / "corpus.jsonl", 9)
    started = {
        "evaluate-truncated-corpus-line": script("evaluate.py", "--dataset", str(data), "--model", str(tiny_export),
                                                 "--quiet", "--no-stats", "--output", str(tmp / "results")),
        "train-negative-learning-rate": script("train.py", *train_args(tmp, "--model.optimizer.init_args.lr=-1")),
    }
    places = Places(data, tiny_export, tmp)
    return {name: (process.wait(timeout=300), process.communicate()[1], places) for name, process in started.items()}


@pytest.mark.parametrize("name, prefix, words", [
    ("evaluate-truncated-corpus-line", "evaluate.py: error: ", ["{data}/corpus.jsonl:9: malformed JSON"]),
    ("train-negative-learning-rate", "error: ", ["model.optimizer.init_args.lr must be a finite number >= 0"]),
])
def test_scripts_refuse_in_one_line(processes, name, prefix, words):
    code, err, places = processes[name]
    if name.startswith("train"):  # Lightning's notices ("Seed set to ...") may come first: the error is the last line
        err = err.strip().splitlines()[-1] + "\n" if err.strip() else err
    line = assert_one_error_line(code, err, prefix)
    assert_words(line, words, places)
