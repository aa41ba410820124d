"""Real crashes and real concurrency while building an index (issue 16): separate Python processes, SIGKILL.

A build process is killed (SIGKILL, by the test hook ``HIL_TEST_KILL_AT``) at four points: inside a chunk (its
arrays written, its metadata not), inside the join (two chunks copied and removed, the rest not), after the chunks
were joined, and after ``index.json`` was written but before the folder was renamed into place (the rerun then
redoes only the search structures: the build's state says the chunks are joined).
Each rerun must give, byte for byte, the index of an uninterrupted build, and
the same search results. Two processes asked for one index at the same moment must build it once: one waits (and
says for whom), then opens what the other built; no half-written folder is left.

The encoder is the shared bert-tiny backbone with a seeded random head (the same in every process), on a slice
of SciFact; every process uses the test process's torch thread count, so encodings are bitwise reproducible.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hil.retrieval import chunks
from hil.retrieval.builder import build_index
from hil.retrieval.chunks import KILL_AT_ENV
from hil.retrieval.full_ranking import full_rank
from hil.retrieval.index import INDEX_JSON, TokenIndex

from toys import assert_same_index

REPO = Path(__file__).resolve().parents[1]
N_DOCS, CHUNK_DOCS, BATCH = 40, 10, 8  # 4 chunks
SETTINGS = {"dim": 32, "doc_maxlen": 48, "query_maxlen": 16}
PROVENANCE_KEYS = frozenset({"created", "versions", "git_commit", "host", "build_seconds"})  # encoded_on is compared

# What each process runs: the seeded encoder, then build_index / open_or_build_index, reporting the chunks it
# encoded itself. With "go", it waits for that file first, so that two processes ask at the same moment.
BUILDER = r"""
import json, logging, os, sys, time
from pathlib import Path
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
from hil.modeling.loading import load_encoder
from hil.retrieval import chunks
from hil.retrieval.builder import build_index, open_or_build_index
ids, texts = json.loads(Path(args["corpus"]).read_text())
torch.manual_seed(0)
encoder = load_encoder(args["model"], **args["settings"])
written, original = [], chunks._write_chunk
def counting(*a, **k):
    meta = original(*a, **k)
    written.append(meta["chunk"])
    time.sleep(args["chunk_sleep"])
    return meta
chunks._write_chunk = counting
if args["go"]:
    Path(args["ready"]).touch()
    while not Path(args["go"]).exists():
        time.sleep(0.005)
build = open_or_build_index if args["reuse"] else build_index
build(encoder, ids, texts, args["directory"], chunk_docs=args["chunk_docs"], batch_size=args["batch"], progress=False)
print(json.dumps({"pid": os.getpid(), "written": written}))
"""


@pytest.fixture(scope="module")
def corpus_file(shared_dir, tmp_path_factory) -> Path:
    ids, texts = [], []
    with open(shared_dir / "data" / "beir" / "scifact" / "corpus.jsonl", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            ids.append(record["_id"])
            texts.append(f"{record['title']} {record['text']}".strip())
            if len(ids) == N_DOCS:
                break
    path = tmp_path_factory.mktemp("corpus") / "corpus.json"
    path.write_text(json.dumps([ids, texts]))
    return path


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    from hil.modeling.loading import load_encoder

    torch.manual_seed(0)
    return load_encoder(str(tiny_model_dir), **SETTINGS)


@pytest.fixture(scope="module")
def reference(encoder, corpus_file, tmp_path_factory) -> TokenIndex:
    """The uninterrupted build, in this process."""
    ids, texts = json.loads(corpus_file.read_text())
    return build_index(encoder, ids, texts, tmp_path_factory.mktemp("reference") / "idx", chunk_docs=CHUNK_DOCS,
                       batch_size=BATCH, progress=False)


def start_builder(directory: Path, corpus_file: Path, model: Path, *, kill_at: str | None = None,
                  reuse: bool = False, go: Path | None = None, chunk_sleep: float = 0.0) -> subprocess.Popen:
    args = {"threads": torch.get_num_threads(), "corpus": str(corpus_file), "model": str(model),
            "settings": SETTINGS, "directory": str(directory), "chunk_docs": CHUNK_DOCS, "batch": BATCH,
            "reuse": reuse, "go": str(go) if go else None, "ready": f"{directory}.ready-{os.urandom(4).hex()}",
            "chunk_sleep": chunk_sleep}
    env = {key: value for key, value in os.environ.items() if key != KILL_AT_ENV}
    if kill_at:
        env[KILL_AT_ENV] = kill_at
    return subprocess.Popen([sys.executable, "-c", BUILDER, json.dumps(args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: float = 240.0) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"builder did not finish in {timeout:.0f} s:\n{err[-3000:]}")
    return process.returncode, out, err


def assert_same_search(encoder, index: TokenIndex, reference: TokenIndex) -> None:
    queries = {"q1": "white matter diffusion in the newborn brain", "q2": "vitamin D and bone density"}
    assert (full_rank(encoder, index, queries, k=10, progress=False).run
            == full_rank(encoder, reference, queries, k=10, progress=False).run)


# (where the build dies, what the unfinished folder holds then, which chunks the rerun encodes)
KILLS = [pytest.param("chunk-1-arrays", ["chunks/chunk-00000.json", "chunks/chunk-00001.colbert.npy"], [1, 2, 3],
                      id="mid-chunk"),
         pytest.param("joined", ["chunks/chunk-00003.json", "colbert.embeddings.npy", "doc_offsets.npy"], [],
                      id="after-join", marks=pytest.mark.slow),
         pytest.param("join-1", ["chunks/chunk-00001.json", "chunks/chunk-00002.colbert.npy", "colbert.embeddings.npy",
                                 ".join-state.json"], [], id="mid-join"),
         pytest.param("sealed", [INDEX_JSON, "colbert.embeddings.npy"], [], id="before-rename",
                      marks=pytest.mark.slow)]


@pytest.mark.parametrize("step, left, rerun_encodes", KILLS)
def test_a_sigkilled_build_reruns_to_the_uninterrupted_index(step, left, rerun_encodes, encoder, reference,
                                                             corpus_file, tiny_model_dir, tmp_path, monkeypatch):
    code, _, err = finish(start_builder(tmp_path / "idx", corpus_file, tiny_model_dir, kill_at=step))
    assert code == -signal.SIGKILL, f"expected a SIGKILL at {step}, got exit status {code}:\n{err[-2000:]}"
    directory, unfinished = tmp_path / "idx", tmp_path / "idx.tmp-build"
    assert not directory.exists(), "a killed build must not leave a folder under the final name"
    for name in left:
        assert (unfinished / name).is_file(), f"{name} should be left in {unfinished}"
    if step == "chunk-1-arrays":
        assert not (unfinished / "chunks" / "chunk-00001.json").exists(), "chunk 1 was killed mid-way"
    if step == "join-1":  # chunks 0 and 1 copied into the joined file and state, chunk 1's files not yet removed
        assert not (unfinished / "chunks" / "chunk-00000.colbert.npy").exists(), "a joined chunk is removed"
        assert json.loads((unfinished / ".join-state.json").read_text())["joined"] == 2

    encoded, original = [], chunks._write_chunk

    def counting(*args, **kwargs):
        meta = original(*args, **kwargs)
        encoded.append(meta["chunk"])
        return meta

    monkeypatch.setattr(chunks, "_write_chunk", counting)
    ids, texts = json.loads(corpus_file.read_text())
    index = build_index(encoder, ids, texts, directory, chunk_docs=CHUNK_DOCS, batch_size=BATCH, progress=False)
    assert encoded == rerun_encodes, f"the rerun encoded chunks {encoded}"
    assert not unfinished.exists()
    assert_same_index(directory, reference.directory, PROVENANCE_KEYS)
    assert TokenIndex.load(directory, verify="full").verified == "full"
    assert_same_search(encoder, index, reference)


def test_two_processes_asking_for_one_index_build_it_once(encoder, reference, corpus_file, tiny_model_dir,
                                                          tmp_path):
    directory, go = tmp_path / "shared", tmp_path / "go"
    processes = [start_builder(directory, corpus_file, tiny_model_dir, reuse=True, go=go, chunk_sleep=0.1)
                 for _ in range(2)]
    deadline = time.monotonic() + 240
    while len(list(tmp_path.glob("shared.ready-*"))) < 2:  # both imported and waiting at the barrier
        assert time.monotonic() < deadline and all(p.poll() is None for p in processes), \
            [p.communicate()[1][-2000:] for p in processes if p.poll() is not None]
        time.sleep(0.02)
    go.touch()
    results = []
    for process in processes:
        code, out, err = finish(process)
        assert code == 0, err[-3000:]
        results.append((json.loads(out.strip().splitlines()[-1]), err))
    written = sorted((report["written"] for report, _ in results), key=len)
    assert written == [[], [0, 1, 2, 3]], "the index must be encoded once, by one of the two processes"
    builder = next(report["pid"] for report, _ in results if report["written"])
    waiter_log = next(err for report, err in results if not report["written"])
    assert f"shared.lock is locked by pid {builder}" in waiter_log and "waiting" in waiter_log
    for ready in tmp_path.glob("shared.ready-*"):
        ready.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "shared"], "no half-written folder, no lock file left"
    assert_same_index(directory, reference.directory, PROVENANCE_KEYS)
