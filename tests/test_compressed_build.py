"""The build that compresses as it encodes (issue 38, hil.retrieval.compressed_build) against the build from fp16.

The reference for "the same index" is today's way: the corpus encoded into an fp16 index, then compressed with the
same centroids and buckets by the functions a build from fp16 uses (``assign_codes``, ``ResidualCodec.compress``,
``build_ivf``), written out here step by step. Crashes are real: a separate build process SIGKILLed at every stage
(the test hook ``HIL_TEST_KILL_AT``), then the build rerun, byte for byte the uninterrupted index.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hil.errors import UserError
from hil.retrieval import compressed_build
from hil.retrieval.backends.configs import FlatIndexConfig, PlaidIndexConfig
from hil.retrieval.builder import build_index, open_or_build_index
from hil.retrieval.chunks import KILL_AT_ENV
from hil.retrieval.compressed_build import sample_size, sampled_documents
from hil.retrieval.index import INDEX_JSON, TokenIndex, plaid_paths
from hil.retrieval.kmeans import FAISS_ON_CPU
from hil.retrieval.plaid import assign_codes, build_ivf

from toys import TwoHeadEncoder, assert_same_index, make_encoder, toy_corpus

REPO = Path(__file__).resolve().parents[1]
COMPRESSED = PlaidIndexConfig(n_centroids=16, train_size=300, residual_bits=2, keep_embeddings=False)
PROVENANCE_KEYS = frozenset({"created", "versions", "git_commit", "host", "build_seconds"})


def test_sample_size_is_colbertv2s_rule():
    # collection_indexer.py _sample_pids: min(1 + int(16 * sqrt(120 * N)), N)
    for n_docs, expected in ((10, 10), (30_000, 30_000), (100_000, 55_426),
                             (8_841_823, 1 + int(16 * np.sqrt(120 * 8_841_823)))):
        assert sample_size(n_docs) == min(expected, n_docs)
    drawn = sampled_documents(200_000, seed=3)
    assert len(set(drawn.tolist())) == len(drawn) == sample_size(200_000)
    assert not np.all(np.diff(drawn) > 0), "drawn in a random order, not sorted"
    assert np.array_equal(drawn, sampled_documents(200_000, seed=3))
    assert not np.array_equal(drawn, sampled_documents(200_000, seed=4))


def fp16_then_compressed(encoder, ids, texts, folder: Path, compressed: TokenIndex, codecs) -> dict[str, np.ndarray]:
    """Today's way, by hand: an fp16 index of the corpus, then every head compressed with ``compressed``'s
    centroids and buckets (and the assignment its chunks used): codes, residuals, inverted file."""
    fp16 = build_index(encoder, ids, texts, folder, chunk_docs=7, progress=False)  # another chunking on purpose
    arrays = {"doc_offsets": fp16.doc_offsets, "token_ids": np.asarray(fp16.token_ids)}
    for head in fp16.head_names:
        centroids = np.load(plaid_paths(compressed.directory, head)["centroids"])
        codes = assign_codes(fp16.embeddings[head], centroids, engine=FAISS_ON_CPU,
                             assignment=codecs.heads[head].assignment)
        arrays[f"{head}.codes"] = codes
        arrays[f"{head}.residuals"] = codecs.heads[head].codec.compress(np.asarray(fp16.embeddings[head]), codes)
        arrays[f"{head}.ivf_offsets"], arrays[f"{head}.ivf_docs"] = build_ivf(codes, fp16.doc_offsets,
                                                                             len(centroids))
    return arrays


@pytest.mark.parametrize("two_heads", [False, True], ids=["one-head", "two-heads"])
@pytest.mark.parametrize("assignment", ["exact", "two-level"])
def test_the_same_bytes_as_fp16_first_then_compressed(hf_tokenizer, tmp_path, monkeypatch, two_heads, assignment):
    encoder = make_encoder(hf_tokenizer, TwoHeadEncoder) if two_heads else make_encoder(hf_tokenizer)
    ids, texts = toy_corpus(120)
    used = []
    real = compressed_build.load_chunk_codec
    monkeypatch.setattr(compressed_build, "load_chunk_codec", lambda *a: used.append(real(*a)) or used[-1])
    config = PlaidIndexConfig(n_centroids=16, train_size=300, residual_bits=2, keep_embeddings=False,
                              assignment=assignment, assignment_nprobe=2)
    index = build_index(encoder, ids, texts, tmp_path / "compressed", backend=config, chunk_docs=32, progress=False)
    assert not any(path.name.endswith(".embeddings.npy") for path in index.directory.iterdir())
    assert index.compressed_only and index.backend_settings["params"]["assignment"] == assignment
    expected = fp16_then_compressed(encoder, ids, texts, tmp_path / "fp16", index, used[0])
    np.testing.assert_array_equal(index.doc_offsets, expected["doc_offsets"])
    # Token ids only where the score reads them: the two-head toy sums its own way, ColBERT's MaxSim reads none
    assert index.meta["stores_token_ids"] is two_heads and encoder.scores_repeated_padding is not two_heads
    assert (index.directory / "token_ids.npy").exists() is two_heads
    if two_heads:
        np.testing.assert_array_equal(np.asarray(index.token_ids), expected["token_ids"])
    else:
        assert index.token_ids is None
        with pytest.raises(ValueError, match="stores no token ids"):
            index.torch_view("token_ids")
    for head in index.head_names:
        paths = plaid_paths(index.directory, head)
        for name in ("codes", "residuals", "ivf_offsets", "ivf_docs"):
            stored = np.load(paths[name])
            assert stored.dtype == expected[f"{head}.{name}"].dtype, name
            np.testing.assert_array_equal(stored, expected[f"{head}.{name}"], err_msg=f"{head}.{name}")
    assert index.doc_ids == ids


def test_the_plan_is_recorded_and_the_index_reused(hf_tokenizer, tmp_path, caplog):
    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus(80)
    index = open_or_build_index(encoder, ids, texts, tmp_path / "idx", backend=COMPRESSED, chunk_docs=32,
                                progress=False)
    plan = index.meta["build_plan"]
    assert plan["sampled_docs"] == plan["drawn_docs"] == 80  # a small corpus is sampled whole (ColBERTv2's rule)
    assert plan["sampled_tokens"] == index.n_tokens == index.meta["sizing_tokens"] == plan["n_tokens_estimate"]
    assert list(index.meta["build_seconds"]) == ["sample", "kmeans", "encode", "join", "inverted_file"]
    assert index.meta["backend"]["codecs"]["colbert"]["assignment"] == {"method": "exact"}
    again = open_or_build_index(encoder, ids, texts, tmp_path / "idx", backend=COMPRESSED, chunk_docs=32,
                                progress=False)
    assert again.how_opened == "reused"


def test_a_large_corpus_samples_part_of_it_and_holds_out_the_bucket_tokens(hf_tokenizer, tmp_path, monkeypatch):
    """When the drawn documents' tokens cover k-means and the buckets, drawing stops; the two samples are
    disjoint (ColBERTv2 holds out 5% of its sample for the buckets)."""
    monkeypatch.setattr(compressed_build, "CODEC_SAMPLE", 100)
    seen = {}
    real = compressed_build.fit_residual_codec
    monkeypatch.setattr(compressed_build, "fit_residual_codec",
                        lambda sample, *a: seen.setdefault("heldout", sample) is not None and real(sample, *a))
    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus(400)
    config = PlaidIndexConfig(n_centroids=8, train_size=200, residual_bits=2, keep_embeddings=False)
    index = build_index(encoder, ids, texts, tmp_path / "idx", backend=config, chunk_docs=16, progress=False)
    plan = index.meta["build_plan"]
    assert plan["sampled_docs"] < 400 and plan["sampled_docs"] % 16 == 0
    assert plan["sampled_tokens"] >= 300 and (plan["train_tokens"], plan["heldout_tokens"]) == (200, 100)
    assert len(seen["heldout"]) == 100
    assert abs(plan["n_tokens_estimate"] - index.n_tokens) < 0.25 * index.n_tokens


def test_the_sampling_bar_ends_where_the_sample_will_be_covered(hf_tokenizer, tmp_path, monkeypatch):
    """Its ETA: after each block the bar's end is the documents that should cover what is wanted, not every drawn
    document (drawing stops there)."""
    monkeypatch.setattr(compressed_build, "CODEC_SAMPLE", 100)
    totals = []

    class Recording:  # the bar, its end recorded at every redraw the build asks for
        def __init__(self, bar):
            self.bar = bar

        def __getattr__(self, name):
            return getattr(self.bar, name)

        def __setattr__(self, name, value):
            setattr(self.bar, name, value) if name != "bar" else object.__setattr__(self, name, value)

        def refresh(self):
            totals.append(self.bar.total)

    real = compressed_build.progress_bar
    monkeypatch.setattr(compressed_build, "progress_bar", lambda total, desc, *a, **k: (
        Recording(real(total, desc, *a, **k)) if desc == "sampling documents" else real(total, desc, *a, **k)))
    ids, texts = toy_corpus(400)
    config = PlaidIndexConfig(n_centroids=8, train_size=200, residual_bits=2, keep_embeddings=False)
    index = build_index(make_encoder(hf_tokenizer), ids, texts, tmp_path / "idx", backend=config, chunk_docs=16,
                        progress=False)
    plan = index.meta["build_plan"]
    assert plan["sampled_docs"] < plan["drawn_docs"] == 400 and totals
    assert all(total < plan["drawn_docs"] for total in totals), "never every drawn document"
    assert abs(totals[-1] - plan["sampled_docs"]) <= 16, "the last end shown was within a block of the stop"


# -- crashes: a real process killed at every stage ------------------------------------------------------------------

BUILDER = r"""
import json, sys
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
sys.path.insert(0, args["tests"])
from transformers import AutoTokenizer
from toys import make_encoder, toy_corpus
from hil.retrieval import compressed_build
from hil.retrieval.backends.configs import FlatIndexConfig, PlaidIndexConfig
from hil.retrieval.builder import build_index
compressed_build.CODEC_SAMPLE = 100
encoder = make_encoder(AutoTokenizer.from_pretrained(args["tokenizer"]))
ids, texts = toy_corpus(200)
build_index(encoder, ids, texts, args["directory"], backend=PlaidIndexConfig(**args["config"]), chunk_docs=32,
            progress=False)
"""
CRASH_CONFIG = {"n_centroids": 8, "train_size": 200, "residual_bits": 2, "keep_embeddings": False}


def build_in_process(hf_tokenizer, directory, monkeypatch):
    monkeypatch.setattr(compressed_build, "CODEC_SAMPLE", 100)
    ids, texts = toy_corpus(200)
    return build_index(make_encoder(hf_tokenizer), ids, texts, directory, backend=PlaidIndexConfig(**CRASH_CONFIG),
                       chunk_docs=32, progress=False)


@pytest.fixture(scope="module")
def uninterrupted(hf_tokenizer, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        return build_in_process(hf_tokenizer, tmp_path_factory.mktemp("reference") / "idx", patch)


# (the stage the build dies at, a file the unfinished folder must then hold)
KILLS = [pytest.param("chunk-1-arrays", "chunks/chunk-00001.colbert.residuals.npy", id="mid-compression"),
         pytest.param("join-2", ".join-state.json", id="mid-join"),
         pytest.param("sampled", "sample.colbert.npy", id="after-sample", marks=pytest.mark.slow),
         pytest.param("trained", "colbert.centroids.npy", id="after-kmeans", marks=pytest.mark.slow),
         pytest.param("joined", "colbert.residuals.npy", id="after-join", marks=pytest.mark.slow),
         pytest.param("sealed", INDEX_JSON, id="before-rename", marks=pytest.mark.slow)]


@pytest.mark.parametrize("step, left", KILLS)
def test_a_build_killed_at_any_stage_resumes_to_the_same_index(step, left, hf_tokenizer, tiny_model_dir,
                                                                uninterrupted, tmp_path, monkeypatch):
    directory = tmp_path / "idx"
    args = {"threads": torch.get_num_threads(), "tests": str(REPO / "tests"), "tokenizer": str(tiny_model_dir),
            "directory": str(directory), "config": CRASH_CONFIG}
    env = {**{k: v for k, v in os.environ.items() if k != KILL_AT_ENV}, KILL_AT_ENV: step}
    done = subprocess.run([sys.executable, "-c", BUILDER, json.dumps(args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, f"expected a SIGKILL at {step}:\n{done.stderr[-2000:]}"
    unfinished = directory.with_name("idx.tmp-build")
    assert not directory.exists() and (unfinished / left).is_file(), sorted(
        str(p.relative_to(unfinished)) for p in unfinished.rglob("*"))
    if step != "sampled":  # the disk is the index's once k-means is done
        assert not list(unfinished.glob("*sample*")), sorted(p.name for p in unfinished.iterdir())
    stored = []
    real = compressed_build.run
    if step in ("joined", "sealed", "join-2"):  # encoding finished before the kill: the rerun encodes nothing
        monkeypatch.setattr("hil.retrieval.builder._Build.encode", lambda *a, **k: stored.append(1))
    monkeypatch.setattr(compressed_build, "run", real)
    index = build_in_process(hf_tokenizer, directory, monkeypatch)
    assert stored == []
    assert not unfinished.exists()
    assert_same_index(index.directory, uninterrupted.directory, PROVENANCE_KEYS)
    assert TokenIndex.load(directory, verify="full").verified == "full"


# -- the disk, before any work -------------------------------------------------------------------------------------

def test_a_corpus_that_will_not_fit_is_refused_before_any_encoding(hf_tokenizer, tmp_path, monkeypatch):
    from hil.retrieval import disk_plan

    encoder = make_encoder(hf_tokenizer)
    calls = []
    monkeypatch.setattr(type(encoder), "encode", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(disk_plan, "free_bytes", lambda directory: 10_000)
    ids, texts = toy_corpus(200)
    with pytest.raises(UserError) as caught:
        build_index(encoder, ids, texts, tmp_path / "idx", backend=COMPRESSED, progress=False)
    message = str(caught.value)
    assert str(tmp_path / "idx") in message and "10 kB is free" in message and "200 documents" in message
    assert "\n" not in message
    assert calls == [] and not (tmp_path / "idx.tmp-build").exists() and not (tmp_path / "idx").exists()


@pytest.mark.parametrize("config", [FlatIndexConfig(), PlaidIndexConfig(), COMPRESSED],
                         ids=["flat", "plaid", "compressed"])
def test_the_disk_estimate_covers_the_index_without_overstating_it(hf_tokenizer, tmp_path, config):
    from hil.retrieval import disk_plan

    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus(300)
    config, _ = disk_plan.sized_config(config, encoder, len(ids), disk_plan.CorpusLengths(encoder, texts, None))
    need = disk_plan.disk_need(encoder, config, ids,
                               tokens_per_doc=disk_plan.tokens_per_document(encoder, texts, None))
    index = build_index(encoder, ids, texts, tmp_path / "idx", backend=config, progress=False)
    on_disk = index.disk_bytes()
    # Token lengths are estimated from the tokenization (an upper bound of what is stored): within 2.5x above, but
    # for the fixed allowance (index.json, headers) that dominates a toy index.
    assert on_disk <= need.index_bytes <= 2.5 * on_disk + disk_plan._FIXED_BYTES, (on_disk, need)
    assert need.peak_bytes >= need.index_bytes


def test_the_disk_check_tokenizes_a_sample_only_when_the_doc_maxlen_bound_does_not_fit(hf_tokenizer, tmp_path,
                                                                                        monkeypatch):
    from hil.retrieval import disk_plan

    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus(300)
    per_doc = disk_plan.tokens_per_document(encoder, texts, None)
    measured = disk_plan.disk_need(encoder, COMPRESSED, ids, tokens_per_doc=per_doc)
    bound = disk_plan.disk_need(encoder, COMPRESSED, ids, tokens_per_doc=encoder.tokenizer.doc_maxlen)
    assert encoder.tokenizer.doc_maxlen > per_doc and bound.peak_bytes > measured.peak_bytes
    calls = []
    real = disk_plan.tokens_per_document
    monkeypatch.setattr(disk_plan, "tokens_per_document", lambda *a, **k: calls.append(1) or real(*a, **k))

    def check(free):
        disk_plan.check_disk(tmp_path / "idx", encoder, COMPRESSED, ids, disk_plan.CorpusLengths(encoder, texts, None),
                             free=free)

    check(bound.peak_bytes)
    assert calls == [], "the bound fits: nothing tokenized"
    check((measured.peak_bytes + bound.peak_bytes) // 2)
    assert calls == [1], "the bound does not fit: the measured need decides, and it fits"
    with pytest.raises(UserError, match="not enough disk"):
        check(measured.peak_bytes - 1)


# -- the storage a corpus gets when left to it ----------------------------------------------------------------------

@pytest.mark.parametrize("asked, fp16_bytes, expected", [
    ((None, None), 4 << 30, (0, True)),             # at the threshold: fp16 kept, no residuals (as before)
    ((None, None), (4 << 30) + 256, (2, False)),     # one token above: compressed as encoded, 2 bits
    ((4, None), 1 << 20, (4, True)),                 # bits given, small: fp16 kept beside them
    ((4, None), 1 << 40, (4, False)),                # bits given, large: fp16 dropped
    ((0, None), 1 << 40, (0, True)),                 # no residuals asked: the fp16 vectors are the storage
    ((None, False), 1 << 20, (2, False)),            # no fp16 asked on a small corpus: residuals it needs
    ((None, True), 1 << 40, (2, True)),              # fp16 asked on a large one: kept, residuals beside
    ((8, False), 1 << 20, (8, False)),               # both given: as given
])
def test_plaid_storage_left_to_the_corpus(asked, fp16_bytes, expected):
    from hil.retrieval.backends.configs import KEEP_FP16_UP_TO_BYTES

    assert KEEP_FP16_UP_TO_BYTES == 4 << 30
    config = PlaidIndexConfig(residual_bits=asked[0], keep_embeddings=asked[1])
    sized, record = config.sized(fp16_bytes // 256, 256)  # D = 128, one head
    assert (sized.residual_bits, sized.keep_embeddings) == expected
    assert record["asked"] == {"residual_bits": asked[0], "keep_embeddings": asked[1]}
    assert (record["fp16_bytes_estimate"] == fp16_bytes
            and (record["residual_bits"], record["keep_embeddings"]) == expected)
    assert not sized.storage_left_to_corpus and sized.n_centroids == config.n_centroids


def test_auto_spellings_are_none_and_bad_keep_embeddings_is_refused():
    assert PlaidIndexConfig(residual_bits="auto", keep_embeddings="auto") == PlaidIndexConfig()
    with pytest.raises(UserError, match="keep_embeddings must be true, false or null"):
        PlaidIndexConfig(keep_embeddings="false")


def test_a_corpus_above_the_threshold_is_compressed_as_encoded_and_says_so(hf_tokenizer, tmp_path, monkeypatch):
    from hil.retrieval.backends import centroid_configs  # where PlaidIndexConfig.sized reads it

    encoder = make_encoder(hf_tokenizer)  # D = 16: 32 fp16 bytes a token
    ids, texts = toy_corpus(120)
    small = build_index(encoder, ids, texts, tmp_path / "small", backend=PlaidIndexConfig(n_centroids=16),
                        progress=False)
    assert not small.compressed_only and small.backend_settings["params"]["residual_bits"] == 0
    assert small.meta["storage_choice"]["tokens_per_doc"] == "doc_maxlen bound"
    # The threshold lowered below this corpus (the doc_maxlen bound is above it, the measured length too)
    monkeypatch.setattr(centroid_configs, "KEEP_FP16_UP_TO_BYTES", 32 * small.n_tokens // 2)
    large = build_index(encoder, ids, texts, tmp_path / "large", backend=PlaidIndexConfig(n_centroids=16),
                        progress=False)
    assert large.compressed_only and large.backend_settings["params"]["residual_bits"] == 2
    choice = large.meta["storage_choice"]
    assert choice["tokens_per_doc"] == "measured on a sample" and choice["keep_embeddings"] is False
    assert choice["n_tokens_estimate"] >= large.n_tokens, "tokenized lengths bound the stored tokens from above"
    assert "plan" in json.dumps(large.meta) and large.meta.get("build_plan"), "built compressed as encoded"
    # Reused as it is by the same request (the unset values match what was chosen), whatever the threshold now
    monkeypatch.setattr(centroid_configs, "KEEP_FP16_UP_TO_BYTES", 4 << 30)
    again = open_or_build_index(encoder, ids, texts, tmp_path / "large", backend=PlaidIndexConfig(n_centroids=16),
                                progress=False)
    assert again.how_opened == "reused"


@pytest.mark.parametrize("config, per_token", [(FlatIndexConfig(), 4 * 16), (COMPRESSED, 0)], ids=["flat", "plaid"])
def test_an_index_whose_search_would_not_fit_in_memory_is_refused_before_any_encoding(hf_tokenizer, tmp_path,
                                                                                      monkeypatch, config, per_token):
    from hil.retrieval import disk_plan

    encoder = make_encoder(hf_tokenizer)  # D = 16: flat holds 64 bytes a token in fp32
    calls = []
    monkeypatch.setattr(type(encoder), "encode", lambda *a, **k: calls.append(1))
    ids, texts = toy_corpus(200)
    n_tokens = 200 * disk_plan.tokens_per_document(encoder, texts, None)
    monkeypatch.setattr(disk_plan, "physical_memory_bytes", lambda: int(0.9 * n_tokens * 64))
    if not per_token:  # PLAID's files are memory-mapped: nothing to refuse (the build stopped by hand, after)
        assert disk_plan.search_memory_need(encoder, config, 200, 10_000.0) == 0
        return
    with pytest.raises(UserError) as caught:
        build_index(encoder, ids, texts, tmp_path / "idx", backend=config, progress=False)
    message = str(caught.value)
    assert "200 documents" in message and "use the plaid back-end" in message and "\n" not in message
    assert calls == [] and not (tmp_path / "idx").exists()
    lengths = disk_plan.CorpusLengths(encoder, texts, None)
    assert disk_plan.search_memory_need(encoder, config, 200, lengths.bound) > 1.1 * n_tokens * 64, \
        "the doc_maxlen bound alone would refuse it: the measured lengths decide"
    disk_plan.check_memory(tmp_path / "idx", encoder, config, 200, lengths, ram=int(1.1 * n_tokens * 64))


def test_an_index_without_token_ids_ranks_as_the_one_with_them_and_refuses_a_score_that_reads_them(hf_tokenizer,
                                                                                                   tmp_path,
                                                                                                   monkeypatch):
    from hil.retrieval import builder as builder_module
    from hil.retrieval.full_ranking import full_rank
    from hil.retrieval.store import gather_documents

    encoder = make_encoder(hf_tokenizer)
    ids, texts = toy_corpus(120)
    lean = build_index(encoder, ids, texts, tmp_path / "lean", backend=COMPRESSED, chunk_docs=32, progress=False)
    monkeypatch.setattr(builder_module, "stores_token_ids", lambda *a: True)
    kept = build_index(encoder, ids, texts, tmp_path / "kept", backend=COMPRESSED, chunk_docs=32, progress=False)
    monkeypatch.undo()
    assert kept.meta["stores_token_ids"] and not lean.meta["stores_token_ids"]
    assert kept.disk_bytes() - lean.disk_bytes() >= 4 * kept.n_tokens, "4 bytes a token saved"
    assert not list((tmp_path / "lean").glob("*token_ids*")) and not (tmp_path / "lean.tmp-build").exists()
    queries = {f"q{i}": texts[i * 7] for i in range(6)}
    for name in ("codes", "residuals", "ivf_docs"):
        assert np.array_equal(np.load(plaid_paths(lean.directory, "colbert")[name]),
                              np.load(plaid_paths(kept.directory, "colbert")[name])), name
    a = full_rank(encoder, lean, queries, k=10, progress=False).run
    b = full_rank(encoder, kept, queries, k=10, progress=False).run
    assert a == b
    batch = gather_documents(lean, [3, 1])
    assert not bool(batch.input_ids.any())
    with pytest.raises(ValueError, match="stores no token ids"):
        gather_documents(lean, [3, 1], token_ids=True)
