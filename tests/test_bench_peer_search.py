"""Peer modes against PyLate (issue 24): search (``bench/sections/peer_search.py`` + ``bench/peer_search_pylate.py``)
and training throughput (``bench/training_throughput.py --sweeps peer`` + ``bench/peer_train_pylate.py``).

The fast tests run the ``hil`` side against fake peers (small scripts that write the JSON protocol), so they need no
PyLate; the slow ones run the real peers when ``HIL_PEER_PYTHON`` names a Python with PyLate (bench/README.md).
No timing is asserted: the figures are checked against the lists they come from.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def bench():
    return load("run")  # puts bench/ on the import path for the sections, as bench/run.py does


@pytest.fixture(scope="module")
def section(bench):
    """The section module, with bench/ on the import path while the tests run (it imports ``measure`` and
    ``peer_search_pylate`` inside its functions, as in a child of bench/run.py)."""
    from sections import peer_search

    sys.path.insert(0, str(BENCH))
    yield peer_search
    sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def throughput():
    return load("training_throughput")


def config(bench, *argv: str):
    return bench.make_config(bench.build_parser().parse_args(list(argv)))


# A fake peer for search: writes protocol 1 with times 10, 20, 30, ... ms (plaid) and 5, 15, ... (warp) and ranks
# the corpus's first document first for every query. argv[1] is the script path when it stands in for a Python.
FAKE_SEARCH_PEER = '''
import json, sys
args = sys.argv[1:]
if args and args[0].endswith(".py"):
    args = args[1:]
value = lambda flag: args[args.index(flag) + 1]
mode = "{mode}"
if mode == "crash":
    sys.exit("Traceback ...\\nImportError: no module named pylate")
queries = json.load(open(value("--queries")))["ids"]
corpus = json.load(open(value("--corpus")))["ids"]
kinds = value("--indexes").split(",")
if mode == "missing":
    kinds = kinds[:-1]
offsets = {{"plaid": 10.0, "warp": 5.0}}
indexes = {{kind: {{"settings": {{"build": {{}}, "search": {{}}}}, "build": {{"built_now": True}},
                   "times_ms": [offsets[kind] + 10.0 * i for i in range(len(queries) - (mode == "short"))],
                   "run": {{q: {{corpus[0]: 2.0, corpus[1]: 1.0}} for q in queries}}}} for kind in kinds}}
out = {{"protocol": 0 if mode == "old" else 1, "pylate": "9.9", "torch": "x", "threads": int(value("--threads")),
       "warmup": int(value("--warmup")), "k": int(value("--k")), "versions": {{"fast-plaid": "1", "xtr-warp-rs": "2"}},
       "indexes": indexes, "peak_rss_mb": 1.0}}
json.dump(out, open(value("--out"), "w"))
'''


def fake_peer(tmp_path: Path, mode: str = "ok", as_python: bool = False) -> Path:
    path = tmp_path / f"fake-{mode}{'' if as_python else '.py'}"
    path.write_text((f"#!{sys.executable}\n" if as_python else "") + FAKE_SEARCH_PEER.format(mode=mode))
    path.chmod(0o755)
    return path


def ndcg10_reference(qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]]) -> dict[str, float]:
    """nDCG@10 by hand (BEIR: gain = grade, discount log2(rank + 1), ties by doc id descending as trec_eval)."""
    values = {}
    for qid, judged in qrels.items():
        ranked = sorted(run.get(qid, {}).items(), key=lambda item: (-item[1], [-ord(c) for c in item[0]]))[:10]
        dcg = sum(judged.get(doc, 0) / math.log2(rank + 2) for rank, (doc, _) in enumerate(ranked))
        ideal = sorted(judged.values(), reverse=True)[:10]
        values[qid] = dcg / sum(g / math.log2(rank + 2) for rank, g in enumerate(ideal))
    return values


def tiny_dataset():
    from hil.data.beir import BeirDataset

    corpus = {d: {"title": "", "text": f"text of {d}"} for d in ("d1", "d2", "d3", "d4", "d5")}
    return BeirDataset("tiny", corpus, {"q1": "one", "q2": "two"}, {"q1": {"d1": 1}, "q2": {"d3": 2, "d4": 1}},
                       "test", "memory")


# --- the timing loop both sides use ---------------------------------------------------------------------------------

def test_warmup_queries_are_searched_untimed_and_every_query_is_timed_once():
    loop = load("peer_search_pylate").time_one_at_a_time
    now, calls = [0.0], []
    durations = {"a": 0.004, "b": 0.010, "c": 0.002}

    def search(qid: str, text: str) -> dict[str, float]:
        calls.append(qid)
        now[0] += durations[qid] + (1.0 if len(calls) <= 2 else 0.0)  # the warm-up calls are slow: never timed
        return {f"doc-{qid}": 1.0}

    run, times = loop(search, {"a": "x", "b": "y", "c": "z"}, warmup=2, clock=lambda: now[0])
    assert calls == ["a", "b", "a", "b", "c"]
    assert times == pytest.approx([4.0, 10.0, 2.0])
    assert run == {"a": {"doc-a": 1.0}, "b": {"doc-b": 1.0}, "c": {"doc-c": 1.0}}
    _, times = loop(search, {"a": "x"}, warmup=0, clock=lambda: now[0])
    assert times == pytest.approx([4.0])


# --- the comparison: percentiles, ratios, nDCG ----------------------------------------------------------------------

def test_compare_takes_each_sides_percentiles_ratios_and_ndcg_from_its_own_lists(section):
    dataset = tiny_dataset()
    ours_run = {"q1": {"d1": 3.0, "d2": 2.0}, "q2": {"d3": 2.0, "d4": 1.0}}
    peer_run = {"q1": {"d2": 3.0, "d1": 2.0}, "q2": {"d4": 5.0, "d5": 4.0, "d3": 3.0}}
    ours_times, peer_times = [40.0, 10.0, 30.0, 20.0, 50.0], [100.0, 300.0, 200.0, 90.0, 400.0]
    result = section.compare(dataset, {"times_ms": ours_times, "run": ours_run},
                             {"warp": {"times_ms": peer_times, "run": peer_run}})
    ours, warp = result["ours"], result["pylate"]["warp"]
    assert ours["p50_ms"] == pytest.approx(np.percentile(ours_times, 50)) == pytest.approx(30.0)
    assert ours["p95_ms"] == pytest.approx(np.percentile(ours_times, 95))
    assert warp["p50_ms"] == pytest.approx(200.0) and warp["p95_ms"] == pytest.approx(np.percentile(peer_times, 95))
    assert warp["time_ratio_p50"] == pytest.approx(200.0 / 30.0)  # PyLate's time / ours: above 1, ours faster
    assert warp["time_ratio_p95"] == pytest.approx(np.percentile(peer_times, 95) / np.percentile(ours_times, 95))
    mine, theirs = ndcg10_reference(dataset.qrels, ours_run), ndcg10_reference(dataset.qrels, peer_run)
    assert theirs["q1"] == pytest.approx(1 / math.log2(3)) and theirs["q2"] == pytest.approx(2 / (2 + 1 / math.log2(3)))
    assert ours["ndcg10"] == pytest.approx(np.mean(list(mine.values()))) == pytest.approx(1.0)
    assert warp["ndcg10"] == pytest.approx(np.mean(list(theirs.values())))
    diff = warp["ndcg10_ours_minus_pylate"]
    assert diff["mean_diff"] == pytest.approx(np.mean([mine[q] - theirs[q] for q in mine])) and diff["queries"] == 2
    assert diff["ci95"][0] <= diff["mean_diff"] <= diff["ci95"][1]


def test_a_query_the_peer_left_out_scores_zero(section):
    dataset = tiny_dataset()
    run = {"q1": {"d1": 1.0}, "q2": {"d3": 2.0, "d4": 1.0}}
    result = section.compare(dataset, {"times_ms": [1.0, 2.0], "run": run},
                             {"plaid": {"times_ms": [1.0, 2.0], "run": {"q1": {"d1": 1.0}}}})
    assert result["pylate"]["plaid"]["ndcg10"] == pytest.approx(0.5)


# --- the peer's protocol ------------------------------------------------------------------------------------------

def write_inputs(tmp_path: Path, queries: list[str]) -> list[str]:
    corpus, query_file = tmp_path / "corpus.json", tmp_path / "queries.json"
    corpus.write_text(json.dumps({"ids": ["d1", "d2", "d3"], "texts": ["a", "b", "c"]}))
    query_file.write_text(json.dumps({"ids": queries, "texts": queries}))
    return ["--corpus", str(corpus), "--queries", str(query_file), "--indexes", "plaid,warp", "--k", "10",
            "--threads", "2", "--warmup", "1"]


def test_call_peer_reads_the_protocol_and_refuses_what_does_not_fit(section, tmp_path):
    arguments = write_inputs(tmp_path, ["q1", "q2", "q3"])
    out = tmp_path / "out.json"
    found = section.call_peer(sys.executable, fake_peer(tmp_path), arguments, out, ("plaid", "warp"),
                              ["q1", "q2", "q3"])
    assert found["indexes"]["plaid"]["times_ms"] == [10.0, 20.0, 30.0] and found["threads"] == 2
    assert set(found["indexes"]["warp"]["run"]) == {"q1", "q2", "q3"}
    for mode, message in (("old", "protocol"), ("missing", "no 'warp' index"), ("short", "2 times for 3 queries"),
                          ("crash", "no module named pylate")):
        with pytest.raises(section.PeerError, match=message):
            section.call_peer(sys.executable, fake_peer(tmp_path, mode), arguments, out, ("plaid", "warp"),
                              ["q1", "q2", "q3"])
    with pytest.raises(section.PeerError, match="not asked"):  # three times, but a ranking of q3 where q9 was asked
        section.read_peer(found, ("plaid",), ["q1", "q2", "q9"])


def test_peer_arguments_carry_our_k_threads_warmup_and_pylate_settings(bench, section, tmp_path):
    cfg = config(bench, "--sections", "peer-search", "--threads", "3", "--k", "50", "--peer-search-warmup", "2",
                 "--peer-plaid-n-full-scores", "1024", "--peer-search-indexes", "warp")
    args = section.peer_arguments(cfg, tmp_path / "m", tmp_path / "c.json", tmp_path / "q.json", tmp_path, "fp")
    peer = load("peer_search_pylate").build_parser().parse_args(args + ["--out", "o.json"])  # the peer's own parser
    assert (peer.threads, peer.k, peer.warmup, peer.batch_size) == (3, 50, 2, cfg.common.batch_size)
    assert (peer.plaid_n_full_scores, peer.indexes, peer.corpus_digest) == (1024, "warp", "fp")
    assert (peer.nbits, peer.warp_n_ivf_probe, peer.plaid_n_ivf_probe) == (4, 32, 8)


def test_peer_search_is_opt_in_and_checked(bench):
    assert "peer-search" not in [job.label for job in bench.plan(config(bench))]
    labels = [job.label for job in bench.plan(config(bench, "--sections", "search,peer-search"))]
    assert labels[-1] == "peer-search"
    with pytest.raises(SystemExit, match="peer-search-ours"):
        config(bench, "--sections", "peer-search", "--peer-search-ours", "nope")
    with pytest.raises(SystemExit, match="PyLate indexes"):
        config(bench, "--sections", "peer-search", "--peer-search-indexes", "plaid,voyager")


def table_result() -> dict:
    diff = {"mean_diff": 0.0012, "ci95": [-0.003, 0.005], "p_value": 0.6, "queries": 300}
    return {"queries": 300, "threads": 2, "warmup": 3, "rounds": 1, "ours_variant": "plaid",
            "ours": {"p50_ms": 37.1, "p95_ms": 42.7, "ndcg10": 0.6255},
            "pylate": {"warp": {"p50_ms": 33.1, "p95_ms": 38.2, "ndcg10": 0.6243, "time_ratio_p50": 33.1 / 37.1,
                                "time_ratio_p95": 38.2 / 42.7, "ndcg10_ours_minus_pylate": diff}},
            "pylate_versions": {"pylate": "1.6.0", "xtr-warp-rs": "2.1.0"}}


def test_table_rows_show_both_sides_and_the_ratio(bench):
    text = bench.table({"peer-search": table_result()})
    for expected in ("peer-search ours plaid", "p50 37.1 ms, p95 42.7 ms", "peer-search PyLate warp",
                     "p50 33.1 ms, p95 38.2 ms", "PyLate/ours time x0.89 p50, x0.89 p95", "nDCG@10 0.6243",
                     "ours +0.0012, 95% CI [-0.0030, +0.0050]", "xtr-warp-rs 2.1.0"):
        assert expected in text, expected
    failed = {**table_result(), "peer_error": "PyLate did not run in /x: boom", "pylate": {}}
    assert "not run" in bench.table({"peer-search": failed}) and "boom" in bench.table({"peer-search": failed})


def test_the_section_end_to_end_against_a_fake_peer(bench, tmp_path):
    """The whole child: our index and timing loop on a tiny slice, the fake peer in place of PyLate's Python."""
    from sections.options import Job

    cfg = config(bench, "--sections", "peer-search", "--model", "bert-tiny-splade", "--docs", "24", "--queries", "3",
                 "--doc-maxlen", "32", "--threads", "1", "--k", "5", "--work", str(tmp_path / "work"),
                 "--peer-python", str(fake_peer(tmp_path, as_python=True)), "--peer-search-ours", "flat",
                 "--peer-search-rounds", "2")
    result = bench.run_child(Job("peer-search", "peer-search"), cfg, timeout=300)
    assert "error" not in result and "peer_error" not in result, result
    assert result["queries"] == 3 and len(result["ours"]["times_ms"]) == 6  # two rounds of three queries
    plaid, warp = result["pylate"]["plaid"], result["pylate"]["warp"]
    assert plaid["times_ms"] == [10.0, 20.0, 30.0] * 2 and plaid["p50_ms"] == pytest.approx(20.0)
    assert warp["p95_ms"] == pytest.approx(np.percentile([5.0, 15.0, 25.0] * 2, 95))
    assert warp["time_ratio_p50"] == pytest.approx(15.0 / np.percentile(result["ours"]["times_ms"], 50))
    assert 0.0 <= result["ours"]["ndcg10"] <= 1.0 and result["pylate_versions"]["pylate"] == "9.9"
    exported = [path for path in (tmp_path / "work").iterdir() if path.name.startswith("pylate-model-")]
    assert exported and (exported[0] / "artifact.metadata").is_file()  # the Stanford checkpoint PyLate loads


# --- training throughput's peer ------------------------------------------------------------------------------------

FAKE_TRAIN_PEER = '''
import json, sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
steps = json.load(open(value("--batches")))
mode = "{mode}"
if mode == "crash":
    sys.exit("RuntimeError: stack expects each tensor to be equal size")
print("some log line")
print(json.dumps({{"protocol": 0 if mode == "old" else 1, "s_per_step": 0.5, "queries_per_s": {rate},
                  "documents_per_s": 2 * {rate}, "queries": len(steps[0]["queries"]), "nway": 2, "steps_timed": 1,
                  "peak_memory_mb": 1.0, "pylate": "9.9", "torch": "x", "threads": int(value("--threads"))}}))
'''


def test_training_peer_protocol_and_ratio(throughput, tmp_path):
    batches = tmp_path / "batches.json"
    batches.write_text(json.dumps([{"queries": ["q"] * 4, "positives": ["p"] * 4, "negatives": ["n"] * 4}]))
    arguments = ["--batches", str(batches), "--threads", "2"]
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN_PEER.format(mode="ok", rate=8.0))
    found = throughput.call_peer(sys.executable, script, arguments)
    assert found["queries_per_s"] == 8.0 and found["queries"] == 4 and found["threads"] == 2
    for mode, message in (("old", "protocol"), ("crash", "equal size")):
        script.write_text(FAKE_TRAIN_PEER.format(mode=mode, rate=8.0))
        with pytest.raises(RuntimeError, match=message):
            throughput.call_peer(sys.executable, script, arguments)
    ours = [{"queries_per_s": 10.0, "round": 0}, {"queries_per_s": 12.0, "round": 1}]
    theirs = [{"queries_per_s": 8.0, "round": 0}, {"queries_per_s": 6.0, "round": 1}]
    comparison = throughput.peer_comparison(ours, theirs)
    assert comparison["ours"]["round"] == 1 and comparison["pylate"]["round"] == 0  # each side's best round
    assert comparison["ratio_vs_pylate"] == pytest.approx(12.0 / 8.0) and comparison["rounds"] == 2


# --- the real peers (slow; need PyLate) -------------------------------------------------------------------------------

PEER_PYTHON = os.environ.get("HIL_PEER_PYTHON")
needs_peer = pytest.mark.skipif(not PEER_PYTHON, reason="HIL_PEER_PYTHON does not name a Python with PyLate")


@pytest.mark.slow
@needs_peer
def test_real_pylate_search_peer_on_a_tiny_corpus(shared_dir, tmp_path):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(BENCH / "run.py"), "--sections", "peer-search", "--model", "bert-tiny-splade",
               "--docs", "80", "--queries", "5", "--doc-maxlen", "64", "--threads", "1", "--k", "20",
               "--work", str(tmp_path / "work"), "--peer-python", PEER_PYTHON, "--peer-search-warmup", "1"]
    results = []
    for attempt in range(2):  # the second run reuses PyLate's indexes
        output = tmp_path / f"run{attempt}.json"
        done = subprocess.run(command + ["--output", str(output)], capture_output=True, text=True, env=env,
                              timeout=1500, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(output.read_text())["results"]["peer-search"])
        assert "peer-search PyLate warp" in done.stdout
    first, second = results
    assert "error" not in first and "peer_error" not in first, first
    for kind in ("plaid", "warp"):
        side = first["pylate"][kind]
        assert side["n"] == 5 and 0.0 <= side["ndcg10"] <= 1.0 and side["p50_ms"] <= side["p95_ms"]
        assert side["build"]["built_now"] and side["build"]["docs"] == first["pylate"][kind]["build"]["docs"]
        assert not second["pylate"][kind]["build"]["built_now"]
        assert second["pylate"][kind]["ndcg10"] == pytest.approx(side["ndcg10"])
    assert first["pylate_threads"] == 1 and first["ours"]["n"] == 5


@pytest.mark.slow
@needs_peer
def test_real_pylate_training_peer(shared_dir, tmp_path):
    output = tmp_path / "throughput.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(BENCH / "training_throughput.py"), "--sweeps", "peer", "--peer-python",
                           PEER_PYTHON, "--peer-batch", "4", "--steps", "2", "--threads", "1", "--doc-maxlen", "64",
                           "--output", str(output)], capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    peer = json.loads(output.read_text())["peer"]
    assert peer["pylate"]["steps_timed"] == 2 and peer["pylate"]["queries"] == 4 and peer["pylate"]["threads"] == 1
    assert peer["ratio_vs_pylate"] == pytest.approx(peer["ours"]["queries_per_s"] / peer["pylate"]["queries_per_s"])
    assert math.isfinite(peer["pylate"]["last_loss"])


def test_search_alone_is_each_call_minus_its_own_encoding(section):
    dataset = tiny_dataset()
    run = {"q1": {"d1": 1.0}, "q2": {"d3": 2.0}}
    ours = {"times_ms": [10.0, 30.0, 20.0], "encode_ms": [4.0, 5.0, 6.0], "run": run}
    peer = {"times_ms": [50.0, 40.0, 90.0], "encode_ms": [20.0, 30.0, 10.0], "run": run}
    result = section.compare(dataset, ours, {"warp": peer})
    assert result["ours"]["search_alone"]["p50_ms"] == pytest.approx(np.percentile([6.0, 25.0, 14.0], 50))
    warp = result["pylate"]["warp"]
    assert warp["search_alone"]["p95_ms"] == pytest.approx(np.percentile([30.0, 10.0, 80.0], 95))
    assert warp["search_time_ratio_p50"] == pytest.approx(30.0 / 14.0)
    assert warp["encode"]["p50_ms"] == pytest.approx(20.0)
    no_encoding = section.compare(dataset, {"times_ms": [1.0, 2.0], "run": run}, {"warp": peer})
    assert "search_alone" not in no_encoding["ours"] and "search_time_ratio_p50" not in no_encoding["pylate"]["warp"]
    text = " ".join(" ".join(row) for row in section.rows("x", {**result, "queries": 3, "threads": 2, "warmup": 1,
                                                              "rounds": 1, "ours_variant": "plaid",
                                                              "pylate_versions": {}}))
    assert "search alone p50 14.0 ms" in text and "search alone x2.14 p50" in text
