"""Training triples read from disk by index (issue 14, item 3): the same triples, batches, resume points and IDF
as the in-memory list they replace, in bounded memory.

The references are written the obvious way: ``read_triples`` (the list), the sampler's documented order as a list
(``randperm(...).tolist()`` padded with its head and sliced), and a dict of distinct texts. Each test was checked by
breaking the code it guards and watching it fail (the list is in the final report of the change; e.g. an offset one
byte off, the BOM not skipped, a blank line not counted in line numbers, a wrong pid row, the resume position not
divided by the world size, the id layout's passages not deduplicated by text).
"""

from __future__ import annotations

import gzip
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from hil.data import line_index
from hil.data.beir import iter_text_lines
from hil.data.datamodule import EpochShuffleSampler, TrainingDataModule, TripleDataset, collate_triples
from hil.data.distinct import SeenHashes, iter_distinct
from hil.data.id_texts import DENSE, HASHED, INTEGER, IdTextFile
from hil.data.idf import IDFTable
from hil.data.line_index import LineIndex
from hil.data.triples import Triple, read_triples, write_triples
from hil.data.triples_file import IdTriples, IdTriplesFile, TextTriples, TriplesFile
from hil.errors import DataFormatError
from hil.paths import resolve_data_file

HEAD = "msmarco/triples.train.small.head1000.tsv"
ROWS = ["what is a cat\tA cat is a small feline.\tDogs bark.", "how tall is k2\tK2 is 8,611 m.\tEverest is higher.",
        "éclair recipe\tChoux pastry, cream.\tBread.", "\u00a0 odd start\tpos\tneg", "q5\tp5\tn5"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Offsets of files in read-only folders (the shared sample) go to this test's folder, not ~/.cache."""
    monkeypatch.setenv("HIL_CACHE_DIR", str(tmp_path / "cache"))


def write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def head_file() -> Path:
    try:
        return resolve_data_file(HEAD)
    except FileNotFoundError:
        pytest.skip(f"no {HEAD} under HIL_DATA_DIR")


# -- the same lines as iter_text_lines -----------------------------------------------------------------------------
LAYOUTS = {
    "plain": "\n".join(ROWS) + "\n",
    "bom, crlf, blank lines, no final newline": "\ufeff" + "\r\n \r\n\t\r\n".join(ROWS) + "\r\n\u3000\r\n\n" + ROWS[0],
    "blank first lines and a bom-only first line": "\ufeff\n\n \n" + "\n\n".join(ROWS) + "\n \n\n",
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block", [7, 1 << 24])
def test_items_are_read_triples_items_line_for_line(tmp_path, monkeypatch, layout, block):
    monkeypatch.setattr(line_index, "_BLOCK", block)  # 7: lines straddle the blocks of the scan
    path = write(tmp_path / "t.tsv", LAYOUTS[layout])
    expected = read_triples(path)
    data = TriplesFile(path)
    assert len(data) == len(expected) >= len(ROWS)
    assert [data[i] for i in range(len(data))] == expected == list(data)
    assert [data.lines.line(i) for i in range(len(data))] == list(iter_text_lines(path))  # line numbers too
    assert data[-1] == expected[-1]
    with pytest.raises(IndexError):
        data[len(data)]
    assert [TriplesFile(path, limit=2)[i] for i in range(2)] == expected[:2] and len(TriplesFile(path, limit=2)) == 2


def test_random_files_index_exactly_like_iter_text_lines(tmp_path, monkeypatch):
    """Random mixes of BOM, CRLF, tabs, Unicode blanks (U+00A0, U+3000, U+0085, \\x1c), invalid UTF-8 and missing
    final newlines: the same (line number, text) pairs, or the same error."""
    monkeypatch.setattr(line_index, "_BLOCK", 23)
    rng = random.Random(0)
    pieces = ["a", "b\tc", " ", "\t", "\r", "é", "\u00a0", "\u3000", "\x85", "\x1c", "\x0c", "x y"]
    for trial in range(300):
        text = "\n".join("".join(rng.choice(pieces) for _ in range(rng.randint(0, 5)))
                         for _ in range(rng.randint(0, 9)))
        text += "\n" if rng.random() < 0.5 else ""
        text = text.replace("\n", "\r\n") if rng.random() < 0.3 else text
        data = (b"\xef\xbb\xbf" if rng.random() < 0.3 else b"") + text.encode("utf-8")
        if data and rng.random() < 0.1:
            cut = rng.randrange(len(data))
            data = data[:cut] + b"\xff" + data[cut:]
        path = write(tmp_path / f"f{trial}.tsv", data)
        try:
            expected = list(iter_text_lines(path))
        except DataFormatError as error:
            with pytest.raises(DataFormatError) as raised:
                LineIndex(path)
            assert str(raised.value) == str(error), data
            continue
        index = LineIndex(path)
        assert [index.line(i) for i in range(len(index))] == expected, data


def test_the_msmarco_sample_item_for_item():
    path = head_file()
    data = TriplesFile(path)
    expected = read_triples(path)
    assert len(data) == 1000 and [data[i] for i in range(1000)] == expected
    order = list(range(1000))
    random.Random(1).shuffle(order)
    assert all(data[i] == expected[i] for i in order)
    assert len(TriplesFile(path, limit=10)) == 10


def test_a_line_longer_than_a_read(tmp_path):
    long = "word " * 300_000  # 1.5 MB: more than one pread
    path = write(tmp_path / "t.tsv", f"q\t{long}\tn\n\n\nq2\tp2\tn2")
    assert [TriplesFile(path)[i] for i in range(2)] == read_triples(path)


# -- bad lines: the error read_triples gives, at the physical line ----------------------------------------------------
@pytest.mark.parametrize("bad, line", [("only\ttwo", 5), ("a\tb\tc\td", 5), ("\xff bytes", 5)])
def test_a_bad_line_is_named_when_the_offsets_are_taken(tmp_path, bad, line):
    rows = ROWS[:2] + ["", "  "] + [bad] + ROWS[2:]
    content = "\n".join(rows).encode("utf-8").replace("\xff".encode("utf-8"), b"\xff")
    path = write(tmp_path / "t.tsv", content)
    with pytest.raises(DataFormatError) as expected:
        read_triples(path)
    with pytest.raises(DataFormatError) as raised:
        TriplesFile(path)
    assert raised.value.line == line == expected.value.line and str(raised.value) == str(expected.value)


def test_an_empty_column_is_named_when_read(tmp_path):
    path = write(tmp_path / "t.tsv", "\n".join(ROWS[:3] + ["", "q\t \tn"] + ROWS[3:]))
    data = TriplesFile(path)
    assert data[2] == read_triples(path, limit=3)[2]
    with pytest.raises(DataFormatError, match=r"t\.tsv:5: empty positive column"):
        data[3]
    with pytest.raises(DataFormatError, match="no triples"):
        TriplesFile(write(tmp_path / "blank.tsv", "\n \n"))


# -- the offsets cache ------------------------------------------------------------------------------------------------
def test_a_stale_offsets_cache_is_never_used(tmp_path):
    path = write(tmp_path / "t.tsv", "\n".join(ROWS))
    assert TriplesFile(path)[0].query == "what is a cat"
    cache = tmp_path / "cache"
    assert len(list(cache.glob("*.lines.npy"))) == 1
    before = os.stat(path)
    # same size, same mtime, the lines in another order (they start elsewhere): only the content hash tells
    write(path, "\n".join(reversed(ROWS)))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size
    assert [TriplesFile(path)[i] for i in range(len(ROWS))] == read_triples(path)
    # another length: lines move
    write(path, "\n\n" + "\n".join(ROWS[1:]))
    assert [TriplesFile(path)[i] for i in range(len(ROWS) - 1)] == read_triples(path)


def test_the_cache_is_reused_and_kept_where_writable(tmp_path, monkeypatch):
    path = write(tmp_path / "t.tsv", "\n".join(ROWS))
    TriplesFile(path)

    def no_scan(*args, **kwargs):
        raise AssertionError("scanned again")

    monkeypatch.setattr(line_index, "scan_lines", no_scan)
    assert TriplesFile(path)[4] == read_triples(path)[4]
    monkeypatch.delenv("HIL_CACHE_DIR")  # without it: beside the data when writable ...
    assert line_index.cache_file(path, "lines") == tmp_path / ".t.tsv.lines.npy"
    folder = tmp_path / "read-only"
    folder.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    folder.chmod(0o555)  # ... else in the user's cache, even for root
    try:
        assert line_index.cache_file(folder / "t.tsv", "lines").parent == tmp_path / "home-cache" / "hil"
    finally:
        folder.chmod(0o755)


def test_without_a_writable_cache_the_offsets_stay_in_memory(tmp_path, monkeypatch):
    path = write(tmp_path / "t.tsv", "\n".join(ROWS))
    monkeypatch.setattr(line_index, "save_cache", lambda *args: False)
    data = TriplesFile(path)
    assert data.lines.cache is None and [data[i] for i in range(5)] == read_triples(path)
    assert [copy[i] for copy in [pickle.loads(pickle.dumps(data))] for i in range(5)] == read_triples(path)


# -- the id layout ----------------------------------------------------------------------------------------------------
def id_layout(folder: Path, triples: list[Triple], kind: str) -> tuple[Path, Path, Path]:
    """The three files of the id layout for ``triples``: pids 0..N-1 in collection order ("dense"), integers in a
    shuffled collection ("integer"), or strings ("hashed"); blank lines and a BOM in the id files."""
    folder.mkdir(parents=True, exist_ok=True)
    passages = list(dict.fromkeys(text for t in triples for text in (t.positive, t.negative)))
    queries = list(dict.fromkeys(t.query for t in triples))
    pid = {"dense": lambda k: str(k), "integer": lambda k: str(10_000_000_000 + 7919 * k),
           "hashed": lambda k: f"doc-{k}"}[kind]
    qid = (lambda k: str(k * 3 + 1)) if kind != "hashed" else (lambda k: f"query/{k}")
    rows = [f"{pid(k)}\t{text}" for k, text in enumerate(passages)]
    if kind != "dense":
        random.Random(2).shuffle(rows)
    query_rows = [f"{qid(k)}\t{text}" for k, text in enumerate(queries)]
    random.Random(3).shuffle(query_rows)
    pids, qids = {t: pid(k) for k, t in enumerate(passages)}, {t: qid(k) for k, t in enumerate(queries)}
    paths = folder / "qidpidtriples.tsv", folder / "queries.tsv", folder / "collection.tsv"
    write(paths[0], "\n".join(f"{qids[t.query]}\t{pids[t.positive]}\t{pids[t.negative]}" for t in triples) + "\n")
    write(paths[1], "\ufeff" + "\n".join(query_rows) + "\n\n")
    write(paths[2], "\ufeff" + "\n \n".join(rows))
    return paths


@pytest.mark.parametrize("kind, mode", [("dense", DENSE), ("integer", INTEGER), ("hashed", HASHED)])
def test_id_triples_are_the_text_triples_they_name(tmp_path, kind, mode):
    expected = read_triples(head_file())
    paths = id_layout(tmp_path / kind, expected, kind)
    data = IdTriplesFile(*paths)
    assert data.collection.mode == mode
    assert len(data) == 1000 and [data[i] for i in range(1000)] == expected == list(data)
    again = IdTriplesFile(*paths, limit=7)  # from the caches
    assert len(again) == 7 and [again[i] for i in range(7)] == expected[:7]
    table = IdTextFile(paths[2])
    assert table.text("no-such-id") is None and table.find(["no-such-id", "999999999999", "-1"]).tolist() == [-1] * 3


def test_ids_are_strings_even_when_they_look_like_numbers(tmp_path):
    table = IdTextFile(write(tmp_path / "c.tsv", "07\tseven with a zero\n7\tseven\n+7\tplus seven\n"))
    assert [table.text(i) for i in ("07", "7", "+7", "007")] == ["seven with a zero", "seven", "plus seven", None]
    table = IdTextFile(write(tmp_path / "c2.tsv", "7\tseven\n07\tseven with a zero\n"))
    assert table.mode == HASHED and [table.text(i) for i in ("07", "7")] == ["seven with a zero", "seven"]


def test_an_unknown_or_repeated_id_is_named(tmp_path):
    queries = write(tmp_path / "queries.tsv", "1\twhat is a cat\n2\thow tall is k2\n")
    collection = write(tmp_path / "collection.tsv", "0\ta cat\n1\ta dog\n2\tK2\n")
    triples = write(tmp_path / "triples.tsv", "1\t0\t1\n\n2\t2\t7\n")
    data = IdTriplesFile(triples, queries, collection)
    assert data[0] == Triple("what is a cat", "a cat", "a dog")
    assert data.collection.mode == DENSE and data.collection.row("2") == 2
    assert data.collection.row("7") == -1 and data.collection.find(["7", "2"]).tolist() == [-1, 2]
    with pytest.raises(DataFormatError, match=r"triples\.tsv:3: negative id '7' is not in .*collection\.tsv"):
        data[1]
    with pytest.raises(DataFormatError, match=r"triples\.tsv:3: negative id '7'"):
        list(data.iter_passages())
    with pytest.raises(DataFormatError, match=r"t2\.tsv:1: query id '9' is not in"):
        IdTriplesFile(write(tmp_path / "t2.tsv", "9\t0\t1\n"), queries, collection)[0]
    with pytest.raises(DataFormatError, match=r"collection2\.tsv:4: duplicate id 'b' \(first on line 2\)"):
        IdTextFile(write(tmp_path / "collection2.tsv", "a\tx\nb\ty\n\nb\tz\n"))
    with pytest.raises(DataFormatError, match=r"t3\.tsv:2: expected 3 tab-separated columns"):
        IdTriplesFile(write(tmp_path / "t3.tsv", "1\t0\t1\n1\t0\n"), queries, collection)


def test_a_hash_collision_never_gives_a_wrong_text(tmp_path, monkeypatch):
    from hil.data import id_texts

    monkeypatch.setattr(id_texts, "hashed_id", len)  # every id of one length collides
    table = IdTextFile(write(tmp_path / "c.tsv", "ab\tfirst\nxyz\tsecond\n"))
    assert table.mode == HASHED and table.text("ab") == "first" and table.text("xyz") == "second"
    assert table.text("cd") is None  # same hash as "ab", another id
    with pytest.raises(DataFormatError, match=r"c2\.tsv:2: ids 'cd' and 'ab' \(line 1\) have the same 64-bit hash"):
        IdTextFile(write(tmp_path / "c2.tsv", "ab\tfirst\ncd\tsecond\n"))


# -- batches: the same as the in-memory list's ----------------------------------------------------------------------
def documented_shard(size: int, seed: int, epoch: int, world: int, rank: int, drop_last: bool = False,
                     shuffle: bool = True) -> list[int]:
    """The sampler as it was (a list of Python ints): randperm, padded with its own head or cut, then sliced."""
    order = (torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist() if shuffle
             else list(range(size)))
    total = (size // world if drop_last and size % world else -(-size // world)) * world
    while len(order) < total:
        order += order[: total - len(order)]
    return order[:total][rank::world]


@pytest.mark.parametrize("size, world", [(10, 1), (10, 3), (3, 8), (1, 4), (100, 7)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_sampler_draws_the_documented_indices(size, world, drop_last, shuffle):
    for rank in range(world):
        sampler = EpochShuffleSampler(size, 5, shuffle=shuffle, num_replicas=world, rank=rank, drop_last=drop_last)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            assert list(sampler) == documented_shard(size, 5, epoch, world, rank, drop_last, shuffle)


def test_the_sampler_is_the_same_across_its_chunks(monkeypatch):
    from hil.data import datamodule

    monkeypatch.setattr(datamodule, "_SHARD_CHUNK", 3)  # positions are turned into ints 3 at a time per rank
    for world, start in [(1, 0), (2, 0), (3, 1), (2, 4)]:
        for rank in range(world):
            sampler = EpochShuffleSampler(50, 9, num_replicas=world, rank=rank)
            sampler.resume_at(0, start * world)
            assert list(sampler) == documented_shard(50, 9, 0, world, rank)[start:], (world, rank, start)


def old_batches(triples: list[Triple], batch_size: int, seed: int, epoch: int, world: int, rank: int) -> list[dict]:
    shard = documented_shard(len(triples), seed, epoch, world, rank)
    return [collate_triples([triples[i] for i in shard[b: b + batch_size]]) for b in range(0, len(shard), batch_size)]


def streamed_loader(dataset, batch_size: int, seed: int, world: int, rank: int, workers: int = 0):
    sampler = EpochShuffleSampler(len(dataset), seed, num_replicas=world, rank=rank)
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_triples,
                              num_workers=workers, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("world", [1, 2])
def test_streamed_batches_equal_the_in_memory_list(world):
    path = head_file()
    triples = read_triples(path, limit=301)
    data = TrainingDataModule(TextTriples(str(path)), max_triples=301, batch_size=16, seed=11)
    data.setup("fit")
    assert isinstance(data.train_dataset, TriplesFile)
    for rank in range(world):
        loader = data.train_dataloader() if world == 1 else streamed_loader(data.train_dataset, 16, 11, world, rank)
        for epoch in (0, 1):
            loader.sampler.set_epoch(epoch)
            assert list(loader) == old_batches(triples, 16, 11, epoch, world, rank), (rank, epoch)


@pytest.mark.parametrize("world, stop_after", [(1, 3), (2, 2), (2, 9)])
def test_exact_resume_from_a_streamed_file(world, stop_after):
    path = head_file()
    data = TrainingDataModule(TextTriples(str(path)), max_triples=150, batch_size=8, seed=4)
    data.setup("fit")
    states = []
    for rank in range(world):
        crashed = streamed_loader(data.train_dataset, 8, 4, world, rank)
        crashed.sampler.set_epoch(1)
        batches = iter(crashed)
        for _ in range(stop_after):
            next(batches)
        states.append(crashed.state_dict())
    for rank in range(world):
        full = old_batches(read_triples(path, limit=150), 8, 4, 1, world, rank)
        resumed = streamed_loader(data.train_dataset, 8, 4, world, rank)
        resumed.load_state_dict(states[0])  # rank 0's state: what Lightning saves
        resumed.sampler.set_epoch(1)
        assert list(resumed) == full[stop_after:], rank


# -- workers and ranks get the datasets by pickle --------------------------------------------------------------------
def test_datasets_pickle_small_and_serve_two_loader_workers(tmp_path):
    expected = read_triples(head_file(), limit=200)
    text = TriplesFile(head_file(), limit=200)
    ids = IdTriplesFile(*id_layout(tmp_path / "ids", expected, "integer"))
    for data in (text, ids):
        data[0]  # an open file handle must not travel
        blob = pickle.dumps(data)
        assert len(blob) < 4096, len(blob)  # paths and cache names, not arrays
        copy = pickle.loads(blob)
        assert [copy[i] for i in range(200)] == expected
        with_workers = list(streamed_loader(data, 16, 3, 1, 0, workers=2))
        assert with_workers == old_batches(expected, 16, 3, 0, 1, 0)
    # a worker that gets the dataset by pickle (spawn, as on macOS or with DDP's spawn launcher)
    spawned = StatefulDataLoader(ids, batch_size=100, collate_fn=list, num_workers=1, multiprocessing_context="spawn")
    assert [t for batch in spawned for t in batch] == expected


# -- IDF from the streamed triples: the in-memory computation's ------------------------------------------------------
def distinct_in_memory(texts) -> list[str]:
    """The old ``distinct_texts``: a dict of every text."""
    return list(dict.fromkeys(texts))


def test_seen_hashes_is_a_set():
    rng = np.random.default_rng(0)
    seen, reference = SeenHashes(), set()
    for _ in range(200):
        values = rng.integers(-50, 400, size=rng.integers(1, 30))
        fresh = seen.add_new(values)
        expected = []
        for v in values.tolist():
            expected.append(v not in reference)
            reference.add(v)
        assert fresh.tolist() == expected
    assert len(seen) == len(reference) and len(seen.runs) <= 10
    texts = [f"t{i % 37}" for i in range(10_000)]
    assert list(iter_distinct(texts)) == distinct_in_memory(texts)
    assert list(iter_distinct(texts, limit=5)) == distinct_in_memory(texts)[:5]


@pytest.mark.parametrize("layout", ["text", "ids"])
@pytest.mark.parametrize("source", ["train", "train_queries"])
def test_streaming_idf_equals_the_in_memory_idf(tmp_path, hf_tokenizer, layout, source):
    triples = read_triples(head_file(), limit=300)
    triples += [Triple(t.query, t.negative, t.positive) for t in triples[:100]]  # queries and passages again
    write_triples(tmp_path / "t.tsv", triples)
    reader = (TextTriples(str(tmp_path / "t.tsv")) if layout == "text" else
              IdTriples(*map(str, id_layout(tmp_path, triples, "hashed"))))
    for limit in (None, 50):
        data = TrainingDataModule(reader, idf_source=source, idf_max_docs=limit)
        data.setup("fit")
        texts, label = data.idf_documents()
        wanted = (distinct_in_memory(x for t in triples for x in (t.positive, t.negative)) if source == "train"
                  else distinct_in_memory(t.query for t in triples))[:limit]
        assert list(texts) == wanted and list(texts) == wanted  # the same texts, again at a second pass
        streamed, in_memory = IDFTable.from_texts(hf_tokenizer, texts), IDFTable.from_texts(hf_tokenizer, wanted)
        assert streamed.n_documents == in_memory.n_documents == len(wanted)
        assert torch.equal(streamed.document_frequency, in_memory.document_frequency)
        assert torch.equal(streamed.to_tensor(), in_memory.to_tensor())


def test_the_id_layout_counts_a_passage_repeated_under_two_pids_once(tmp_path):
    queries = write(tmp_path / "queries.tsv", "1\tcats\n2\tdogs\n")
    collection = write(tmp_path / "collection.tsv", "0\ta cat\n1\ta dog\n2\ta cat\n")
    triples = write(tmp_path / "triples.tsv", "1\t0\t1\n2\t2\t1\n1\t1\t0\n")
    data = TrainingDataModule(IdTriples(str(triples), str(queries), str(collection)))
    data.setup("fit")
    assert list(data.train_dataset.iter_passages()) == ["a cat", "a dog", "a cat"]  # each pid once (bitmap)
    assert list(data.idf_documents()[0]) == ["a cat", "a dog"]  # each text once
    data = TrainingDataModule(IdTriples(str(triples), str(queries), str(collection)), idf_source="train_queries")
    data.setup("fit")
    assert list(data.idf_documents()[0]) == ["cats", "dogs"]


# -- settings ---------------------------------------------------------------------------------------------------------
def test_data_module_settings(tmp_path):
    # the spelling before 0.3 keeps its refusals (hil.data.old_source_keys)
    with pytest.raises(ValueError, match="exactly one"):
        TrainingDataModule(triples="a.tsv", id_triples="b.tsv", queries="q", collection="c")
    with pytest.raises(ValueError, match="go together"):
        TrainingDataModule(id_triples="b.tsv", queries="q.tsv")
    gz = tmp_path / "t.tsv.gz"
    gz.write_bytes(gzip.compress("\n".join(ROWS).encode("utf-8")))
    data = TrainingDataModule(TextTriples(str(gz)), max_triples=3)
    data.setup("fit")
    assert isinstance(data.train_dataset, TripleDataset) and data.train_dataset.triples == read_triples(gz, limit=3)
    path = write(tmp_path / "t.tsv", "\n".join(ROWS))
    data = TrainingDataModule(TextTriples(str(path)), cache_dir=str(tmp_path / "elsewhere"))
    data.prepare_data()
    assert list((tmp_path / "elsewhere").glob("t.tsv.*.lines.npy"))
    with pytest.raises(ValueError, match="no training triples"):
        TrainingDataModule(TextTriples(str(path)), max_triples=0).setup("fit")


@pytest.mark.parametrize("size", [1, 17, 100_003, 3_000_000])
def test_int32_permutation_draws_the_numbers_of_int64(size):
    """The sampler keeps its permutation in int32 (half the memory); the batches of runs made with int64, and their
    checkpoints' resume points, stay valid only because torch draws the same numbers."""
    sampler = EpochShuffleSampler(size, seed=5, num_replicas=1, rank=0)
    sampler.set_epoch(3)
    drawn = sampler.permutation()
    assert drawn.dtype == torch.int32
    reference = torch.randperm(size, generator=torch.Generator().manual_seed(5 + 3))  # int64, as before
    assert torch.equal(drawn.long(), reference)
