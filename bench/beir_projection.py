"""Every large BEIR corpus, projected: documents, tokens, index disk, memory and build time (issue 38, item 5).

    python bench/beir_projection.py --scale bench/results/scale.json --output bench/results/beir-projection.json \
        --markdown docs/results.md

What is measured and what is projected, row by row:

- **documents**: ir_datasets' metadata (``ir_datasets/etc/metadata.json``, the corpora's own counts).
- **tokens per document** (stored, i.e. scored: ColBERT's document tokenization at ``doc_maxlen`` 180 with
  punctuation dropped, bert-base-uncased's WordPiece vocabulary as MiniLM's): *measured* on the corpora at hand
  (SciFact, NFCorpus; MS MARCO from the 4,297 TREC DL19 passages of ``msmarco/dl19``, a sample biased towards
  judged passages: 62.6 words against the collection's 56.0). For a corpus without a copy it is *estimated*: the
  length distribution of the local corpus nearest in mean words (MS MARCO's passages below 100 words, SciFact's
  abstracts above), every document's words scaled to the corpus's mean (BEIR, Thakur et al. 2021, Table 1: words
  of title + text; SciFact 213.63 and NFCorpus 232.26 there, 214.6 and 233.8 counted here), then cut at
  ``doc_maxlen``. The same estimate is made for the local corpora from each other's shapes, and its error printed.
- **disk**: the 2-bit compressed-as-encoded index (D = 128, ColBERT: no token ids), per token: 32 B of residuals,
  the code (2 B up to 2^16 centroids, else 4), the inverted file at the entries per token *measured* by
  ``bench/scale.py`` at the size nearest in centroids, the centroids and the per-document arrays; the peak on the
  way at the peak/final ratio *measured* at x256, plus the k-means sample.
- **memory**: the build's and the search's peak RssAnon *measured* at x16 and x256, extended linearly in
  documents (ids and offsets are what grows).
- **build time on this CPU**: encoding at the document tokens/s *measured* here (MiniLM, fp32, 2 threads, this
  script's ``encode`` step; bert-base, the paper's backbone, from it by the ratio of FLOPs per token), plus the
  index stages at the per-token (and per-centroid, for k-means) rates *measured* at x256.
- **build time on one H100 / H200**: *projected* (no GPU was lent): encoding at ``--gpu-tflops`` of useful fp16
  throughput over the model's FLOPs per token, k-means and exact assignment at ``--gpu-fp32-tflops``, the
  compression, join and inverted file at the CPU's measured rates (host work). H200 has H100's compute (the same
  GH100 chip) and more memory: the same figures.

Every projected figure is marked as such in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

# BEIR, Thakur et al. 2021, Table 1: average words per document (title + text).
BEIR_MEAN_WORDS = {"msmarco": 55.98, "trec-covid": 160.77, "nq": 78.88, "hotpotqa": 46.30, "fever": 84.76,
                   "climate-fever": 84.76, "dbpedia-entity": 49.68, "quora": 11.44, "cqadupstack": 129.09,
                   "webis-touche2020": 292.37, "scifact": 213.63, "nfcorpus": 232.26}
# The large half of BEIR (issue 38), largest first; ir_datasets' names.
LARGE = ("msmarco", "fever", "climate-fever", "hotpotqa", "dbpedia-entity", "nq", "quora", "cqadupstack",
         "webis-touche2020", "trec-covid")
DOC_MAXLEN = 180
DIM, RESIDUAL_BITS = 128, 2
SHORT_WORDS = 100  # below this mean, a corpus takes MS MARCO's passage shape; above, SciFact's abstracts'
# FLOPs per attended token of a BERT forward pass: 2 x Linear weights (bench/measure.encoder_flops, attention
# products left out: they add ~10% at 180 tokens). MiniLM-L6: 10.6M Linear weights; bert-base: 85.0M.
LINEAR_WEIGHTS = {"all-MiniLM-L6-v2": 10.6e6, "bert-base-uncased": 85.0e6}
SECTION = ("<!-- beir-projection: start (bench/beir_projection.py writes this section) -->",
           "<!-- beir-projection: end -->")


def doc_counts() -> dict[str, int]:
    """Documents per corpus, from ir_datasets' metadata (CQADupStack: its 12 forums summed)."""
    import ir_datasets

    metadata = json.loads((Path(ir_datasets.__file__).parent / "etc" / "metadata.json").read_text())
    counts = {}
    for name in LARGE + ("scifact", "nfcorpus"):
        if name == "cqadupstack":
            counts[name] = sum(v["docs"]["count"] for k, v in metadata.items()
                               if k.startswith("beir/cqadupstack/") and k.count("/") == 2 and "docs" in v)
        else:
            counts[name] = metadata[f"beir/{name}"]["docs"]["count"]
    return counts


def local_lengths(data_dir: Path, tokenizer_path: str) -> dict[str, dict[str, np.ndarray]]:
    """Per local corpus and document: words (title + text), attended tokens and stored tokens."""
    from transformers import AutoTokenizer

    from hil.data.tokenization import ColBERTTokenizer

    tokenizer = ColBERTTokenizer(AutoTokenizer.from_pretrained(tokenizer_path), doc_maxlen=DOC_MAXLEN)
    punctuation = set(tokenizer.punctuation_ids.tolist())
    sources = {"scifact": data_dir / "beir/scifact/corpus.jsonl", "nfcorpus": data_dir / "beir/nfcorpus/corpus.jsonl",
               "msmarco": data_dir / "msmarco/dl19/corpus.jsonl"}
    out = {}
    for name, path in sources.items():
        texts = []
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                doc = json.loads(line)
                title, text = doc.get("title", ""), doc.get("text", "")
                texts.append(f"{title} {text}".strip() if title else text.strip())
        rows = tokenizer.document_rows(texts)
        full = tokenizer.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        out[name] = {"words": np.array([len(t.split()) for t in texts], dtype=np.float64),
                     "attended": np.array([len(r) for r in rows], dtype=np.float64),
                     "stored": np.array([sum(1 for i in r if i not in punctuation) for r in rows], dtype=np.float64),
                     "uncut_attended": np.array([len(f) + 3 for f in full], dtype=np.float64),
                     "uncut_stored": np.array([sum(1 for i in f if i not in punctuation) + 3 for f in full],
                                              dtype=np.float64)}
    return out


def estimated_tokens(shape: dict[str, np.ndarray], mean_words: float) -> float:
    """Stored tokens per document of a corpus of ``mean_words`` words a document, from a local corpus's ``shape``:
    every document's uncut token counts scaled by ``mean_words / its mean``, then cut at ``doc_maxlen`` (the stored
    share of an attended token kept)."""
    factor = mean_words / float(shape["words"].mean())
    attended = shape["uncut_attended"] * factor
    stored = shape["uncut_stored"] * factor
    kept = np.minimum(1.0, DOC_MAXLEN / attended)
    return float((stored * kept).mean())


def shape_for(mean_words: float, lengths: dict[str, dict[str, np.ndarray]], exclude: str = "") -> str:
    if mean_words < SHORT_WORDS and exclude != "msmarco":
        return "msmarco"
    return "scifact" if exclude != "scifact" else "nfcorpus"


def n_centroids(n_tokens: float) -> int:
    """ColBERTv2's rule (hil.retrieval.plaid.default_n_centroids)."""
    return 2 ** int(math.floor(math.log2(16 * math.sqrt(n_tokens))))


def encode_rate(model: str, data_dir: Path, n_docs: int, threads: int) -> dict[str, Any]:
    """Document tokens/s of ``model`` (our document encoding, fp32, ``threads`` threads) over SciFact documents."""
    import torch

    from hil.data.beir import load_beir
    from hil.modeling.loading import load_encoder
    from hil.retrieval.encoding import encode_document_tokens, eval_mode

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    encoder = load_encoder(model, doc_maxlen=DOC_MAXLEN)
    texts = load_beir(str(data_dir / "beir/scifact")).documents()[:n_docs]
    attended = sum(len(r) for r in encoder.tokenizer.document_rows(texts))
    with eval_mode(encoder):
        encode_document_tokens(encoder, texts[:32], batch_size=32)  # warm-up
        tick = time.perf_counter()
        encoded = encode_document_tokens(encoder, texts, batch_size=32)
        seconds = time.perf_counter() - tick
    return {"docs": len(texts), "attended_tokens": attended, "stored_tokens": int(encoded.lengths.sum()),
            "seconds": seconds, "attended_tokens_per_s": attended / seconds, "threads": threads,
            "load_average_before": list(os.getloadavg())}


def dots_per_token(n_centroids: int) -> float:
    """Centroid products a token costs in a two-level assignment: the round(sqrt(C)) groups, then the members of
    the groups probed (hil.retrieval.backends.centroid.two_level_nprobe)."""
    from hil.retrieval.backends.centroid import two_level_nprobe

    groups = max(1, round(n_centroids ** 0.5))
    return groups + two_level_nprobe(n_centroids) * n_centroids / groups


def stage_rates(scale: dict[str, Any]) -> dict[str, Any]:
    """The index stages' costs from ``bench/scale.py``'s sizes (default builds only): the encode-and-compress stage
    per token as ``a + b * dots_per_token(C)`` (least squares over the sizes with two-level assignment: the
    assignment's centroid products plus a fixed cost a token), k-means per ``train_tokens * sqrt(C)`` (two-level:
    each sampled point scores the coarse and then its cluster's centroids), sampling, join and inverted file per
    token (at the largest size); the IVF entries per token, bytes per token, peak/final disk and memory at each."""
    sizes = {label: entry for label, entry in scale["results"]["sizes"].items() if label == f"x{entry['factor']}"}
    rounds = scale["results"].get("latency_rounds", {})
    per_size, fit_x, fit_y = {}, [], []
    for label, entry in sizes.items():
        b = entry["build"]
        # The search's memory from the latency rounds where there are some (the search as it is after the whole
        # run, every size under the same code), else from the size's own search.
        search_rss = max((r["peak_rss_anon_mb"] for r in rounds.get(label, {}).get("rounds", [])),
                         default=entry["search"]["peak_rss_anon_mb"])
        n, c = b["n_tokens"], b["params"]["n_centroids"]
        per_size[label] = {"n_tokens": n, "n_docs": b["n_docs"], "n_centroids": c,
                           "assignment": b["params"]["assignment"],
                           "ivf_entries_per_token": sum(b["build_plan"]["inverted_file"]["entries"].values()) / n,
                           "bytes_per_token": b["bytes_per_token"],
                           "peak_over_final": b["peak_disk_bytes"] / b["disk_bytes"],
                           "build_rss_anon_mb": b["peak_rss_anon_mb"], "search_rss_anon_mb": search_rss,
                           "encode_s_per_token": b["build_seconds"]["encode"] / n}
        if b["params"]["assignment"] == "two-level":
            fit_x.append(dots_per_token(c))
            fit_y.append(per_size[label]["encode_s_per_token"])
    a, b_dot = np.linalg.lstsq(np.stack([np.ones(len(fit_x)), fit_x], axis=1), np.array(fit_y), rcond=None)[0]
    largest = max(sizes.values(), key=lambda e: e["build"]["n_tokens"])
    build = largest["build"]
    n, c, plan, seconds = build["n_tokens"], build["params"]["n_centroids"], build["build_plan"], build["build_seconds"]
    return {"from": f"x{largest['factor']}", "n_tokens": n, "n_centroids": c,
            "compress_fixed_s_per_token": float(a), "compress_s_per_dot": float(b_dot),
            "kmeans_s_per_unit": seconds["kmeans"] / (plan["train_tokens"] * math.sqrt(c)),
            "sample_s_per_token": seconds["sample"] / plan["sampled_tokens"],
            "join_s_per_token": seconds["join"] / n, "ivf_s_per_token": seconds["inverted_file"] / n,
            "sizes": per_size}


def project(name: str, n_docs: int, per_doc: float, measured: bool, rates: dict[str, Any],
            encoding: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    tokens = n_docs * per_doc
    centroids = n_centroids(tokens)
    sizes = rates["sizes"]
    nearest = min(sizes.values(), key=lambda s: abs(math.log2(s["n_centroids"]) - math.log2(centroids)))
    code_bytes = 2 if centroids <= 1 << 16 else 4
    per_token = DIM * RESIDUAL_BITS / 8 + code_bytes + 4 * nearest["ivf_entries_per_token"]
    fixed = centroids * (DIM * 4 + 8) + n_docs * (8 + 12)  # centroids, IVF offsets; doc offsets and ids
    index_bytes = tokens * per_token + fixed
    train = min(tokens, 32 * centroids)
    peak_ratio = max(s["peak_over_final"] for s in sizes.values() if s["n_tokens"] > 1e7)
    by_tokens = sorted((s for s in sizes.values() if s["n_tokens"] > 1e7), key=lambda s: s["n_tokens"])
    low, top = by_tokens[0], by_tokens[-1]
    grow = (top["build_rss_anon_mb"] - low["build_rss_anon_mb"]) / (top["n_docs"] - low["n_docs"])
    search_grow = (top["search_rss_anon_mb"] - low["search_rss_anon_mb"]) / (top["n_docs"] - low["n_docs"])
    attended = tokens * args.attended_per_stored
    compress_s = (rates["compress_fixed_s_per_token"]
                  + rates["compress_s_per_dot"] * dots_per_token(centroids)) * tokens
    kmeans_s = rates["kmeans_s_per_unit"] * train * math.sqrt(centroids)
    host_s = (rates["join_s_per_token"] + rates["ivf_s_per_token"]) * tokens + rates["sample_s_per_token"] * train
    # On a GPU: exact k-means (4 iterations) and exact assignment, 2 D C flops a point, at the fp32 rate asked;
    # the residuals, join and inverted file at this CPU's rates (host work).
    gpu_kmeans_s = 2 * DIM * centroids * (4 * train + tokens) / (args.gpu_fp32_tflops * 1e12)
    fixed_per_token = rates["compress_fixed_s_per_token"] * tokens
    out = {"corpus": name, "n_docs": n_docs, "tokens_per_doc": per_doc, "tokens_measured": measured,
           "n_tokens": tokens, "n_centroids": centroids, "bytes_per_token": index_bytes / tokens,
           "index_bytes": index_bytes, "peak_disk_bytes": index_bytes * peak_ratio,
           "build_rss_anon_mb": top["build_rss_anon_mb"] + max(0.0, grow) * (n_docs - top["n_docs"]),
           "search_rss_anon_mb": top["search_rss_anon_mb"] + max(0.0, search_grow) * (n_docs - top["n_docs"]),
           "cpu_index_stages_s": compress_s + kmeans_s + host_s, "cpu_encode_s": {}, "gpu_encode_s": {},
           "gpu_index_stages_s": gpu_kmeans_s + fixed_per_token + host_s}
    for model, weights in LINEAR_WEIGHTS.items():
        cpu_rate = encoding["attended_tokens_per_s"] * LINEAR_WEIGHTS["all-MiniLM-L6-v2"] / weights
        out["cpu_encode_s"][model] = attended / cpu_rate
        out["gpu_encode_s"][model] = attended * 2 * weights / (args.gpu_tflops * 1e12)
    return out


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def markdown(rows: list[dict[str, Any]], record: dict[str, Any]) -> list[str]:
    rates = record["stage_rates"]
    enc = record["encoding"]
    lines = [SECTION[0], "## Every large BEIR corpus, projected (2-bit compressed-as-encoded PLAID index)", "",
             f"`python bench/beir_projection.py --scale {record['scale_file']} --markdown docs/results.md` "
             "(`bench/results/beir-projection.json`). *(P)* marks a projected figure; documents are counted "
             "(ir_datasets' metadata) and tokens per document measured on a copy where one is at hand (*est.*: "
             "estimated from BEIR's mean words per document on the length distribution of the nearest local "
             "corpus; MS MARCO's from the TREC DL19 passages' distribution at the collection's mean). Tokens are "
             "stored (scored) tokens at `doc_maxlen` 180, D = 128, 2-bit residuals, ColBERTv2's centroid rule. "
             f"From `bench/scale.py`'s builds on this 2-core CPU (largest {rates['from']}, "
             f"{rates['n_tokens'] / 1e6:.0f}M tokens, {rates['n_centroids']:,} centroids): bytes per token (the "
             "inverted file's entries per token at the nearest centroid count), peak disk over the final index, "
             "memory (growing with the documents as measured between the sizes), and the index stages' time: "
             "encode-and-compress per token as a fixed cost plus the two-level assignment's centroid products "
             "(fitted over the sizes), k-means per sampled token x sqrt(C), the join and inverted file per token. "
             f"Encoding: {enc['attended_tokens_per_s']:,.0f} attended tokens/s measured here (MiniLM-L6, fp32, "
             f"{enc['threads']} threads), bert-base (the paper's backbone) from it by its 8x the FLOPs a token. GPU "
             f"column: no GPU was lent; encoding at {record['settings']['gpu_tflops']:.0f} TFLOP/s of useful fp16 "
             f"work, exact k-means and assignment at {record['settings']['gpu_fp32_tflops']:.0f} TFLOP/s, the "
             "residuals, join and inverted file at this CPU's rates (host work); an H200 has an H100's compute, so "
             "the same figures.", "",
             "| corpus | docs | tokens/doc | tokens | centroids | index | B/token | peak disk | build RssAnon | "
             "search RssAnon | CPU: index stages | CPU: encode MiniLM / bert-base | H100/H200: encode bert-base + "
             "index (P) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mark = "" if row["tokens_measured"] else " est."
        lines.append(
            f"| {row['corpus']} | {row['n_docs']:,} | {row['tokens_per_doc']:.1f}{mark} | "
            f"{row['n_tokens'] / 1e6:,.0f}M | 2^{int(math.log2(row['n_centroids']))} | "
            f"{row['index_bytes'] / 1e9:.1f} GB (P) | {row['bytes_per_token']:.1f} (P) | "
            f"{row['peak_disk_bytes'] / 1e9:.1f} GB (P) | {row['build_rss_anon_mb'] / 1024:.1f} GB (P) | "
            f"{row['search_rss_anon_mb'] / 1024:.2f} GB (P) | {_duration(row['cpu_index_stages_s'])} (P) | "
            f"{_duration(row['cpu_encode_s']['all-MiniLM-L6-v2'])} / "
            f"{_duration(row['cpu_encode_s']['bert-base-uncased'])} (P) | "
            f"{_duration(row['gpu_encode_s']['bert-base-uncased'] + row['gpu_index_stages_s'])} (P) |")
    check = record["estimate_check"]
    lines += ["", "How good the length estimate is, tried on the corpora at hand "
                  "(each estimated from another's shape): "
              + "; ".join(f"{name} {c['estimated']:.1f} estimated vs {c['measured']:.1f} measured "
                          f"({100 * (c['estimated'] / c['measured'] - 1):+.0f}%)" for name, c in check.items()) + ".",
              SECTION[1]]
    return lines


def write_section(path: Path, lines: list[str]) -> None:
    text = path.read_text(encoding="utf-8")
    block = "\n".join(lines)
    if SECTION[0] in text:
        head, rest = text.split(SECTION[0], 1)
        _, tail = rest.split(SECTION[1], 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", default=str(HERE / "results" / "scale.json"))
    parser.add_argument("--data", default=os.environ.get("HIL_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "all-MiniLM-L6-v2"))
    parser.add_argument("--encode-docs", type=int, default=256, help="SciFact documents timed (0: reuse --output's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gpu-tflops", type=float, default=300.0, help="useful fp16 TFLOP/s of encoding (P)")
    parser.add_argument("--gpu-fp32-tflops", type=float, default=30.0, help="k-means TFLOP/s on a GPU (P)")
    parser.add_argument("--output", default=str(HERE / "results" / "beir-projection.json"))
    parser.add_argument("--markdown", default=None, help="a Markdown file whose projection section is (re)written")
    args = parser.parse_args(argv)
    data = Path(args.data)
    lengths = local_lengths(data, args.model)
    counts = doc_counts()
    measured_per_doc = {name: float(v["stored"].mean()) for name, v in lengths.items()}
    args.attended_per_stored = float(np.mean([v["attended"].sum() / v["stored"].sum() for v in lengths.values()]))
    check = {}
    for name, words in (("scifact", BEIR_MEAN_WORDS["scifact"]), ("nfcorpus", BEIR_MEAN_WORDS["nfcorpus"]),
                        ("msmarco", float(lengths["msmarco"]["words"].mean()))):
        shape = shape_for(float(lengths[name]["words"].mean()), lengths, exclude=name)
        check[name] = {"shape": shape, "measured": measured_per_doc[name],
                       "estimated": estimated_tokens(lengths[shape], float(lengths[name]["words"].mean()))}
    if args.encode_docs:
        encoding = encode_rate(args.model, data, args.encode_docs, args.threads)
    else:
        encoding = json.loads(Path(args.output).read_text())["results"]["encoding"]
    scale = json.loads(Path(args.scale).read_text())
    rates = stage_rates(scale)
    rows = []
    for name in LARGE:
        if name == "msmarco":  # DL19's passages are a biased sample: their shape, the collection's mean words
            per_doc, measured = estimated_tokens(lengths["msmarco"], BEIR_MEAN_WORDS["msmarco"]), False
        elif name in measured_per_doc:
            per_doc, measured = measured_per_doc[name], True
        else:
            words = BEIR_MEAN_WORDS[name]
            per_doc, measured = estimated_tokens(lengths[shape_for(words, lengths)], words), False
        rows.append(project(name, counts[name], per_doc, measured, rates, encoding, args))
    result = {"rows": rows, "encoding": encoding, "stage_rates": rates, "estimate_check": check,
              "local_tokens_per_doc": measured_per_doc, "attended_per_stored": args.attended_per_stored}
    from measure import write_results

    settings = {k: v for k, v in vars(args).items()}
    write_results(args.output, settings, argv, result)
    record = {**result, "settings": settings, "scale_file": os.path.relpath(args.scale, ROOT)}
    lines = markdown(rows, record)
    print("\n".join(lines))
    if args.markdown:
        write_section(Path(args.markdown), lines)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main(sys.argv[1:])
