"""``hil teacher`` at the speed of its model (issue 40, row 10): a dense teacher encodes each distinct passage once
for the whole run, however many queries (and groups of queries) mined it, and its scores are still those of each
pair scored alone, written out the obvious way; the progress bar counts the teacher's work and moves batch by batch;
the first line comes before torch is even imported."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hil.cli import teacher as teacher_cli
from hil.experiments import teacher as teacher_module
from hil.experiments import teacher_models

WORDS = ("cats dogs fish ocean tides moon animals run fast eat parks birds seeds rivers trees wind snow ice "
         "mountains sand").split()


def corpus(queries: int, documents: int = 24) -> tuple[dict[str, str], dict[str, str]]:
    """Queries and documents drawn from one small vocabulary: every query's BM25 candidates overlap other queries';
    texts of different lengths (a batch pads them)."""
    rng = random.Random(0)
    docs = {f"d{i}": " ".join(rng.choices(WORDS, k=rng.randint(3, 14))) for i in range(documents)}
    return {f"q{i}": " ".join(rng.sample(WORDS, rng.randint(1, 3))) for i in range(queries)}, docs


@pytest.fixture
def dense(tmp_path, hf_tokenizer) -> tuple[Path, torch.nn.Module]:
    """A random one-layer BERT with the shared tiny BERT's vocabulary, saved as a Hugging Face folder."""
    from conftest import random_bert

    folder = tmp_path / "dense"
    model = random_bert(seed=5).eval()
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return folder, model


def make_examples(tmp_path: Path, queries: dict[str, str], docs: dict[str, str], teacher: Path, *extra: str,
                  quiet: bool = True) -> dict[str, list[tuple[str, float]]]:
    q, c, output = tmp_path / "queries.tsv", tmp_path / "collection.tsv", tmp_path / "out" / "examples.jsonl"
    q.write_text("".join(f"{k}\t{v}\n" for k, v in queries.items()), encoding="utf-8")
    c.write_text("".join(f"{k}\t{v}\n" for k, v in docs.items()), encoding="utf-8")
    assert teacher_cli.main(["--queries", str(q), "--collection", str(c), "--output", str(output), "--teacher",
                             str(teacher), "--teacher-kind", "dense", "--device", "cpu", "--overwrite",
                             *(["--quiet"] if quiet else []), *extra]) == 0
    lines = {}
    for text in output.read_text(encoding="utf-8").splitlines():
        qid, *pairs = json.loads(text)
        lines[str(qid)] = [(str(pid), score) for pid, score in pairs]
    return lines


def count_encoded(monkeypatch) -> list[str]:
    """Every text the dense teacher's encoder is run on, in order (the wrapper counts; the encoding is the real one)."""
    encoded: list[str] = []
    original = teacher_models.DenseTeacher.embed

    def counting(self, texts, *rest, **options):
        encoded.extend(texts)
        return original(self, texts, *rest, **options)

    monkeypatch.setattr(teacher_models.DenseTeacher, "embed", counting)
    return encoded


@pytest.mark.parametrize("chunk", [None, 3])
def test_a_dense_teacher_encodes_each_distinct_passage_once(tmp_path, dense, monkeypatch, chunk):
    """70 queries whose BM25 candidates overlap: each distinct candidate passage goes through the encoder once, and
    each query once -- in one group of queries (the default), and over many (3 queries a group: the vectors are kept
    between groups)."""
    if chunk is not None:
        monkeypatch.setattr(teacher_models, "_QUERY_CHUNK", chunk)
    queries, docs = corpus(70)
    mined: dict[str, list[str]] = {}
    original_mine = teacher_module.mine

    def recording_mine(*args, **options):
        found, record = original_mine(*args, **options)
        mined.update(found)
        return found, record

    monkeypatch.setattr(teacher_module, "mine", recording_mine)
    encoded = count_encoded(monkeypatch)
    make_examples(tmp_path, queries, docs, dense[0], "--depth", "6", "--nway", "3", "--batch-size", "4")
    distinct = {docs[pid] for found in mined.values() for pid in found}
    passages = Counter(text for text in encoded if text not in set(queries.values()))
    assert set(passages) == distinct and max(passages.values()) == 1, passages.most_common(3)
    assert sum(map(len, mined.values())) > 2 * len(distinct)  # the overlap is real
    assert Counter(text for text in encoded if text in set(queries.values())) == Counter(queries.values())


@pytest.mark.parametrize("chunk, cache_passages", [(None, None), (2, None), (2, 5)])
def test_dense_scores_are_each_pair_scored_alone(tmp_path, dense, hf_tokenizer, monkeypatch, chunk, cache_passages):
    """The fast path (batches of texts of mixed lengths, padded; vectors kept between groups of queries; a cache too
    small for the run, dropping and re-encoding) writes, for every line, the scores of each (query, passage) scored
    alone: the model run on one text, the mean of its token states, unit length, the dot product; and the nway best
    of the BM25 candidates by that score."""
    from hil.data.bm25 import BM25Index

    folder, model = dense
    if chunk is not None:
        monkeypatch.setattr(teacher_models, "_QUERY_CHUNK", chunk)
    if cache_passages is not None:
        monkeypatch.setattr(teacher_models, "_CACHE_BYTES", cache_passages * 4 * model.config.hidden_size)
    queries, docs = corpus(12, documents=16)
    lines = make_examples(tmp_path, queries, docs, folder, "--depth", "5", "--nway", "4", "--batch-size", "3")

    def vector(text: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(**hf_tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        return F.normalize(hidden.mean(0), dim=0)

    hits = BM25Index.build(list(docs), list(docs.values())).search(list(queries.values()), 5)
    written = 0
    for qid, found in zip(queries, hits):
        alone = {pid: float(vector(queries[qid]) @ vector(docs[pid])) for pid, _ in found}
        if len(alone) < 4:
            assert qid not in lines
            continue
        best = sorted(alone, key=lambda pid: -alone[pid])[:4]  # stable: ties in the miner's order
        assert [pid for pid, _ in lines[qid]] == best, qid
        assert [score for _, score in lines[qid]] == pytest.approx([alone[pid] for pid in best], abs=1e-5)
        written += 1
    assert written == len(lines) >= 8


def test_progress_counts_passages_and_moves_with_each_batch(tmp_path, dense, monkeypatch, capsys):
    """The bar's total is the distinct passages to encode, and it moves by one batch at a time (not once when the
    whole run, or a group of queries, is done)."""
    bars = []

    class Recorder:
        def __init__(self, total, desc, unit, enabled=True):
            self.total, self.unit, self.steps = total, unit, []
            bars.append(self)

        def update(self, done):
            self.steps.append(done)

        def close(self):
            pass

    monkeypatch.setattr(teacher_module, "progress_bar", Recorder)
    encoded = count_encoded(monkeypatch)
    queries, docs = corpus(10)
    make_examples(tmp_path, queries, docs, dense[0], "--depth", "6", "--nway", "3", "--batch-size", "4", quiet=False)
    (bar,) = bars
    passages = len([text for text in encoded if text not in set(queries.values())])
    assert bar.unit == "passages" and bar.total == passages == sum(bar.steps)
    assert max(bar.steps) <= 4 and len(bar.steps) >= passages // 4
    err = capsys.readouterr().err
    assert f"[teacher] scoring {10 * 6} candidates of 10 queries: {passages} passages through the teacher" in err


def test_the_first_line_comes_before_torch_is_imported(tmp_path):
    """``hil teacher`` says what it does before it imports torch and transformers (seconds on a small machine) and
    loads the texts and the teacher: the first line is at once. A probe on stderr notes what was imported when the
    first line was written."""
    queries, collection = tmp_path / "q.tsv", tmp_path / "c.tsv"
    queries.write_text("1\tquery one\n")
    collection.write_text("10\tpassage ten\n")
    argv = ["--queries", str(queries), "--collection", str(collection), "--output", str(tmp_path / "o.jsonl"),
            "--teacher", str(tmp_path / "no-such-teacher")]
    probe = ("import sys\nfrom hil.cli.teacher import main\nfirst = []\nstream = sys.stderr\n"
             "class Probe:\n"
             "    def write(self, text):\n"
             "        if not first and text.strip():\n"
             "            first.append((text.strip(), 'torch' in sys.modules))\n"
             "        return stream.write(text)\n"
             "    def flush(self):\n"
             "        stream.flush()\n"
             "sys.stderr = Probe()\n"
             f"status = main({argv!r})\n"
             "print(repr((first[0], status)))\n")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    (line, torch_loaded), status = eval(shown.stdout.strip().splitlines()[-1])
    assert line == f"[teacher] loading {queries} and the teacher {tmp_path / 'no-such-teacher'}", shown.stderr
    assert not torch_loaded and status == 2  # the missing teacher is found after the line, with torch loaded


def test_the_kept_vectors_stay_within_their_bound(dense, monkeypatch):
    """Memory stays bounded: beyond ``_CACHE_BYTES`` the least recently used vectors are dropped (and encoded again
    when a later group of queries needs them), the scores the same as with room for all."""
    folder, model = dense
    queries, docs = corpus(12, documents=16)
    candidates = {qid: list(docs)[i % 8: i % 8 + 6] for i, qid in enumerate(queries)}
    monkeypatch.setattr(teacher_models, "_QUERY_CHUNK", 2)
    roomy = teacher_models.DenseTeacher(str(folder), torch.device("cpu"), 4, None)
    expected = roomy.score(queries, candidates, docs)
    monkeypatch.setattr(teacher_models, "_CACHE_BYTES", 7 * 4 * model.config.hidden_size)
    small = teacher_models.DenseTeacher(str(folder), torch.device("cpu"), 4, None)
    encoded = count_encoded(monkeypatch)
    assert small.capacity == 7
    found = small.score(queries, candidates, docs)
    assert len(small.passages) <= 7 and len(roomy.passages) == len({docs[p] for c in candidates.values() for p in c})
    assert len(encoded) > len(roomy.passages) + len(queries)  # some were dropped and encoded again
    for qid in queries:
        assert found[qid] == pytest.approx(expected[qid], abs=1e-6)


def test_a_dense_teacher_cuts_texts_where_sentence_transformers_would(dense):
    # all-MiniLM-L6-v2 on the hub says max_seq_length 256 in sentence_bert_config.json, and sentence-transformers
    # encodes with it; without that file the tokenizer's limit (capped at 512); an explicit --max-length wins.
    folder, _ = dense
    limit = teacher_models.DenseTeacher(str(folder), torch.device("cpu"), 4, None).max_length
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 7, "do_lower_case": False}))
    assert limit > 7 and teacher_models.DenseTeacher(str(folder), torch.device("cpu"), 4, None).max_length == 7
    assert teacher_models.DenseTeacher(str(folder), torch.device("cpu"), 4, 5).max_length == 5
    short = teacher_models.DenseTeacher(str(folder), torch.device("cpu"), 4, None)
    long_text = " ".join(["word"] * 40)
    cut = " ".join(["word"] * 5)  # 7 tokens: [CLS], five words, [SEP]
    assert torch.allclose(short.embed([long_text]), short.embed([cut]), atol=1e-6)
    (folder / "sentence_bert_config.json").write_text("{}")
    with pytest.raises(teacher_models.UserError, match="sentence_bert_config.json: no integer max_seq_length"):
        teacher_models.DenseTeacher(str(folder), torch.device("cpu"), 4, None)
