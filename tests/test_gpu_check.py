"""``bench/gpu_check.py`` (``make gpu-check``): its arithmetic and step handling on hand-made inputs, a failing step
(one line naming the step and its log, exit 1), and -- slow -- the whole ``--dry-run`` on the CPU, whose JSON is
checked against the ``metrics.json`` files the evaluations wrote, read here independently."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def check():
    return load("gpu_check")


def rank_report(rank, triples, seconds, cuda=None, rss=100):
    return {"rank": rank, "world_size": 2, "device": f"cuda:{rank}", "precision": "16-mixed", "steps": 10,
            "skip_steps": 2, "timed_steps": 8, "timed_triples": triples, "seconds": seconds,
            "cuda_max_memory_allocated_bytes": cuda, "peak_rss_bytes": rss}


def cuda_skipped_tests_without_the_gpu_mark(source: str) -> list[str]:
    """Test functions of ``source`` skipped by a decorator that mentions CUDA (directly or through a module-level
    name such as ``needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), ...)``) but not marked ``gpu``."""
    tree = ast.parse(source)
    def cuda_skip(text: str) -> bool:
        return "skipif" in text and "cuda" in text

    cuda_names = {target.id for node in tree.body if isinstance(node, ast.Assign) and cuda_skip(ast.unparse(node.value))
                  for target in node.targets if isinstance(target, ast.Name)}
    module_marked = any(isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0])
                        and "mark.gpu" in ast.unparse(node.value) for node in tree.body)
    unmarked = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            decorators = [ast.unparse(d) for d in node.decorator_list]
            skipped = any(cuda_skip(d) or d in cuda_names for d in decorators)
            if skipped and not module_marked and "pytest.mark.gpu" not in decorators:
                unmarked.append(node.name)
    return unmarked


def test_every_test_that_needs_cuda_is_marked_gpu():
    """``make gpu-check`` runs ``pytest -m gpu``: a GPU test without the mark would never run there."""
    unmarked = {path.name: cuda_skipped_tests_without_the_gpu_mark(path.read_text())
                for path in sorted((REPO / "tests").glob("test_*.py"))}
    assert {name: tests for name, tests in unmarked.items() if tests} == {}
    example = ("import pytest, torch\nneeds = pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\n"
               "@needs\ndef test_a(): pass\n@pytest.mark.gpu\n@needs\ndef test_b(): pass\n"
               "@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='x')\ndef test_c(): pass\n"
               "@pytest.mark.parametrize('device', ['cuda', 'cpu'])\ndef test_d(device): pass\n")
    assert cuda_skipped_tests_without_the_gpu_mark(example) == ["test_a", "test_c"]


# -- arithmetic ------------------------------------------------------------------------------------------------------

def test_training_figures_count_every_rank_over_the_slowest(check):
    figures = check.training_figures([rank_report(0, 256, 2.0, cuda=5_000, rss=10),
                                      rank_report(1, 256, 4.0, cuda=7_000, rss=30)])
    assert figures["triples_per_s"] == pytest.approx(512 / 4.0)
    assert figures["timed_triples"] == 512 and figures["timed_seconds"] == 4.0
    assert figures["peak_gpu_memory_bytes"] == 7_000 and figures["peak_rss_bytes"] == 30
    # one rank without CUDA (a CPU run): no GPU figure rather than a mix
    assert check.training_figures([rank_report(0, 8, 1.0, cuda=5), rank_report(1, 8, 1.0)])[
        "peak_gpu_memory_bytes"] is None
    with pytest.raises(ValueError, match="no timed steps"):
        check.training_figures([rank_report(0, 0, None)])


def test_evaluation_figures_read_the_model_run_of_metrics_json(check):
    metrics = {"dataset": {"documents": 500, "queries": 20},
               "results": {"bm25": {"metrics": {"ndcg@10": 0.9}, "index_seconds": 1.0, "search_seconds": 1.0},
                           "hil-full": {"metrics": {"ndcg@10": 0.25}, "device": "cuda:0", "index_seconds": 4.0,
                                        "search_seconds": 0.5}}}
    figures = check.evaluation_figures(metrics, {"cuda_max_memory_allocated_bytes": 123, "peak_rss_bytes": 456})
    assert figures["run"] == "hil-full" and figures["ndcg@10"] == 0.25
    assert figures["documents_per_s"] == pytest.approx(125.0) and figures["queries_per_s"] == pytest.approx(40.0)
    assert figures["peak_gpu_memory_bytes"] == 123 and figures["peak_rss_bytes"] == 456
    metrics["results"]["colbert-full"] = metrics["results"]["hil-full"]
    with pytest.raises(ValueError, match="one model run"):
        check.evaluation_figures(metrics, {"cuda_max_memory_allocated_bytes": None, "peak_rss_bytes": 1})


def test_junit_counts(check, tmp_path):
    xml = tmp_path / "report.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" skipped="3" '
                   'tests="10"></testsuite></testsuites>')
    assert check.junit_counts(xml) == {"tests": 10, "failures": 2, "errors": 1, "skipped": 3, "passed": 4}


def test_plan_needs_a_gpu_unless_dry_and_checks_its_numbers(check):
    parse = check.build_parser().parse_args
    with pytest.raises(ValueError, match="no CUDA GPU"):
        check.plan_from(parse([]), cuda_devices=0)
    plan = check.plan_from(parse([]), cuda_devices=4)
    assert (plan.devices, plan.precisions, plan.eval_device, plan.eval_precision) == (
        4, ("16-mixed", "bf16-mixed"), "cuda", "fp16")
    assert plan.preset == "configs/presets/gpu.yaml" and plan.max_docs is None
    dry = check.plan_from(parse(["--dry-run"]), cuda_devices=0)
    assert (dry.devices, dry.accelerator, dry.precisions, dry.eval_device) == (2, "cpu", ("32-true", "bf16-mixed"),
                                                                                "cpu")
    for bad, words in ((["--dry-run", "--skip-steps", "4"], "--skip-steps"), (["--dry-run", "--models", "x"], "x"),
                       (["--dry-run", "--steps", "evaluate"], "needs train")):
        with pytest.raises(ValueError, match=words):
            check.plan_from(parse(bad), cuda_devices=0)


def test_the_evaluation_wrapper_keeps_the_exit_status_and_reports_memory(tmp_path, monkeypatch):
    probe = load("gpu_check_probe")
    script = tmp_path / "prog.py"
    script.write_text("import sys\nprint(sys.argv[1:])\nsys.exit(int(sys.argv[1]))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for status in (0, 3):
        report = tmp_path / f"report{status}.json"
        with pytest.raises(SystemExit) as exited:
            probe.run_script(report, str(script), [str(status), "--flag"])
        assert exited.value.code == status and sys.argv == [str(script), str(status), "--flag"]
        record = json.loads(report.read_text())
        assert record["exit_status"] == status and positive(record["peak_rss_bytes"])
        assert record["cuda_max_memory_allocated_bytes"] is None  # this process never used CUDA


def test_a_failing_step_names_itself_its_status_and_log(check, tmp_path):
    command = [sys.executable, "-c", "import sys; print('working'); print('error: no such model'); sys.exit(3)"]
    with pytest.raises(check.StepFailed) as caught:
        check.run_step("train-x", command, tmp_path)
    message = str(caught.value)
    assert "\n" not in message and caught.value.status == 3
    assert message.startswith("step train-x failed (exit 3): error: no such model; log: ")
    assert message.endswith(str(tmp_path / "train-x.log")) and "working" in (tmp_path / "train-x.log").read_text()


def test_the_script_exits_1_with_one_line_naming_the_failing_step(check, tmp_path, capsys):
    """A real step (train.py with a backbone that is not there) fails: exit 1, one line on stderr naming the step
    and its log, and the JSON says which step failed."""
    out = tmp_path / "check"
    status = check.main(["--dry-run", "--steps", "train", "--models", "colbert", "--precisions", "32-true",
                         "--devices", "1", "--backbone", str(tmp_path / "no-such-model"), "--out", str(out)])
    assert status == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1, errors
    log = out / "train-colbert-32-true.log"
    assert errors[0].startswith("gpu-check: step train-colbert-32-true failed (exit 2): ")
    assert errors[0].endswith(f"; log: {log}") and "no-such-model" in log.read_text()
    record = json.loads((out / "gpu-check.json").read_text())
    assert record["status"] == "failed" and record["failed_step"] == "train-colbert-32-true"
    assert record["failed_log"] == str(log) and record["training"] == []


# -- the whole dry run -----------------------------------------------------------------------------------------------

def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path, shared_dir):
    out = tmp_path / "dry"
    done = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    record = check_dry_run(out, done.stdout)
    assert len(record["training"]) == 4 and len(record["evaluation"]) == 8 and len(record["cpu_reference"]) == 4


def check_dry_run(out: Path, stdout: str) -> dict:
    """What a finished dry run into ``out`` must hold: its JSON's fields, finite positive figures, and nDCG@10 and
    counts equal to those of the ``metrics.json`` files found under ``out`` and read here."""
    record = json.loads((out / "gpu-check.json").read_text())
    assert record["status"] == "ok" and record["dry_run"] is True
    for key in ("created", "versions", "git_commit", "plan"):
        assert key in record
    env = record["environment"]
    assert env["torch"] and env["faiss"]["version"] and isinstance(env["gpus"], list) and "driver" in env
    plan = record["plan"]
    if "tests" in plan["steps"]:
        tests = record["gpu_tests"]
        assert tests["tests"] >= 1 and tests["failures"] == tests["errors"] == 0

    trained = {(r["model"], r["precision"]): r for r in record["training"]}
    assert set(trained) == {(m, p) for m in plan["models"] for p in plan["precisions"]}
    for run in trained.values():
        assert run["world_size"] == run["ranks"] == plan["devices"]
        assert run["timed_steps"] == plan["max_steps"] - plan["skip_steps"]
        assert run["timed_triples"] == run["timed_steps"] * plan["batch_size"] * plan["devices"]
        assert positive(run["triples_per_s"]) and positive(run["peak_rss_bytes"])
        assert run["peak_gpu_memory_bytes"] is None  # no CUDA here
        assert (Path(run["export"]) / "config.json").is_file() and (out / f"{run['step']}.log").is_file()
        assert f"{run['model']} {run['precision']}" in stdout

    # every metrics.json the evaluations wrote, found and read here, keyed by what it says it evaluated
    written = {}
    for path in out.rglob("metrics.json"):
        metrics = json.loads(path.read_text())
        settings = metrics["settings"]
        written[(settings["model"], settings["dataset"], settings["device"], settings["precision"])] = metrics
    runs = record["evaluation"] + record["cpu_reference"]
    assert len(record["evaluation"]) == len(trained) * len(plan["datasets"])
    assert len(record["cpu_reference"]) == len(plan["models"]) * len(plan["datasets"])
    assert len(written) == len(runs)
    for run in runs:
        export = trained[(run["model"], run["trained_precision"])]["export"]
        metrics = written[(export, run["dataset"], run["device"], run["precision"])]
        (name, result), = metrics["results"].items()
        assert name == ("hil-full" if run["model"] == "colbert_hil" else "colbert-full")
        assert metrics["settings"].get("backend", metrics["settings"].get("faiss")) == "plaid"
        assert result["metrics"]["ndcg@10"] == run["ndcg@10"] and 0 < run["ndcg@10"] <= 1
        assert run["documents"] == metrics["dataset"]["documents"] and run["queries"] == metrics["dataset"]["queries"]
        assert run["queries"] == plan["max_queries"]
        assert run["documents_per_s"] == pytest.approx(metrics["dataset"]["documents"] / result["index_seconds"])
        assert run["queries_per_s"] == pytest.approx(metrics["dataset"]["queries"] / result["search_seconds"])
        assert positive(run["documents_per_s"]) and positive(run["queries_per_s"]) and positive(run["peak_rss_bytes"])
        assert (out / f"{run['step']}.log").is_file()
    assert {r["precision"] for r in record["evaluation"]} == {"bf16"}
    assert {r["precision"] for r in record["cpu_reference"]} == {"fp32"}
    assert "nDCG@10 [cpu]" in stdout
    return record
