"""``bench/gpu_check.py`` (``make gpu-check``): its arithmetic and step handling on hand-made inputs, a failing step
(one line naming the step and its log, exit 1), and -- slow -- the whole ``--dry-run`` on the CPU, whose JSON is
checked against the ``metrics.json`` files the evaluations wrote, read here independently."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
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
    def cuda_skip(text: str) -> bool:  # skipped without CUDA (a test skipped *with* a GPU is a CPU-only test)
        return "skipif" in text and "cuda" in text and not re.search(r"skipif\(\s*torch\.cuda\.is_available\(\)", text)

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
               "@pytest.mark.parametrize('device', ['cuda', 'cpu'])\ndef test_d(device): pass\n"
               "@pytest.mark.skipif(torch.cuda.is_available(), reason='a GPU is here')\ndef test_e(): pass\n")
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
    assert figures["index_build_seconds"] is None  # an index reused: no split
    assert figures["search_step_seconds"] == {"encode_s": None, "ann_s": None, "score_s": None}
    metrics["results"]["hil-full"].update(index_build_seconds={"encode": 3.0, "join": 0.2, "search_structures": 0.7},
                                          search_stats={"encode_s": 0.1, "ann_s": 0.3, "score_s": 0.05, "k": 10})
    figures = check.evaluation_figures(metrics, {"cuda_max_memory_allocated_bytes": 123, "peak_rss_bytes": 456})
    assert figures["index_build_seconds"] == {"encode": 3.0, "join": 0.2, "search_structures": 0.7}
    assert figures["search_step_seconds"] == {"encode_s": 0.1, "ann_s": 0.3, "score_s": 0.05}
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
    assert (plan.devices, plan.strategy, plan.precisions, plan.eval_device, plan.eval_precision) == (
        4, "ddp", ("16-mixed", "bf16-mixed"), "cuda", "fp16")
    assert plan.preset == "configs/presets/gpu.yaml" and plan.max_docs is None
    assert (plan.budget_s, plan.datasets, plan.max_steps, plan.skip_steps) == (240.0, ("scifact",), 120, 20)
    assert check.plan_from(parse([]), cuda_devices=1).strategy == "single-device"  # not DDP on one device
    assert check.plan_from(parse(["--budget-s", "0"]), cuda_devices=1).budget_s is None
    dry = check.plan_from(parse(["--dry-run"]), cuda_devices=0)
    assert (dry.devices, dry.accelerator, dry.precisions, dry.eval_device) == (2, "cpu", ("32-true", "bf16-mixed"),
                                                                                "cpu")
    for bad, words in ((["--dry-run", "--skip-steps", "4"], "--skip-steps"), (["--dry-run", "--models", "x"], "x"),
                       (["--dry-run", "--steps", "evaluate"], "needs train"),
                       (["--dry-run", "--datasets", "no-such-set"], "--datasets no-such-set"),
                       (["--dry-run", "--budget-s", "-1"], "--budget-s")):
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


def test_the_machine_is_read_in_a_subprocess_as_in_this_process(check, tmp_path):
    """With a GPU the check reads the machine in a subprocess (no CUDA context of its own): the same record."""
    report = sys.modules["gpu_check_report"]
    here, there = report.environment(), check.environment_in_subprocess(tmp_path)
    assert there == here and there["faiss"]["version"] and (tmp_path / "environment.log").is_file()


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


# -- the plan and its budget ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def planning():
    load("gpu_check")  # puts bench/ modules in sys.modules under their own names
    return sys.modules["gpu_check_plan"]


def kept_and_left_out(check, planning, argv, budget_s):
    plan = check.plan_from(check.build_parser().parse_args(argv), cuda_devices=1)
    steps = planning.candidate_steps(plan)
    estimates = {s.name: planning.estimate_s(s, plan, planning.H200_TABLE) for s in steps}
    budget = planning.budget_plan(steps, estimates, budget_s, planning.H200_TABLE.overhead_s)
    return budget, [s.name for s, _ in budget.kept], {item["step"]: item["reason"] for item in budget.left_out}


def test_the_default_plan_fits_240_s_at_the_rates_the_issue_measured(check, planning):
    """The default plan on one GPU, estimated by hand from the issue's H200 table (25 s start-up; 301/281 triples/s;
    SciFact's 5,183 documents indexed in 35.0 s and 300 queries searched in 3.84 s on the GPU, 156 documents/s and
    4.9 s on the CPU; the check's own 10 s): what fits in 240 s, in priority order."""
    budget, kept, left_out = kept_and_left_out(check, planning, [], 240.0)
    assert kept == ["train-colbert-16-mixed", "evaluate-colbert-16-mixed-scifact-cuda-fp16",
                    "evaluate-colbert-16-mixed-scifact-cpu-fp32", "train-colbert_hil-16-mixed"]
    by_hand = 10 + (25 + 120 * 32 / 301) + (25 + 35.0 + 3.84) + (25 + 5183 / 156 + 4.9) + (25 + 120 * 32 / 281)
    assert budget.estimate_s == pytest.approx(by_hand) and by_hand <= 240
    hil_on_gpu = 25 + 55.5 + 9.2
    assert left_out["evaluate-colbert_hil-16-mixed-scifact-cuda-fp16"] == (
        f"estimate {hil_on_gpu:.0f} s, {240 - by_hand:.0f} s of the 240 s budget left")
    assert left_out["evaluate-colbert-bf16-mixed-scifact-cuda-fp16"] == "it needs train-colbert-bf16-mixed, left out"
    assert set(left_out) == {"evaluate-colbert_hil-16-mixed-scifact-cuda-fp16", "train-colbert-bf16-mixed",
                             "train-colbert_hil-bf16-mixed", "evaluate-colbert-bf16-mixed-scifact-cuda-fp16",
                             "evaluate-colbert_hil-bf16-mixed-scifact-cuda-fp16",
                             "evaluate-colbert_hil-16-mixed-scifact-cpu-fp32", "gpu-tests"}
    # 300 s: the HIL evaluation (90 s) still does not fit, the two bf16 trainings (40 s, 39 s) after it do
    _, kept, _ = kept_and_left_out(check, planning, [], 300.0)
    assert kept[4:] == ["train-colbert-bf16-mixed", "train-colbert_hil-bf16-mixed"]


def test_steps_come_in_priority_order_and_evaluations_need_their_training(check, planning):
    plan = check.plan_from(check.build_parser().parse_args(["--datasets", "scifact,nfcorpus"]), cuda_devices=1)
    steps = planning.candidate_steps(plan)
    gpu, cpu = "cuda-fp16", "cpu-fp32"
    assert [s.name for s in steps] == [
        "train-colbert-16-mixed", f"evaluate-colbert-16-mixed-scifact-{gpu}",
        f"evaluate-colbert-16-mixed-scifact-{cpu}",
        "train-colbert_hil-16-mixed", f"evaluate-colbert_hil-16-mixed-scifact-{gpu}",
        "train-colbert-bf16-mixed", "train-colbert_hil-bf16-mixed",
        f"evaluate-colbert-16-mixed-nfcorpus-{gpu}", f"evaluate-colbert_hil-16-mixed-nfcorpus-{gpu}",
        f"evaluate-colbert-bf16-mixed-scifact-{gpu}", f"evaluate-colbert-bf16-mixed-nfcorpus-{gpu}",
        f"evaluate-colbert_hil-bf16-mixed-scifact-{gpu}", f"evaluate-colbert_hil-bf16-mixed-nfcorpus-{gpu}",
        f"evaluate-colbert_hil-16-mixed-scifact-{cpu}", f"evaluate-colbert-16-mixed-nfcorpus-{cpu}",
        f"evaluate-colbert_hil-16-mixed-nfcorpus-{cpu}", "gpu-tests"]
    for step in steps:
        if step.kind == "evaluate":
            assert step.needs == f"train-{step.label}"
        if step.kind == "reference":  # a CPU reference goes with the GPU evaluation it is the reference of
            assert step.needs == step.name.replace(cpu, gpu)


def test_the_budget_keeps_steps_in_order_while_they_fit(planning):
    Step = planning.Step
    a, c, tests = Step("train", "a", "colbert", "p"), Step("train", "c", "colbert", "p"), Step("tests")
    b = Step("evaluate", "a", "colbert", "p", "scifact", "cuda", "fp16", needs=a.name)
    estimates = {a.name: 10.0, b.name: 20.0, c.name: 30.0, tests.name: 5.0}

    def plan(budget_s):
        budget = planning.budget_plan([a, b, c, tests], estimates, budget_s, overhead_s=2.0)
        return [s.name for s, _ in budget.kept], {i["step"]: i["reason"] for i in budget.left_out}, budget.estimate_s

    assert plan(None) == ([a.name, b.name, c.name, "gpu-tests"], {}, 67.0)
    assert plan(40.0) == ([a.name, b.name, "gpu-tests"], {c.name: "estimate 30 s, 8 s of the 40 s budget left"}, 37.0)
    kept, left_out, total = plan(15.0)
    assert (kept, set(left_out), total) == ([a.name], {b.name, c.name, "gpu-tests"}, 12.0)
    kept, left_out, total = plan(11.0)  # the training does not fit: neither does its evaluation; the tests do
    assert (kept, total) == (["gpu-tests"], 7.0)
    assert left_out == {a.name: "estimate 10 s, 9 s of the 11 s budget left", b.name: f"it needs {a.name}, left out",
                        c.name: "estimate 30 s, 9 s of the 11 s budget left"}


def earlier_check(gpu="NVIDIA H200", dry_run=False):
    """A gpu-check.json of a check that trained ColBERT 16-mixed on 2 GPUs (6,000 triples/s: 3,000 per device, 120
    steps of 32 in 40 s of wall time) and evaluated it on SciFact on the GPU (2,000 documents/s, 3,000 queries/s,
    2.6 + 0.1 s of 30 s), and ran the GPU tests in 90 s."""
    return {"created": "then", "dry_run": dry_run, "environment": {"gpus": [{"name": gpu}, {"name": gpu}]},
            "plan": {"backbone": "sentence-transformers/all-MiniLM-L6-v2", "batch_size": 32},
            "training": [{"model": "colbert", "precision": "16-mixed", "triples_per_s": 6000.0, "ranks": 2,
                          "steps": 120, "batch_size_per_device": 32, "seconds": 40.0}],
            "evaluation": [{"model": "colbert", "documents_per_s": 2000.0, "queries_per_s": 3000.0,
                            "index_seconds": 2.6, "search_seconds": 0.1, "seconds": 30.0}],
            "cpu_reference": [], "gpu_tests": {"seconds": 90.0}}


def test_estimates_are_refined_from_an_earlier_check_on_the_same_gpu(check, planning):
    plan = check.plan_from(check.build_parser().parse_args([]), cuda_devices=2)
    here = {"gpus": [{"name": "NVIDIA H200"}, {"name": "NVIDIA H200"}]}
    rates, note = planning.estimates_for(plan, here, earlier_check())
    assert "refined from the check of then" in note
    assert rates.train["colbert 16-mixed"] == 3000.0  # per device
    assert rates.train["colbert_hil 16-mixed"] == pytest.approx(281 * 3000 / 301)  # scaled as ColBERT's moved
    assert rates.index["colbert evaluate"] == 2000.0 and rates.search["colbert evaluate"] == 3000.0
    assert rates.index["colbert_hil evaluate"] == pytest.approx(5183 / 55.5 * 2000 / (5183 / 35.0))
    assert rates.search["colbert_hil evaluate"] == pytest.approx(300 / 9.2 * 3000 / (300 / 3.84))
    assert rates.index["colbert reference"] == 156.0  # the CPU was not measured: the table's
    assert rates.startup_s == {"train": pytest.approx(40 - 120 * 32 / 3000), "evaluate": pytest.approx(30 - 2.7),
                               "reference": 25.0}
    assert rates.tests_s == 90.0
    step = planning.Step("train", "colbert_hil-16-mixed", "colbert_hil", "16-mixed")
    assert planning.estimate_s(step, plan, rates) == pytest.approx(40 - 1.28 + 120 * 32 / (281 * 3000 / 301))
    for earlier, words in ((earlier_check(gpu="NVIDIA H100 80GB HBM3"), "its GPUs"),
                           (earlier_check(dry_run=True), "its dry run")):
        rates, note = planning.estimates_for(plan, here, earlier)
        assert rates == planning.H200_TABLE and words in note


# -- given exports -----------------------------------------------------------------------------------------------------

def write_export(folder: Path, architecture: str, precision: str | None = None, export_dir: str | None = None):
    """A folder with the records the check reads (hil_config.json; train.py's config.yaml beside the logs, naming
    ``export_dir``, by default this export)."""
    export = folder / "export" if precision else folder
    export.mkdir(parents=True)
    (export / "hil_config.json").write_text(json.dumps({"settings": {"architecture": architecture}}))
    if precision:
        (folder / "tb" / "version_0").mkdir(parents=True)
        (folder / "tb" / "version_0" / "config.yaml").write_text(
            f"trainer:\n  precision: {precision}\nexport_dir: {export_dir or export}\n")


def test_exports_are_found_with_the_model_and_precision_their_records_give(tmp_path):
    exports = load("gpu_check_exports")
    write_export(tmp_path / "plain", "colbert")
    write_export(tmp_path / "run", "hil", precision="bf16-mixed")
    write_export(tmp_path / "other", "colbert", precision="16-mixed", export_dir="/elsewhere/run/export")
    (tmp_path / "not-an-export").mkdir()
    found = exports.find_exports(str(tmp_path))
    assert [(e.label, e.model, e.precision) for e in found] == [
        ("other", "colbert", "unknown"), ("plain", "colbert", "unknown"), ("run", "colbert_hil", "bf16-mixed")]
    assert found[2].precision_source == str(tmp_path / "run" / "tb" / "version_0" / "config.yaml")
    one, = exports.find_exports(str(tmp_path / "run" / "export"))
    assert (one.label, one.path) == ("run", str(tmp_path / "run" / "export"))
    for bad, words in ((tmp_path / "missing", "no such folder"), (tmp_path / "not-an-export", "no export in it")):
        with pytest.raises(exports.UserError, match=words):
            exports.find_exports(str(bad))


def test_a_wrong_exports_path_is_one_line_and_exit_2(check, tmp_path, capsys):
    assert check.main(["--dry-run", "--exports", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"gpu-check: error: --exports {tmp_path / 'missing'}: no such folder"]
    assert not (tmp_path / "out").exists()


# -- steps stopped, checks stopped -----------------------------------------------------------------------------------

def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"waited {timeout:.0f} s for {what}")


def sleeper_with_a_child(pid_file: Path) -> list[str]:
    """A command that starts ``sleep 120``, writes its process id to ``pid_file`` and sleeps 120 s itself."""
    return [sys.executable, "-c", "import subprocess, sys, time; child = subprocess.Popen(['sleep', '120']); "
            "open(sys.argv[1], 'w').write(str(child.pid)); time.sleep(120)", str(pid_file)]


def test_a_step_past_its_limit_is_stopped_with_its_children(check, tmp_path):
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(check.StepFailed) as caught:
        check.run_step("slow", sleeper_with_a_child(pid_file), tmp_path, limit_s=2.0)
    assert caught.value.timed_out and "timed out" in str(caught.value) and time.monotonic() - started < 30
    child = int(pid_file.read_text())
    wait_for(lambda: not alive(child), 10, "the step's own child to be stopped too")


def test_an_interrupted_step_is_stopped_with_its_children(check, tmp_path):
    """SIGTERM to the check (``timeout`` in run.sh) while a step runs: Interrupted, the step's group stopped."""
    running = sys.modules["gpu_check_run"]
    pid_file = tmp_path / "child.pid"

    def terminate_once_started():
        wait_for(lambda: pid_file.is_file() and pid_file.read_text(), 60, "the step to start its child")
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_once_started, daemon=True)
    before = signal.getsignal(signal.SIGTERM)
    with running.signals_interrupt(), pytest.raises(running.Interrupted) as caught:
        killer.start()
        check.run_step("slow", sleeper_with_a_child(pid_file), tmp_path, limit_s=120.0)
    killer.join()
    assert caught.value.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == before
    wait_for(lambda: not alive(int(pid_file.read_text())), 10, "the step's own child to be stopped too")


def checked_json(out: Path) -> dict:
    return json.loads((out / "gpu-check.json").read_text())


def steps_with(out: Path, status: str, key: str = "step") -> list[dict] | None:
    """The steps of ``out``'s gpu-check.json with ``status`` and ``key``, None when none (yet)."""
    if not (out / "gpu-check.json").is_file():
        return None
    return [s for s in checked_json(out)["steps"] if s["status"] == status and key in s] or None


@pytest.fixture(scope="module")
def given_exports(tiny_model_dir, tmp_path_factory):
    """The tiny BERT (untrained head) exported as ``<root>/run/export``, with the config.yaml train.py leaves."""
    import torch

    from hil.modeling.export import export_model
    from hil.modeling.loading import load_encoder

    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    export = export_model(load_encoder(str(tiny_model_dir), dim=16), root / "run" / "export")
    (root / "run" / "tb" / "version_0").mkdir(parents=True)
    (root / "run" / "tb" / "version_0" / "config.yaml").write_text(
        f"trainer:\n  precision: 32-true\nexport_dir: {export}\n")
    return root


def start_check(out: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--out", str(out), *options],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_check_killed_mid_way_leaves_valid_json_with_the_steps_done(given_exports, tmp_path):
    """``--exports`` on an export, two datasets: SIGKILL once the first evaluation is done. The JSON left holds that
    evaluation with the figures of its metrics.json (read here), names the step that was running, and prints
    (``--table``); the running evaluation does not outlive the check."""
    out = tmp_path / "check"
    process = start_check(out, "--exports", str(given_exports), "--datasets", "scifact,nfcorpus",
                          "--no-cpu-reference", "--steps", "evaluate")
    try:
        running, = wait_for(lambda: steps_with(out, "done") and steps_with(out, "running", "pid"), 180,
                            "the first evaluation")
    finally:
        process.kill()
        process.communicate()
    wait_for(lambda: not alive(running["pid"]), 5, "the running evaluation to stop with the check")
    record = checked_json(out)
    assert record["status"] == "running" and record["environment"]["torch"]
    assert [(s["step"], s["status"]) for s in record["steps"]] == [
        ("evaluate-run-scifact-cpu-bf16", "done"), ("evaluate-run-nfcorpus-cpu-bf16", "running")]
    run, = record["evaluation"]
    metrics = json.loads(Path(run["metrics"]).read_text())
    (_, result), = metrics["results"].items()
    assert (run["label"], run["model"], run["trained_precision"]) == ("run", "colbert", "32-true")
    assert run["export"] == str(given_exports / "run" / "export") == metrics["settings"]["model"]
    assert run["ndcg@10"] == result["metrics"]["ndcg@10"] and run["queries"] == 8
    assert run["seconds"] == record["steps"][0]["seconds"] and positive(run["seconds"])
    table = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--table", str(out / "gpu-check.json")],
                           capture_output=True, text=True, cwd=REPO, timeout=60)
    assert table.returncode == 0 and table.stdout.startswith("gpu-check running (dry run on the CPU")
    assert f"{run['ndcg@10']:.4f} [-]" in table.stdout and "evaluate-run-nfcorpus-cpu-bf16" in table.stdout


def test_sigint_stops_the_check_with_its_table_and_exit_130(given_exports, tmp_path):
    out = tmp_path / "check"
    process = start_check(out, "--exports", str(given_exports / "run" / "export"), "--datasets", "scifact",
                          "--no-cpu-reference", "--steps", "evaluate")
    try:
        running, = wait_for(lambda: steps_with(out, "running", "pid"), 120, "the evaluation to start")
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        "gpu-check: interrupted by SIGINT during step evaluate-run-scifact-cpu-bf16"]
    record = checked_json(out)
    assert (record["status"], record["interrupted_by"]) == ("interrupted", "SIGINT")
    assert [(s["step"], s["status"]) for s in record["steps"]] == [("evaluate-run-scifact-cpu-bf16", "interrupted")]
    assert "gpu-check interrupted (dry run on the CPU" in stdout and f"wrote {out / 'gpu-check.json'}" in stdout
    assert not alive(running["pid"])  # stopped before the check exited


def test_table_prints_a_partial_report_and_refuses_what_is_not_one(check, tmp_path, capsys):
    record = {"status": "running", "dry_run": False, "plan": {},
              "environment": {"gpus": [{"name": "NVIDIA H200"}], "driver": "580", "torch": "2.11",
                              "torch_cuda": "13.0", "faiss": {"version": "1.15", "gpus": 0}},
              "estimates": {"note": "estimates from the table"},
              "budget": {"budget_s": 240.0, "estimate_s": 213.4, "kept": [],
                         "left_out": [{"step": "gpu-tests", "estimate_s": 60.0, "reason": "estimate 60 s, 27 s left"}]},
              "steps": [{"step": "train-colbert-16-mixed", "status": "done", "seconds": 31.5, "estimate_s": 37.8},
                        {"step": "evaluate-colbert-16-mixed-scifact-cuda-fp16", "status": "running",
                         "estimate_s": 63.8}],
              "elapsed_s": 50.0, "gpu_tests": None, "evaluation": [], "cpu_reference": [],
              "training": [{"model": "colbert", "precision": "16-mixed", "strategy": "single-device", "devices": 1,
                            "device": "cuda:0", "batch_size_per_device": 32, "timed_steps": 100,
                            "triples_per_s": 3012.5, "peak_gpu_memory_bytes": 2 * 1024 ** 3,
                            "peak_rss_bytes": 1024 ** 3}]}
    path = tmp_path / "gpu-check.json"
    path.write_text(json.dumps(record))
    assert check.main(["--table", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "gpu-check running (NVIDIA H200; driver 580, torch 2.11 (CUDA 13.0), faiss 1.15 with 0 GPUs)"
    assert "plan: 0 steps, estimate 213 s for a 240 s budget; estimates from the table" in lines
    assert any(line.split() == ["evaluate-colbert-16-mixed-scifact-cuda-fp16", "running", "-", "63.8"]
               for line in lines)
    assert "  left out: gpu-tests (estimate 60 s, 27 s left)" in lines
    assert any(line.split() == ["colbert", "16-mixed", "3,012.5", "2.00", "GiB", "1.00", "GiB"] for line in lines)
    record["evaluation"] = [{"model": "colbert", "trained_precision": "16-mixed", "dataset": "scifact",
                             "backend": "plaid", "device": "cuda", "precision": "fp16", "ndcg@10": 0.6352,
                             "documents_per_s": 1727.7, "queries_per_s": 3100.0, "peak_gpu_memory_bytes": None,
                             "index_seconds": 3.0, "search_seconds": 0.0968,
                             "index_build_seconds": {"encode": 1.91, "join": 0.07, "search_structures": 0.96},
                             "search_step_seconds": {"encode_s": 0.013, "ann_s": 0.05, "score_s": None}}]
    path.write_text(json.dumps(record))
    assert check.main(["--table", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "    index 3.00 s: encode 1.91 s, join 0.07 s, search structures 0.96 s" in lines
    assert "    search 0.10 s: query encoding 0.01 s, candidates 0.05 s" in lines
    record["evaluation"][0].update(index_build_seconds=None, search_step_seconds=None)  # older records
    path.write_text(json.dumps(record))
    assert check.main(["--table", str(path)]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith(("    index", "    search"))]
    (tmp_path / "other.json").write_text("[1, 2]")
    for bad, words in ((tmp_path / "missing.json", "No such file"), (tmp_path / "other.json", "not a gpu-check")):
        assert check.main(["--table", str(bad)]) == 2
        error, = capsys.readouterr().err.strip().splitlines()
        assert error.startswith(f"gpu-check: error: --table {bad}: ") and words in error


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
    assert record["budget"]["budget_s"] is None and record["budget"]["left_out"] == []
    assert [s["step"] for s in record["steps"]] == [s["step"] for s in record["budget"]["kept"]]
    assert {s["status"] for s in record["steps"]} == {"done"} and record["steps"][-1]["step"] == "gpu-tests"


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
        assert run["strategy"] == ("ddp" if plan["devices"] > 1 else "single-device")
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
        build = run["index_build_seconds"]  # each evaluation builds its own index
        assert list(build) == ["encode", "join", "search_structures"] and sum(build.values()) <= run["index_seconds"]
        assert all(positive(run["search_step_seconds"][step]) for step in ("encode_s", "ann_s", "score_s"))
        if run in record["evaluation"]:  # the table's rows (the CPU references are its bracketed figures)
            assert f"    index {run['index_seconds']:,.2f} s: encode" in stdout
        assert (out / f"{run['step']}.log").is_file()
    assert {r["precision"] for r in record["evaluation"]} == {"bf16"}
    assert {r["precision"] for r in record["cpu_reference"]} == {"fp32"}
    assert "nDCG@10 [cpu]" in stdout
    return record
