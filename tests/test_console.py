"""The ``hil`` command (hil.cli.main) and the commands the README shows.

- every subcommand answers ``--help`` (exit 0) and a bad option or command in one line (exit 2);
- ``hil evaluate --print_config`` prints YAML that, given back as ``--config``, describes the same experiment;
- ``hil evaluate`` from YAML recipes (``eval/scifact`` + ``eval/plaid``) measures what ``evaluate.py`` measures, and
  its metrics.json records the PLAID settings it searched with;
- ``hil index`` and ``hil search`` on a tiny dataset;
- every ``python evaluate.py ...`` and ``hil ...`` command of the README runs with tiny inputs substituted for its
  model and dataset (GPU lines only where a GPU is).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from hil.cli.evaluate_script import main as evaluate_main
from hil.cli.main import main as hil_main
from hil.cli.main import parse_command, parse_experiment

README = Path(__file__).resolve().parents[1] / "README.md"


def write_beir(folder: Path, n_docs: int = 40) -> Path:
    words = "cell gene protein tumor vaccine dose brain heart blood lung risk insulin growth therapy".split()
    (folder / "qrels").mkdir(parents=True)
    corpus = {f"d{i:02d}": " ".join(words[(i * k) % len(words)] for k in range(1, 8)) for i in range(n_docs)}
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": "", "text": t}) + "\n"
                                                 for d, t in corpus.items()))
    queries = {f"q{i}": f"{words[i]} {words[(3 * i + 1) % len(words)]}" for i in range(5)}
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\td{(7 * i) % n_docs:02d}\t{1 + i % 2}\n" for i in range(5)))
    with open(folder / "bm25-top100.trec", "w") as run:  # a first-stage run, as TREC DL ships one
        for i in range(5):
            for rank, j in enumerate(range(10), start=1):
                run.write(f"q{i} Q0 d{(7 * i + j) % n_docs:02d} {rank} {10.0 - j} bm25\n")
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    from hil.modeling.loading import load_encoder

    root = tmp_path_factory.mktemp("console")
    torch.manual_seed(0)
    export = load_encoder(str(tiny_model_dir), dim=16, query_maxlen=12, doc_maxlen=24).save_pretrained(
        root / "model" / "export")
    return {"export": export, "beir": write_beir(root / "beir" / "tiny"), "root": root}


@pytest.mark.parametrize("command", ["evaluate", "index", "search", "fit", "beir", "paper", "analyze", "share",
                                     "teacher"])
def test_every_subcommand_answers_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(hil_main([command, "--help"]))
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage" in out.lower()
    if command != "fit":  # each says the name it was called by
        assert f"usage: hil {command}" in " ".join(out.split()), out[:200]


@pytest.mark.parametrize("argv, words", [
    (["nonsense"], "unknown command 'nonsense'"),
    (["evaluate", "--dataset", "x", "--settings.k", "zero"], "settings.k"),
    (["evaluate", "--dataset", "x", "--settings.backend", "hil.retrieval.backends.configs.NoSuch"], "backend"),
    (["evaluate", "--model", "m"], "no dataset"),
])
def test_bad_commands_are_one_line(argv, words, capsys):
    assert hil_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and words in err[0], err


def test_print_config_round_trips(tmp_path, capsys):
    argv = ["evaluate", "--config", "eval/scifact", "--config", "eval/plaid", "--model", "runs/x/export",
            "--settings.search.init_args.nprobe", "3", "--statistics.p_adjust", "bh"]
    assert hil_main([*argv, "--print_config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(printed)
    direct = parse_experiment(argv[1:], "hil evaluate")
    again = parse_experiment(["--config", str(tmp_path / "printed.yaml")], "hil evaluate")
    assert again.settings == direct.settings and again.statistics == direct.statistics
    assert again.datasets == direct.datasets and again.models == direct.models
    assert again.settings.search.nprobe == 3 and again.settings.backend.kind == "plaid"


def test_hil_evaluate_from_recipes_matches_evaluate_py_and_records_what_ran(tiny, tmp_path):
    export, beir = tiny["export"], tiny["beir"]
    out_hil, out_old = tmp_path / "hil", tmp_path / "old"
    assert hil_main(["evaluate", "--config", "eval/scifact", "--config", "eval/plaid", "--model", str(export),
                     "--datasets", json.dumps([{"name": str(beir)}]), "--output", str(out_hil), "--folders", "flat",
                     "--settings.index_root", str(tmp_path / "indexes"), "--settings.progress", "false",
                     "--settings.search.init_args.nprobe", "2", "--settings.backend.init_args.n_centroids", "8",
                     "--quiet", "true"]) == 0
    assert evaluate_main(["--model", str(export), "--dataset", str(beir), "--backend", "plaid", "--backend-params",
                          json.dumps({"nprobe": 2, "n_centroids": 8}), "--output", str(out_old), "--quiet",
                          "--index-root", str(tmp_path / "indexes")]) == 0
    new = json.loads((out_hil / "metrics.json").read_text())
    old = json.loads((out_old / "metrics.json").read_text())
    (model_new,) = [name for name in new["results"] if name != "bm25"]
    (model_old,) = [name for name in old["results"] if name != "bm25"]
    assert new["results"][model_new]["metrics"] == old["results"][model_old]["metrics"]
    assert new["results"]["bm25"]["metrics"] == old["results"]["bm25"]["metrics"]
    used = new["results"][model_new]["search_stats"]["search"]
    # nprobe as given; ndocs and stage2_docs ColBERTv2's for the recipe's k = 1000
    assert used == {"backend": "plaid", "nprobe": 2, "ndocs": 1024, "stage2_docs": 4096}
    assert new["results"][model_new]["backend"]["params"]["n_centroids"] == 8
    assert new["settings"]["evaluation"]["search"]["init_args"]["nprobe"] == 2
    assert new["statistics"]["p_adjust"]["method"] == "holm"


def test_hil_index_and_search(tiny, tmp_path, capsys):
    export, beir = tiny["export"], tiny["beir"]
    common = ["--model", str(export), "--dataset", str(beir), "--settings.index_root", str(tmp_path / "idx"),
              "--settings.progress", "false", "--quiet", "true"]
    assert hil_main(["index", *common]) == 0
    assert "40 documents" in capsys.readouterr().out
    assert hil_main(["search", *common, "--output", str(tmp_path / "run.trec")]) == 0
    lines = (tmp_path / "run.trec").read_text().splitlines()
    assert {line.split()[0] for line in lines} == {f"q{i}" for i in range(5)}
    # one copy of the run: the records' run file is the same file (a hard link), also after a rerun reusing it
    (kept,) = (tmp_path / "run.trec.parts").glob("*.trec")
    assert os.path.samefile(kept, tmp_path / "run.trec") and os.stat(kept).st_nlink == 2
    assert hil_main(["search", *common, "--output", str(tmp_path / "run.trec"), "--overwrite"]) == 0
    assert (tmp_path / "run.trec").read_text().splitlines() == lines
    assert os.path.samefile(kept, tmp_path / "run.trec")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    (tmp_path / "a-folder").mkdir()  # a folder where the run file goes: refused before any work, nothing written
    assert hil_main(["search", *common, "--output", str(tmp_path / "a-folder")]) == 2
    assert "a folder is there" in capsys.readouterr().err and not (tmp_path / "a-folder.parts").exists()
    assert hil_main(["search", "--dataset", str(beir), "--output", str(tmp_path / "r2.trec")]) == 2


# -- the README's commands ---------------------------------------------------------------------------------------

DOCUMENTS = (README, README.parent / "docs" / "guide.md", README.parent / "docs" / "results.md")


def readme_commands(prefixes: tuple[str, ...]) -> list[str]:
    """Every command line of the README's (and docs/guide.md's, docs/results.md's) code blocks starting with one of
    ``prefixes`` (continuations joined)."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in DOCUMENTS)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = shlex.join(shlex.split(line, comments=True))
            if line.startswith(prefixes):
                commands.append(line)
    return commands


def tiny_argv(command: str, tiny: dict, tmp_path: Path) -> list[str] | None:
    """The command's arguments with the tiny model and dataset in place of its own (None: it needs a GPU)."""
    args = shlex.split(command)
    if "cuda" in args and not torch.cuda.is_available():
        return None
    start = 2 if args[0] == "python" else 1
    out, model, beir = [], str(tiny["export"]), str(tiny["beir"])
    skip = False
    for i, arg in enumerate(args[start:]):
        if skip:
            skip = False
            continue
        previous = args[start + i - 1] if i else ""
        if previous == "--model":
            out.append(f"{model}+{model}" if "+" in arg else model)
        elif previous in ("--dataset",):
            out.append(beir)
        elif previous == "--first-stage-run":
            out.append(str(tiny["beir"] / "bm25-top100.trec"))
        elif previous == "--processes":
            out.append("1")  # processes are covered by tests/test_multiprocess_encoding.py
        elif previous in ("--faiss-params", "--backend-params"):
            out.append(json.dumps({"nlist": 4, "m": 4, "nbits": 4, "nprobe": 4}))
        else:
            out.append(arg)
    if "--dataset" in out and out[out.index("--dataset") + 1] == beir and "irds:" in command:
        return None  # ir_datasets ids: tests/test_irds.py (no download here)
    return [*out, "--output", str(tmp_path / "out"), "--index-root", str(tmp_path / "indexes"), "--quiet",
            "--no-stats"]


def test_every_evaluate_command_of_the_readme_runs(tiny, tmp_path):
    commands = readme_commands(("python evaluate.py",))
    assert len(commands) >= 8
    ran = 0
    for command in commands:
        argv = tiny_argv(command, tiny, tmp_path)
        if argv is None:
            continue
        assert evaluate_main(argv) == 0, command
        assert (tmp_path / "out" / "metrics.json").is_file(), command
        ran += 1
    assert ran >= 8


def test_every_hil_command_of_the_readme_parses(tiny, tmp_path, monkeypatch):
    # From an empty folder: what the README's own commands leave in the working tree (runs/demo/scifact.trec, a
    # file where ``hil evaluate`` would write a folder) must not decide whether the commands parse.
    monkeypatch.chdir(tmp_path)
    commands = readme_commands(("hil evaluate", "hil index", "hil search"))
    assert len(commands) >= 6, "the README shows the hil command"
    for command in commands:  # each by its own command's parser (hil search's --query is no evaluate option)
        name, argv = shlex.split(command)[1], shlex.split(command)[2:]
        experiment, own = parse_command(argv, f"hil {name}", name)
        assert (experiment is not None and experiment.datasets and experiment.models) or own.get("request"), command
    yaml = re.search(r"```yaml\n# hil evaluate --config my-eval.yaml\n(.*?)```", README.read_text(), re.S)
    assert yaml is not None, "the README shows an evaluation config"
    config = tiny["root"] / "my-eval.yaml"
    config.write_text(yaml.group(1))
    experiment = parse_experiment(["--config", str(config)], "hil evaluate")
    assert [d.name for d in experiment.datasets] == ["scifact", "msmarco/dl19"]
    assert experiment.settings.backend.residual_bits == 2 and experiment.settings.search.nprobe is None
    assert experiment.settings.resolved_search.given() == {"nprobe": 4, "ndocs": 1024, "stage2_docs": 4096}  # k 1000


def test_hil_help_imports_no_torch():
    """``hil --help`` answers without importing torch, transformers or Lightning (seconds of imports for a usage
    line): each subcommand imports what it runs."""
    import subprocess
    import sys

    probe = ("import sys\nfrom hil.cli.main import main\nassert main(['--help']) == 0\n"
             "heavy = sorted(m for m in ('torch', 'transformers', 'pytorch_lightning') if m in sys.modules)\n"
             "print('heavy:', heavy)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "heavy: []" in done.stdout and "usage: hil" in done.stdout


@pytest.mark.parametrize("text, line, words", [
    ("datasets:\n  - name: scifact\nmodells:\n  - {source: x}\n", 3, "Option 'modells' is not accepted"),
    ("datasets:\n  - name: scifact\nsettings:\n  mode: full\n  kk: 3\n", 5, "does not accept option 'kk'"),
    ("datasets:\n  - name: scifact\nsettings: {mode: full, k: zero}\n", 3, 'key "settings.k"'),
])
def test_a_yaml_mistake_names_the_file_and_line(tmp_path, capsys, text, line, words):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("output: results/x\nsettings: {k: 10}\n")  # an earlier file with a valid k: not the one named
    bad.write_text(text)
    assert hil_main(["evaluate", "--config", str(good), "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: {bad}:{line}: " in err[0] and words in err[0], err


def test_max_docs_and_max_queries_slice_every_dataset_unless_it_sets_its_own(tmp_path):
    """``--max-docs`` / ``--max-queries`` (as ``evaluate.py`` and ``hil beir`` spell them) slice every dataset; a
    dataset's own ``max_docs`` in the YAML wins."""
    config = tmp_path / "e.yaml"
    config.write_text("datasets:\n  - {name: scifact, max_docs: 50}\n  - name: nfcorpus\n")
    experiment = parse_experiment(["--config", str(config), "--dataset", "arguana", "--max-docs", "300",
                                   "--max-queries", "20", "--model", "m"], "hil evaluate")
    assert [(d.name, d.max_docs, d.max_queries) for d in experiment.datasets] == [
        ("scifact", 50, 20), ("nfcorpus", 300, 20), ("arguana", 300, 20)]
    plain = parse_experiment(["--dataset", "scifact", "--model", "m"], "hil evaluate")
    assert (plain.datasets[0].max_docs, plain.datasets[0].max_queries) == (None, None)
