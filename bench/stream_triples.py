"""Training triples streamed from disk (issue 14): what reading an MS MARCO-sized triples file costs.

    python bench/stream_triples.py --folder /tmp/hil-bench-triples --lines 4000000 --delete

Generates (when absent, reproducibly from ``--seed``) a text triples file of ``--lines`` lines with MS MARCO's
lengths (queries ~35 characters, passages ~350; ~740 bytes a line, so 4M lines are ~3 GB) and the id layout of the
same triples (``qidpidtriples`` + ``queries`` + ``collection``; a pool of ``lines / 4`` passages with pids 0..N-1 and
``lines / 100`` queries with scattered integer qids, MS MARCO's proportions), plus the first ``--small-lines`` lines
of both. Then, each in a fresh child process (so each peak RSS, ``ru_maxrss``, is that measurement's alone):

- ``offsets``: seconds to take the line offsets of a file (first open, no cache);
- ``first batch``: ``TrainingDataModule`` setup + the first batch of ``--batch`` through its ``StatefulDataLoader``,
  ``cold`` (no offsets cache) and ``cached``;
- ``read``: triples/s over ``--read`` triples in the shuffled order of the sampler, by 1 process and by 2
  processes at once (ranks 0 and 1 of a simulated world of 2, each reading ``--read``);
- ``list``: the previous way, ``read_triples`` into a list, to first batch (the small file only).

The data files stay in the page cache after generation (the machine has the memory), so "cold" means "no offsets
cache", not "nothing in the page cache". The machine is shared: timings are rough; memory figures are not.
Prints a table and writes JSON to ``bench/results/stream_triples.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULT_PREFIX = "BENCH-RESULT "
_CHUNK = 100_000  # lines generated and written at a time


# -- data -------------------------------------------------------------------------------------------------------------
def _texts(rng, vocabulary: list[str], count: int, words: tuple[int, int]) -> list[str]:
    """``count`` texts of ``words`` (low, high) random words each (``rng``: a numpy Generator)."""
    import numpy as np

    lengths = rng.integers(words[0], words[1] + 1, size=count)
    picks = rng.integers(len(vocabulary), size=int(lengths.sum())).tolist()
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return [" ".join([vocabulary[i] for i in picks[start:stop]]) for start, stop in zip(bounds[:-1], bounds[1:])]


def data_files(folder: Path, lines: int, small_lines: int) -> dict[str, Path]:
    names = {"text": f"triples.{lines}.tsv", "ids": f"qidpidtriples.{lines}.tsv", "queries": f"queries.{lines}.tsv",
             "collection": f"collection.{lines}.tsv", "text_small": f"triples.{lines}.head{small_lines}.tsv",
             "ids_small": f"qidpidtriples.{lines}.head{small_lines}.tsv"}
    return {key: folder / name for key, name in names.items()}


def generate(folder: Path, lines: int, small_lines: int, seed: int) -> dict[str, Path]:
    """Write the files of :func:`data_files` unless they are all there (see the module docstring)."""
    import numpy as np

    files = data_files(folder, lines, small_lines)
    if all(path.is_file() for path in files.values()):
        return files
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(2, 11, size=20_000)]
    n_queries, n_passages = max(1000, lines // 100), max(1000, lines // 4)
    queries = _texts(rng, vocabulary, n_queries, (4, 7))         # ~35 characters
    passages = _texts(rng, vocabulary, n_passages, (40, 60))     # ~350 characters (words: 6 letters + a space)
    qids = rng.choice(3 * n_queries, size=n_queries, replace=False)
    with open(files["queries"], "w", encoding="utf-8") as handle:
        handle.writelines(f"{qid}\t{text}\n" for qid, text in zip(qids.tolist(), queries))
    with open(files["collection"], "w", encoding="utf-8") as handle:
        handle.writelines(f"{pid}\t{text}\n" for pid, text in enumerate(passages))
    with open(files["text"], "w", encoding="utf-8") as text, open(files["ids"], "w", encoding="utf-8") as ids:
        for first in range(0, lines, _CHUNK):
            count = min(_CHUNK, lines - first)
            q = rng.integers(n_queries, size=count).tolist()
            pos, neg = rng.integers(n_passages, size=(2, count)).tolist()
            text.write("".join(f"{queries[a]}\t{passages[b]}\t{passages[c]}\n" for a, b, c in zip(q, pos, neg)))
            ids.write("".join(f"{qids[a]}\t{b}\t{c}\n" for a, b, c in zip(q, pos, neg)))
    for big, small in (("text", "text_small"), ("ids", "ids_small")):
        with open(files[big], "rb") as source, open(files[small], "wb") as target:
            for _ in range(small_lines):
                target.write(source.readline())
    return files


# -- measurements (children) ------------------------------------------------------------------------------------------
def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _data_settings(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["layout"] == "text":
        return {"triples": spec["triples"]}
    return {"id_triples": spec["triples"], "queries": spec["queries"], "collection": spec["collection"]}


def _clear_cache(cache: Path) -> None:
    shutil.rmtree(cache, ignore_errors=True)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement (``spec["what"]``), in this fresh process."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from hil.data.datamodule import EpochShuffleSampler, TrainingDataModule, collate_triples
    from hil.data.triples import read_triples
    from hil.data.triples_file import IdTriplesFile, TriplesFile

    torch.set_num_threads(1)
    cache, what, out = Path(spec["cache"]), spec["what"], {"imports_rss_mb": _peak_rss_mb()}
    if what in ("offsets", "first_batch_cold"):
        _clear_cache(cache)
    start = time.perf_counter()
    if what == "offsets":
        data = (TriplesFile(spec["triples"], cache_dir=cache) if spec["layout"] == "text" else
                IdTriplesFile(spec["triples"], spec["queries"], spec["collection"], cache_dir=cache))
        out["triples"] = len(data)
        out["cache_bytes"] = sum(path.stat().st_size for path in cache.glob("*.npy"))
    elif what in ("first_batch_cold", "first_batch_cached"):
        module = TrainingDataModule(**_data_settings(spec), batch_size=spec["batch"], cache_dir=str(cache))
        module.setup("fit")
        batch = next(iter(module.train_dataloader()))
        out["batch"] = len(batch["queries"])
    elif what == "list":
        triples = read_triples(spec["triples"])
        sampler = EpochShuffleSampler(len(triples), 12345, num_replicas=1, rank=0)
        loader = StatefulDataLoader(triples, batch_size=spec["batch"], sampler=sampler, collate_fn=collate_triples)
        out["batch"] = len(next(iter(loader))["queries"])
    elif what == "read":
        module = TrainingDataModule(**_data_settings(spec), batch_size=spec["batch"], cache_dir=str(cache))
        module.setup("fit")
        sampler = EpochShuffleSampler(len(module.train_dataset), 12345, num_replicas=spec["world"], rank=spec["rank"])
        loader = StatefulDataLoader(module.train_dataset, batch_size=spec["batch"], sampler=sampler,
                                    collate_fn=collate_triples)
        start, read = time.perf_counter(), 0
        for batch in loader:
            read += len(batch["queries"])
            if read >= spec["read"]:
                break
        out["read"] = read
        out["triples_per_s"] = read / (time.perf_counter() - start)
    out["seconds"] = time.perf_counter() - start
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def run_children(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run one child per spec, all at once; their results in order."""
    processes = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
                 for spec in specs]
    results = []
    for process, spec in zip(processes, specs):
        stdout, stderr = process.communicate()
        line = next((x for x in stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
        if process.returncode != 0 or line is None:
            raise RuntimeError(f"child {spec['what']} failed:\n{stderr[-3000:]}")
        results.append({**spec, **json.loads(line[len(RESULT_PREFIX):])})
    return results


# -- the run ----------------------------------------------------------------------------------------------------------
def plan(files: dict[str, Path], args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """Groups of child specs; the specs of one group run at the same time."""
    groups = []
    for size, suffix in ((args.small_lines, "_small"), (args.lines, "")):
        for layout in ("text", "ids"):
            base = {"layout": layout, "lines": size, "batch": args.batch, "triples": str(files[layout + suffix]),
                    "queries": str(files["queries"]), "collection": str(files["collection"]),
                    "cache": str(args.folder / f"cache-{layout}{suffix}")}
            for what in ("offsets", "first_batch_cold", "first_batch_cached"):
                groups.append([{**base, "what": what}])
            groups.append([{**base, "what": "read", "read": args.read, "world": 1, "rank": 0}])
            groups.append([{**base, "what": "read", "read": args.read, "world": 2, "rank": rank} for rank in (0, 1)])
        if args.list_baseline and size == args.small_lines:
            groups.append([{"layout": "text (list)", "lines": size, "batch": args.batch, "what": "list",
                            "triples": str(files["text_small"]), "cache": str(args.folder / "cache-list")}])
    return groups


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'layout':<12}{'lines':>10}  {'measurement':<22}{'seconds':>9}{'triples/s':>12}{'peak RSS MB':>13}"
             f"{'of which imports':>18}"]
    for row in rows:
        label = row["what"] + (f" rank {row['rank']}/{row['world']}" if row["what"] == "read" else "")
        rate = f"{row['triples_per_s']:,.0f}" if "triples_per_s" in row else "-"
        lines.append(f"{row['layout']:<12}{row['lines']:>10,}  {label:<22}{row['seconds']:>9.2f}{rate:>12}"
                     f"{row['peak_rss_mb']:>13,.0f}{row['imports_rss_mb']:>18,.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/hil-bench-triples"),
                        help="where the generated data and offsets go (not the repository)")
    parser.add_argument("--lines", type=int, default=4_000_000, help="triples of the big file")
    parser.add_argument("--small-lines", type=int, default=1_000_000, help="triples of the small file")
    parser.add_argument("--read", type=int, default=200_000, help="shuffled triples read per process")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-list-baseline", dest="list_baseline", action="store_false",
                        help="skip read_triples into a list (the previous way) on the small file")
    parser.add_argument("--delete", action="store_true", help="delete the folder afterwards (the data is large)")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "stream_triples.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(RESULT_PREFIX + json.dumps(child(json.loads(args.child))), flush=True)
        return 0

    if args.generate_only:
        generate(args.folder, args.lines, args.small_lines, args.seed)
        return 0
    # Generating holds GBs of texts; a child does it, because an exec'ed child's ru_maxrss starts at its parent's
    # resident size (Linux keeps the high-water mark across fork + exec), and this parent starts every measurement.
    started = time.perf_counter()
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--generate-only", "--folder", str(args.folder),
                    "--lines", str(args.lines), "--small-lines", str(args.small_lines), "--seed", str(args.seed)],
                   check=True)
    files = data_files(args.folder, args.lines, args.small_lines)
    generated = time.perf_counter() - started
    sizes = {key: path.stat().st_size for key, path in files.items()}
    rows = []
    for group in plan(files, args):
        rows.extend(run_children(group))
        print(table(rows[-len(group):]).split("\n", 1)[1], flush=True)
    print()
    print(table(rows))
    from hil.provenance import write_json_atomic

    write_json_atomic(args.output, {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("child", "generate_only")},
        "file_bytes": sizes, "generate_seconds": generated, "total_seconds": time.perf_counter() - started,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_after": list(os.getloadavg())},
        "parent_peak_rss_mb": _peak_rss_mb(),
        "rows": rows})
    print(f"\nwrote {args.output}")
    if args.delete:
        shutil.rmtree(args.folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
